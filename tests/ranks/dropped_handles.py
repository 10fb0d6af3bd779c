"""Dropped handles and Works never change a result: every rank checked.

Run by tests/comm/engine/test_ownership.py under mpirun -np 2/3 (and torchrun with gloo). Through
``torch.distributed`` on the "smddp" backend, each case starts asynchronous operations,
drops (or deletes and collects) their Work, runs more collectives, then checks every
tensor against the answer computed locally from seeded per-rank inputs; Works handed to C++
before Python drops them are waited on from C++. Prints
``CHECK <rank> <name>`` per passed check, ``FAILED <rank> <name> <why>`` per failure, then
``PASSED <rank> <count>`` or ``FAILURES <rank> <count>``. With ``exit-in-flight``, the
script ends with operations in flight (their handles dropped) and must still exit 0.
"""

from __future__ import annotations

import gc
import sys

import torch
import torch.distributed as tdist
from checklist import Checklist

import smddp
import smddp.torch.distributed as dist
from smddp.comm.engine.handle import DETACHABLE, Handle
from smddp.comm.reduction import Op
from smddp.torch import groups

dist.init_process_group()
rank, size = tdist.get_rank(), tdist.get_world_size()
checklist = Checklist(rank)
# 5 elements take MPI_Iallreduce; 300,000 (1.2 MB in float32) take the ring.
SIZES = [5, 300_000]
DTYPES = [torch.float32, torch.bfloat16, torch.float64]


def check(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    same = torch.equal(got, want.to(got.dtype))
    checklist.check(name, same, "" if same else f"max abs diff {(got.double() - want.double()).abs().max().item()}")


def value(r: int, numel: int, dtype: torch.dtype, salt: int) -> torch.Tensor:
    """Rank ``r``'s input: small integers, exact in every dtype and under any summation order."""
    g = torch.Generator().manual_seed(1000 * salt + r)
    return torch.randint(-8, 9, (numel,), generator=g).to(dtype)


def summed(numel: int, dtype: torch.dtype, salt: int) -> torch.Tensor:
    return sum(value(r, numel, dtype, salt).double() for r in range(size))


def all_reduce_dropped() -> None:
    salt = 0
    for numel in SIZES:
        for dtype in DTYPES:
            for op in (tdist.ReduceOp.SUM, tdist.ReduceOp.AVG):
                for contiguous in (True, False):
                    salt += 1
                    name = f"all_reduce {op} {numel} {dtype} {'contiguous' if contiguous else 'strided'}"
                    if contiguous:
                        view = value(rank, numel, dtype, salt)
                    else:  # every other element of a buffer twice the size
                        base = torch.zeros(2 * numel, dtype=dtype)
                        base[::2] = value(rank, numel, dtype, salt)
                        view = base[::2]
                    tdist.all_reduce(view, op=op, async_op=True)  # the Work is dropped at once
                    want = summed(numel, dtype, salt)
                    if op == tdist.ReduceOp.AVG:
                        # The sum is exact (small integers); the divide rounds as the
                        # backend's does: in float32 for half precision, else in the dtype.
                        acc = torch.float32 if dtype == torch.bfloat16 else dtype
                        want = want.to(acc) / size
                    pending.append((name, view, want.to(dtype), None if contiguous else base))
    gc.collect()
    tdist.barrier()
    for name, got, want, base in pending:
        check(name, got, want)
        if base is not None:
            check(name + " (gaps untouched)", base[1::2], torch.zeros_like(base[1::2]))
    pending.clear()


def broadcast_all_gather_dropped() -> None:
    for numel in SIZES:
        src = size - 1
        t = value(rank, numel, torch.float32, 50)
        tdist.broadcast(t, src=src, async_op=True)
        outs = [torch.empty(numel) for _ in range(size)]
        tdist.all_gather(outs, value(rank, numel, torch.float32, 51), async_op=True)
        out = torch.empty(size * numel, dtype=torch.bfloat16)
        tdist.all_gather_into_tensor(out, value(rank, numel, torch.bfloat16, 52), async_op=True)
        gc.collect()
        # More collectives right after, then the check.
        total = torch.full((3,), float(rank))
        tdist.all_reduce(total)
        check(f"sum after dropped {numel}", total, torch.full((3,), float(sum(range(size)))))
        check(f"broadcast {numel}", t, value(src, numel, torch.float32, 50))
        for r in range(size):
            check(f"all_gather {numel} from {r}", outs[r], value(r, numel, torch.float32, 51))
        want = torch.cat([value(r, numel, torch.bfloat16, 52) for r in range(size)])
        check(f"all_gather_into_tensor {numel}", out, want)


def reduce_scatter_dropped() -> None:
    """reduce_scatter_tensor (FSDP's collective), native on MPI and gloo, its Work dropped."""
    cases = []
    for numel in SIZES:
        for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64):
            for op in (tdist.ReduceOp.SUM, tdist.ReduceOp.AVG):
                salt = 90 + len(cases)
                out = torch.empty(numel, dtype=dtype)
                tdist.reduce_scatter_tensor(out, value(rank, size * numel, dtype, salt), op=op, async_op=True)
                cases.append((f"reduce_scatter_tensor {op} {numel} {dtype}", out, dtype, op, salt))
    gc.collect()
    tdist.barrier()
    for name, out, dtype, op, salt in cases:
        total = summed(size * out.numel(), dtype, salt)[rank * out.numel():(rank + 1) * out.numel()]
        if op == tdist.ReduceOp.AVG:
            # Half precision is reduced in float32 and rounded once; integers truncate.
            if dtype == torch.int64:
                want = total.to(torch.int64).div(size, rounding_mode="trunc")
            else:
                acc = torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype
                want = total.to(acc) / size
        else:
            want = total
        check(name, out, want.to(dtype))


def work_collected_in_flight() -> None:
    for numel in SIZES:
        t = value(rank, numel, torch.float64, 60)
        work = tdist.all_reduce(t, op=tdist.ReduceOp.AVG, async_op=True)
        del work
        gc.collect()
        u = value(rank, numel, torch.float64, 61)
        work = tdist.all_reduce(u, async_op=True)
        work.wait()  # completes after the one issued before it
        check(f"collected Work's result {numel}", t, summed(numel, torch.float64, 60) / size)
        check(f"next Work's result {numel}", u, summed(numel, torch.float64, 61))


def held_by_cpp() -> None:
    """Works that torch's API returned, handed to C++ and dropped by Python at once (DDP's forward
    does that with its ``join()`` all-reduce): C++ waits on each and reads its future.

    The engine holds a Work while its operation is in flight; once a later synchronous
    collective has returned (issue order: every one before it is done), nothing holds it.
    """
    if not DETACHABLE:
        return  # this torch has no PythonCallbackWork: C++ would wait forever
    cases = []
    for numel in SIZES:
        t = value(rank, numel, torch.float32, 100)
        boxed = tdist.all_reduce(t, op=tdist.ReduceOp.AVG, async_op=True).boxed()  # a C++ reference
        cases.append((f"all_reduce held by C++ {numel}", boxed, t, summed(numel, torch.float32, 100) / size))
        out = torch.empty(size * numel)
        boxed = tdist.all_gather_into_tensor(out, value(rank, numel, torch.float32, 101), async_op=True).boxed()
        cases.append((f"all_gather_into_tensor held by C++ {numel}", boxed, out,
                      torch.cat([value(r, numel, torch.float32, 101) for r in range(size)])))
    tdist.all_reduce(torch.zeros(1))
    gc.collect()
    for name, boxed, got, want in cases:
        work = tdist.Work.unbox(boxed)  # the C++ object: its Python object is gone
        checklist.check(f"{name}: no Python object left", not isinstance(work, Handle), type(work).__name__)
        checklist.check(f"{name}: wait() from C++", work.wait() is True)
        check(name, got, want)
        check(f"{name}: its future, as DDP's reducer reads it", work.get_future().value()[0], want)


def isend_without_wait() -> None:
    for numel in SIZES:
        right, left = (rank + 1) % size, (rank - 1) % size
        tdist.isend(value(rank, numel, torch.float32, 70), dst=right)  # never waited on, dropped
        got = torch.empty(numel)
        tdist.recv(got, src=left)
        check(f"isend without wait {numel}", got, value(left, numel, torch.float32, 70))
        total = torch.full((2,), 1.0)
        tdist.all_reduce(total)
        check(f"all_reduce after isend {numel}", total, torch.full((2,), float(size)))


def raising_callback() -> None:
    """A done-callback that raises fails its operation only; the next collectives run."""
    engine = groups.current().engine
    t = torch.full((4,), float(rank))
    handle = engine.all_reduce(t, Op.SUM, async_op=True)
    handle.add_done_callback(lambda _h: 1 // 0)
    try:
        handle.wait()
    except smddp.CollectiveError as exc:
        ok = "ZeroDivisionError" in str(exc)
    else:
        ok = False
    check("raising callback fails its operation" if ok else "raising callback not reported",
          torch.tensor(ok), torch.tensor(True))
    check("the operation itself completed", t, torch.full((4,), float(sum(range(size)))))
    after = torch.full((4,), 1.0)
    tdist.all_reduce(after)
    check("collectives after a raising callback", after, torch.full((4,), float(size)))


def exit_in_flight() -> None:
    # Started and dropped: the interpreter exits with them in flight.
    for numel in SIZES:
        tdist.all_reduce(value(rank, numel, torch.float32, 80), op=tdist.ReduceOp.AVG, async_op=True)
        tdist.broadcast(value(rank, numel, torch.float32, 81), src=0, async_op=True)
    print(f"EXITING {rank}", flush=True)


pending: list = []
if "exit-in-flight" in sys.argv[1:]:
    exit_in_flight()
    sys.exit(0)
all_reduce_dropped()
broadcast_all_gather_dropped()
reduce_scatter_dropped()
work_collected_in_flight()
held_by_cpp()
isend_without_wait()
raising_callback()
status = checklist.summary()
dist.destroy_process_group()
sys.exit(status)
