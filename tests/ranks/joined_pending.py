"""``derived.each``: the handle of several collectives, over ones still running (mpirun -np 2).

Rank 1 holds back: it joins the first all_reduce only after rank 0 has looked at the
joined handle, and the second only after rank 0 has seen the first complete. Rank 0 checks
that the handle is incomplete, with no callback run, until its last handle completes.
Argument: a directory both ranks see, for rank 0's "go" files.
"""

from __future__ import annotations

import pathlib
import sys
import time

import torch

import smddp.torch.distributed as dist
from smddp.comm.algorithms import derived
from smddp.comm.reduction import Op
from smddp.torch import groups

DEADLINE = 60.0


def wait_for(path: pathlib.Path) -> None:
    end = time.monotonic() + DEADLINE
    while not path.exists():
        assert time.monotonic() < end, f"rank 1: {path} never appeared"
        time.sleep(0.01)


def inputs(rank: int):
    g = torch.Generator().manual_seed(1234 + rank)
    return [torch.randint(-50, 50, (5,), generator=g).double(), torch.randint(-50, 50, (7,), generator=g).double()]


def main() -> None:
    signals = pathlib.Path(sys.argv[1])
    dist.init_process_group()
    rank, size = dist.get_rank(), dist.get_world_size()
    assert size == 2, size
    engine = groups.current().engine
    # The group's first collective maps its shared memory with every rank of the host in it (as
    # NCCL's first makes its communicator): made here, so that rank 0's starts below need no peer.
    dist.all_reduce(torch.zeros(1))
    mine = inputs(rank)
    want = [sum(inputs(r)[i] for r in range(size)) for i in range(2)]
    if rank == 0:
        handles = []

        def start(tensor):
            handles.append(engine.all_reduce(tensor, Op.SUM, async_op=True))
            return handles[-1]

        joined = derived.each(engine, start, mine)
        seen = []
        joined.add_done_callback(seen.append)
        time.sleep(0.2)  # rank 1 has not joined either: neither can have completed
        assert not joined.is_completed() and seen == [] and joined.exception() is None
        (signals / "first").touch()
        handles[0].wait()
        # One of two done: the handle is not, and its callback has not run.
        assert not joined.is_completed() and seen == [], (joined.is_completed(), seen)
        assert torch.equal(mine[0], want[0])
        (signals / "second").touch()
        assert joined.wait() is True
        end = time.monotonic() + DEADLINE
        while not seen and time.monotonic() < end:  # callbacks may run on the progress thread
            time.sleep(0.001)
        assert joined.is_completed() and seen == [joined] and joined.exception() is None
    else:
        wait_for(signals / "first")
        dist.all_reduce(mine[0])
        wait_for(signals / "second")
        dist.all_reduce(mine[1])
    for got, expected in zip(mine, want):
        assert torch.equal(got, expected), (rank, got, expected)
    dist.barrier()
    print(f"JOINED_OK {rank}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
