"""A synchronous ring all-reduce that fails on rank 0 keeps its buffers while MPI may use them.

``python failed_ring.py error|interrupt``, run by tests/comm/engine/test_ownership.py under
``mpirun -np 2`` with ``SMDDP_CPU_PLANE=mpi``. Rank 0's first test of the ring's first stage
raises, while the stage's receive into the ring's scratch buffer is still posted: ``error``,
as ``MPI_Testall`` does when a request fails; ``interrupt``, as Ctrl-C does (a notebook). The engine must keep
the failed operation (its Pending, the ring and the scratch) referenced: rank 1's send still
lands in that buffer, and rank 0 checks it got rank 1's part there, intact
(``KEPT 0 <elements>``). Rank 1 waits in the next stage, times out and says so
(``TIMEOUT 1``); both ranks end broken, so the job ends through ``MPI_Abort``.
"""

from __future__ import annotations

import gc
import sys
import time
import weakref

import torch
from mpi4py import MPI

import smddp
import smddp.torch.distributed as dist
from smddp.comm.backends import mpi

dist.init_process_group()
rank, size = dist.get_rank(), dist.get_world_size()
NUMEL = 2 * mpi.RING_MIN_BYTES // 4  # float32: the ring, two chunks of NUMEL / 2


def value(r: int) -> torch.Tensor:
    return torch.arange(NUMEL, dtype=torch.float32) + 1000.0 * (r + 1)


small = torch.ones(4)
dist.all_reduce(small)  # the job runs: everything up to here is ordinary
assert small.tolist() == [float(size)] * 4

seen = {}
if rank == 0:
    original = mpi._Requests.test

    def failing_test(pending):
        if not seen and pending._current:
            ring = pending._stages.gi_yieldfrom  # _all_reduce delegates to _ring
            seen["pending"] = weakref.ref(pending)
            seen["scratch"] = weakref.ref(ring.gi_frame.f_locals["scratch"])
            seen["requests"] = list(pending._current)
            raise MPI.Exception(MPI.ERR_OTHER) if sys.argv[1] == "error" else KeyboardInterrupt()
        return original(pending)

    mpi._Requests.test = failing_test

tensor = value(rank)
try:
    dist.all_reduce(tensor)
    print("UNEXPECTED", rank, "the all_reduce completed", flush=True)
except smddp.CollectiveTimeout:
    print("TIMEOUT", rank, flush=True)
except smddp.CollectiveError as exc:
    print("FAILED", rank, str(exc).splitlines()[0], flush=True)
except KeyboardInterrupt:
    print("INTERRUPTED", rank, flush=True)

if rank == 0:
    gc.collect()
    pending, scratch = seen["pending"](), seen["scratch"]()
    if pending is None or scratch is None:
        print("DROPPED", rank, "the failed all_reduce's buffers are gone while MPI may write to them", flush=True)
    else:
        # The stage's requests complete on their own (rank 1 sends its part); they write
        # into the scratch buffer, which the engine still holds.
        deadline = time.monotonic() + 30
        while not MPI.Request.Testall(seen["requests"]) and time.monotonic() < deadline:
            time.sleep(0.001)
        want = value(1)[NUMEL // 2:]
        ok = torch.equal(scratch[: want.numel()], want)
        print("KEPT" if ok else "CORRUPT", rank, want.numel(), flush=True)

MPI.COMM_WORLD.Barrier()  # rank 0 ends (MPI_Abort: it is broken) only once rank 1 has timed out
