"""The Work smddp's ProcessGroup returns, seen from C++ and from Python: every rank checked.

Run by tests/comm/engine/test_work.py under torchrun -np 2 and mpirun -np 2/3, through
``torch.distributed`` on the "smddp" backend. Expected values come from seeded per-rank
inputs. Cases:

- polled from C++: an asynchronous all_reduce nobody waits on; torch's C++ ``isCompleted()``
  (``Work.is_completed`` called on the C++ object, past Python's method) turns True, and
  its C++ future holds the result; a callback on that future sees the Work complete with its
  result;
- ``wait(timeout)``: a collective the other ranks have not started raises ``WaitTimeout`` (a
  TimeoutError) when the timeout passes, stays in flight, and completes once they start;
  the job goes on;
- ``get_future()`` on every collective of torch's API, its value the result.

Prints ``CHECK``/``FAILED`` lines and ``PASSED <rank> <count>`` (tests/ranks/checklist.py).
"""

from __future__ import annotations

import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from checklist import Checklist

import smddp
import smddp.torch.torch_smddp  # noqa: F401 - registers the backend

dist.init_process_group("smddp")
rank, size = dist.get_rank(), dist.get_world_size()
checklist = Checklist(rank)
CPP = torch._C._distributed_c10d.Work  # torch's C++ methods, called on the C++ object


def value(r: int, shape, salt: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * salt + r)
    return torch.randint(-8, 9, shape, generator=g).float()


def summed(shape, salt: int) -> torch.Tensor:
    return sum(value(r, shape, salt) for r in range(size))


def same(name: str, got, want) -> None:
    ok = isinstance(got, torch.Tensor) and torch.equal(got, want)
    checklist.check(name, ok, "" if ok else f"got {got!r}")


def until(test, seconds: float = 60.0) -> bool:
    """Poll ``test()`` (never waiting on the Work) until it is true or ``seconds`` pass."""
    deadline = time.monotonic() + seconds
    while not test():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


def polled_one(numel: int) -> None:
    t = value(rank, (numel,), 1)
    if rank == 1:
        time.sleep(0.2)  # the others' operation is in flight for a while (not asserted)
    work = dist.all_reduce(t, async_op=True)
    seen = []
    CPP.get_future(work).then(
        lambda fut: seen.append((work.is_completed(), work.result()[0].clone(), fut.value()[0].clone())))
    checklist.check(f"C++ isCompleted() turns true without a wait {numel}", until(lambda: CPP.is_completed(work)))
    same(f"C++ future's value {numel}", CPP.get_future(work).value()[0], summed((numel,), 1))
    same(f"result() {numel}", work.result()[0], summed((numel,), 1))
    checklist.check(f"future callback ran {numel}", until(lambda: bool(seen)))
    done, result, from_future = seen[0]
    checklist.check(f"future callback sees is_completed() {numel}", done)
    same(f"future callback sees result() {numel}", result, summed((numel,), 1))
    same(f"future callback sees the value {numel}", from_future, summed((numel,), 1))


def polled_from_cpp() -> None:
    for numel in (5, 300_000):
        polled_one(numel)


def wait_with_timeout() -> None:
    store = dist.distributed_c10d._get_default_store()
    t = value(rank, (4,), 2)
    if rank == 0:
        work = dist.all_reduce(t, async_op=True)
        try:
            work.wait(timeout=timedelta(milliseconds=200))
            raised = None
        except TimeoutError as exc:
            raised = exc
        checklist.check("wait(timeout) raises when it passes", isinstance(raised, smddp.WaitTimeout), repr(raised))
        checklist.check("still in flight after the wait's timeout", not work.is_completed())
        store.set("work-checks/timed-out", "1")
        checklist.check("completes once the others start", work.wait() is True)
    else:
        store.wait(["work-checks/timed-out"], timedelta(seconds=60))
        dist.all_reduce(t)
    same("the timed-out wait's collective", t, summed((4,), 2))
    after = value(rank, (3,), 3)
    dist.all_reduce(after)
    same("the job goes on after a wait's timeout", after, summed((3,), 3))
    quick = value(rank, (3,), 4)
    work = dist.all_reduce(quick, async_op=True)
    checklist.check("wait(timeout) that does not pass", work.wait(timedelta(seconds=60)))
    same("its result", quick, summed((3,), 4))


def futures_of_every_collective() -> None:
    def future_value(work):
        return work.get_future().wait()

    t = value(rank, (6,), 10)
    same("all_reduce future", future_value(dist.all_reduce(t, async_op=True))[0], summed((6,), 10))
    t = value(rank, (6,), 11)
    same("broadcast future", future_value(dist.broadcast(t, 0, async_op=True))[0], value(0, (6,), 11))
    outs = [torch.empty(2) for _ in range(size)]
    got = future_value(dist.all_gather(outs, value(rank, (2,), 12), async_op=True))
    same("all_gather future", torch.stack(got), torch.stack([value(r, (2,), 12) for r in range(size)]))
    out = torch.empty(size * 2)
    got = future_value(dist.all_gather_into_tensor(out, value(rank, (2,), 13), async_op=True))[0]
    same("all_gather_into_tensor future", got, torch.cat([value(r, (2,), 13) for r in range(size)]))
    out = torch.empty(2)
    got = future_value(dist.reduce_scatter_tensor(out, value(rank, (size * 2,), 14), async_op=True))[0]
    same("reduce_scatter_tensor future", got, summed((size * 2,), 14)[rank * 2:(rank + 1) * 2])
    out = torch.empty(size)
    got = future_value(dist.all_to_all_single(out, value(rank, (size,), 15), async_op=True))[0]
    same("all_to_all_single future", got, torch.stack([value(r, (size,), 15)[rank] for r in range(size)]))
    gathered = [torch.empty(3) for _ in range(size)] if rank == 0 else None
    got = future_value(dist.gather(value(rank, (3,), 16), gathered, dst=0, async_op=True))
    if rank == 0:
        same("gather future", torch.stack(got[0]), torch.stack([value(r, (3,), 16) for r in range(size)]))
    else:
        checklist.check("gather future (not the root)", got == [[]], repr(got))
    out = torch.empty(3)
    scattered = [value(r, (3,), 17) for r in range(size)] if rank == 0 else None
    same("scatter future", future_value(dist.scatter(out, scattered, src=0, async_op=True))[0], value(rank, (3,), 17))
    t = value(rank, (3,), 18)
    got = future_value(dist.reduce(t, dst=0, async_op=True))[0]
    if rank == 0:
        same("reduce future", got, summed((3,), 18))
    lists = [[torch.empty(2), torch.empty(3)] for _ in range(size)]
    fut = dist.all_gather_coalesced(lists, [value(rank, (2,), 19), value(rank, (3,), 20)], async_op=True)
    got = fut.wait()  # torch's all_gather_coalesced returns the Work's future itself
    same("all_gather_coalesced future", torch.cat([torch.cat(row) for row in got]),
         torch.cat([torch.cat([value(r, (2,), 19), value(r, (3,), 20)]) for r in range(size)]))
    pair = [value(rank, (2,), 21), value(rank, (3,), 22)]
    got = dist.all_reduce_coalesced(pair, async_op=True).wait()  # the Work's future, as above
    same("all_reduce_coalesced future", torch.cat(got), torch.cat([summed((2,), 21), summed((3,), 22)]))
    checklist.check("barrier future", future_value(dist.barrier(async_op=True)) == [])
    right, left = (rank + 1) % size, (rank - 1) % size
    sent = dist.isend(value(rank, (4,), 23), dst=right)
    got = torch.empty(4)
    same("irecv future", future_value(dist.irecv(got, src=left))[0], value(left, (4,), 23))
    sent.wait()


polled_from_cpp()
wait_with_timeout()
futures_of_every_collective()
dist.destroy_process_group()
sys.exit(checklist.summary())
