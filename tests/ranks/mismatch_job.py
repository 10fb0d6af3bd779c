"""Collectives that differ across ranks, with SMDDP_DEBUG unset: every rank must raise.

Usage: ``mismatch_job.py v1|torch [case ...]`` under mpirun or torchrun; ``FAKE_RANKS_PER_HOST``
and ``FAKE_ENV_<host>`` make "hosts" built differently (see ``fake_hosts.py``). ``v1`` calls
``smddp.torch.distributed``; ``torch`` calls ``torch.distributed`` on the ``"smddp"`` backend.
The last rank is the odd one out (with 3 ranks, ranks 0 and 1 agree with each other), but in
``switch_host``: there the upper half of the ranks (a whole host of the hierarchical plane)
all-reduce 240 KB where the others all-reduce 280 KB, across the 256 KB switch between the
hierarchical plane's paths; ``switch_rank`` has the last rank alone do so. In ``a2a_unpaired``
every rank sends 2 elements to every rank, and the last rank expects 3 from rank 0.

Per case and rank it prints ``RAISED <case> <rank> <exception class> <message>`` (or
``RETURNED <case> <rank>``), then every rank runs a correct all-reduce of ``rank + 1`` and
prints ``AFTER <case> <rank> <result or exception class>``: what a user gets after the mismatch.
``gather_bad_root`` (torch, run only when named): only the root's arguments are bad (it
raises before sending); the root's next collective is the all-reduce. ``coalesced`` (torch,
run only when named): two all-reduces in one call, the first mismatched. ``END <rank>`` closes
a job that ran every case.
"""

from __future__ import annotations

import sys

import fake_hosts  # noqa: F401 - first: it sets this host's variables before smddp is imported
import torch
import torch.distributed

API = sys.argv[1]
if API == "v1":
    import smddp.torch.distributed as dist

    dist.init_process_group()
    SUM, MAX = dist.ReduceOp.SUM, dist.ReduceOp.MAX
else:
    import torch.distributed as dist

    import smddp.torch.torch_smddp  # noqa: F401

    dist.init_process_group(backend="smddp")
    SUM, MAX = dist.ReduceOp.SUM, dist.ReduceOp.MAX
# The bitwise reductions are torch.distributed's (smddp's v1 API has the reference's four).
BAND, BOR = torch.distributed.ReduceOp.BAND, torch.distributed.ReduceOp.BOR

RANK, SIZE = dist.get_rank(), dist.get_world_size()
ODD = RANK == SIZE - 1  # the rank whose call differs
BIG = 1 << 20


def all_gather(count: int, dtype=torch.float32) -> None:
    tensor = torch.full((count,), float(RANK), dtype=dtype)
    dist.all_gather([torch.empty_like(tensor) for _ in range(SIZE)], tensor)


def a2a_unpaired() -> None:
    """Each rank's own splits add up; rank 0 sends the last rank 2 elements, which expects 3."""
    output_splits = [3] + [2] * (SIZE - 1) if ODD else [2] * SIZE
    output = torch.zeros(sum(output_splits))
    dist.all_to_all_single(output, torch.full((2 * SIZE,), 10.0 * (RANK + 1)), output_splits, [2] * SIZE)


def gather_bad_root() -> None:
    tensor = torch.full((4,), float(RANK))
    if RANK == 0:  # one output too few: an argument error that only the root can see
        dist.gather(tensor, [torch.empty(4) for _ in range(SIZE - 1)], dst=0)
    else:
        dist.gather(tensor, dst=0)


CASES = {
    "dtype_float64": lambda: dist.all_reduce(torch.ones(4, dtype=torch.float64 if ODD else torch.float32)),
    "dtype_int32": lambda: dist.all_reduce(torch.ones(4, dtype=torch.int32 if ODD else torch.float32)),
    "count_all_reduce": lambda: dist.all_reduce(torch.ones(5 if ODD else 4)),
    "count_broadcast": lambda: dist.broadcast(torch.ones(5 if ODD else 4), 0),
    "count_all_gather": lambda: all_gather(5 if ODD else 4),
    "root": lambda: dist.broadcast(torch.full((4,), float(RANK)), RANK),
    "barrier_vs_all_reduce": lambda: dist.barrier() if ODD else dist.all_reduce(torch.ones(4)),
    "all_reduce_vs_broadcast": lambda: dist.broadcast(torch.ones(4), 0) if ODD else dist.all_reduce(torch.ones(4)),
    "sum_vs_max": lambda: dist.all_reduce(torch.ones(4), op=MAX if ODD else SUM),
    "band_vs_bor": lambda: torch.distributed.all_reduce(torch.ones(4, dtype=torch.int32), op=BOR if ODD else BAND),
    "count_1m": lambda: dist.all_reduce(torch.ones(BIG + 1 if ODD else BIG)),
    "a2a_unpaired": a2a_unpaired,
    "switch_rank": lambda: dist.all_reduce(torch.ones(60_000 if ODD else 70_000)),
    "switch_host": lambda: dist.all_reduce(torch.ones(60_000 if RANK >= SIZE // 2 else 70_000)),
}


def coalesced() -> None:
    """Two all-reduces in one call, the first mismatched: the call's Work reports that first error."""
    dist.all_reduce_coalesced([torch.ones(5 if ODD else 4), torch.ones(3)])


# Run only when named (torch API). gather_bad_root leaves the root one collective behind for good.
ONLY_NAMED = {"gather_bad_root": gather_bad_root, "coalesced": coalesced}


def one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


def after(name: str) -> None:
    """A correct all-reduce: what the job gives once the ranks are past the mismatch."""
    tensor = torch.full((3,), float(RANK + 1))
    try:
        dist.all_reduce(tensor)
    except Exception as exc:  # noqa: BLE001 - reported, the test judges it
        print(f"AFTER {name} {RANK} {type(exc).__name__} {one_line(exc)}", flush=True)
        return
    print(f"AFTER {name} {RANK} {tensor.tolist()}", flush=True)


def main() -> None:
    names = sys.argv[2:] or list(CASES)
    for name in names:
        try:
            (CASES.get(name) or ONLY_NAMED[name])()
        except Exception as exc:  # noqa: BLE001 - reported, the test judges it
            print(f"RAISED {name} {RANK} {type(exc).__name__} {one_line(exc)}", flush=True)
        else:
            print(f"RETURNED {name} {RANK}", flush=True)
        after(name)
    print(f"END {RANK}", flush=True)
    dist.destroy_process_group()


main()
