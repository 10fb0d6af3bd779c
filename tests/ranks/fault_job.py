"""Faults injected into a real job; ``tests/comm/engine/test_timeouts_and_failures.py`` runs each mode under a launcher.

``python fault_job.py MODE``; every rank prints ``<WORD> <rank> <rest>`` lines that the test
reads (times are ``time.time()`` stamps or elapsed seconds):

- ``crash``: rank 1 raises before a collective the others wait in.
- ``die``: rank 1 exits at once (``os._exit``) before that collective.
- ``sleep``: rank 1 sleeps past the timeout; the others time out naming it, then check that
  further collectives fail at once. ``sleep-cpp``: the same, the others' all-reduce started
  through torch's API and waited on from C++ after Python has dropped its Work.
- ``mismatch``: (``SMDDP_DEBUG=1``) shapes, ops, dtypes, roots, operations and all-to-all
  splits that differ across ranks; every rank must raise, and the job goes on.
- ``uneven``: DDP where rank 1 has fewer batches and then leaves; with ``SMDDP_DEBUG=1`` it
  calls a barrier after its last batch instead.
- ``hold``: collectives forever, until the launcher is interrupted.
"""

from __future__ import annotations

import gc
import os
import sys
import time

import torch
import torch.distributed as tdist

torch.set_num_threads(1)

import smddp  # noqa: E402
import smddp.torch.distributed as dist  # noqa: E402

MODE = sys.argv[1]


def say(word: str, *rest) -> None:
    print(word, dist.get_rank(), *rest, flush=True)


def crash() -> None:
    t = torch.ones(4)
    dist.all_reduce(t)
    if dist.get_rank() == 1:
        say("CRASH", time.time())
        raise ZeroDivisionError("rank 1 fails on purpose")
    dist.all_reduce(t)
    say("UNREACHABLE")


def die() -> None:
    t = torch.ones(4)
    dist.all_reduce(t)
    if dist.get_rank() == 1:
        say("DIE", time.time())
        os._exit(3)
    dist.all_reduce(t)
    say("UNREACHABLE")


def sleep(waited_from_cpp: bool = False) -> None:
    t = torch.ones(4)
    dist.all_reduce(t)
    dist.barrier()
    if dist.get_rank() == 1:
        time.sleep(120)  # the job is aborted long before
        return
    start = time.monotonic()
    try:
        if waited_from_cpp:
            # torch's API returns the Work; Python hands it to C++ and drops it (as DDP's forward
            # does with its join() all-reduce); C++ waits on it.
            boxed = tdist.all_reduce(t, async_op=True).boxed()
            gc.collect()
            tdist.Work.unbox(boxed).wait()
        else:
            dist.all_reduce(t)
    except smddp.CollectiveTimeout as exc:
        say("TIMEOUT", f"{time.monotonic() - start:.2f}", str(exc).replace("\n", " "))
    start = time.monotonic()
    try:
        dist.broadcast(t, 0)
    except smddp.CollectiveError as exc:
        say("FASTFAIL", f"{time.monotonic() - start:.4f}", str(exc)[:200].replace("\n", " "))


def mismatch() -> None:
    rank = dist.get_rank()
    cases = {
        "shape": lambda: dist.all_reduce(torch.ones(4 + (rank == 1))),
        "op": lambda: dist.all_reduce(torch.ones(4), op=dist.ReduceOp.MAX if rank == 1 else dist.ReduceOp.SUM),
        "dtype": lambda: dist.all_reduce(torch.ones(4, dtype=torch.float64 if rank == 1 else torch.float32)),
        "operation": lambda: dist.broadcast(torch.ones(4), 0) if rank == 1 else dist.all_reduce(torch.ones(4)),
        "src": lambda: dist.broadcast(torch.ones(4), src=1 if rank == 1 else 0),
        "splits": lambda: dist.all_to_all_single(
            torch.empty(dist.get_world_size() * 2 + (rank == 1)), torch.ones(dist.get_world_size() * 2),
            output_split_sizes=[2] * (dist.get_world_size() - 1) + [2 + (rank == 1)],
            input_split_sizes=[2] * dist.get_world_size()),
    }
    for name, call in cases.items():
        start = time.monotonic()
        try:
            call()
        except smddp.CollectiveMismatchError as exc:
            say("MISMATCH", name, f"{time.monotonic() - start:.3f}", str(exc).replace("\n", " "))
        else:
            say("MISSED", name)
    t = torch.full((4,), float(rank))
    dist.all_reduce(t)  # a mismatch leaves the job usable
    say("AFTER", t.tolist())


def uneven() -> None:
    from smddp.torch.parallel.distributed import DistributedDataParallel as DDP

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = 3 if rank == int(os.environ.get("FAULT_SHORT_RANK", "1")) else 4  # a shorter shard: the end-of-epoch hang
    start = time.monotonic()
    try:
        for _ in range(batches):
            start = time.monotonic()
            opt.zero_grad()
            model(torch.randn(4, 8)).pow(2).mean().backward()
            opt.step()
        if os.environ.get("SMDDP_DEBUG"):
            start = time.monotonic()
            dist.barrier()  # e.g. an end-of-epoch barrier or metric all-reduce
        say("DONE", batches)
    except Exception as exc:  # noqa: BLE001 - torch's reducer may wrap the error
        say("UNEVEN", type(exc).__name__, f"{time.monotonic() - start:.2f}", str(exc).replace("\n", " "))


def hold() -> None:
    say("PID", os.getpid())
    t = torch.ones(4)
    while True:
        dist.all_reduce(t)
        time.sleep(0.01)


if __name__ == "__main__":
    dist.init_process_group()
    say("READY", time.time())
    modes = {"crash": crash, "die": die, "sleep": sleep, "sleep-cpp": lambda: sleep(waited_from_cpp=True),
             "mismatch": mismatch, "uneven": uneven, "hold": hold}
    modes[MODE]()
    say("END", time.time())
