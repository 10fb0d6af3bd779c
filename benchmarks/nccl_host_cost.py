"""The host's cost of one ``torch.distributed.all_reduce`` on smddp's ``nccl`` path, with CUDA and NCCL stubbed.

::

    python benchmarks/nccl_host_cost.py                  # 20 rounds of 2,000 calls each
    python benchmarks/nccl_host_cost.py --rounds 40 --iters 5000

No GPU is needed: the suite's NCCL stand-in (``tests/helpers/nccl_standin.py``, ``install(null=True)``)
takes CuPy's NCCL module and torch's CUDA streams and events, with NCCL calls that move nothing, and
the CUDA and NCCL primitives on a collective's path as single C calls (C builtins standing in for
CUDA's and CuPy's compiled functions, as they are on a GPU host), so what is timed is the host path a
GPU job pays per call: torch's Python API, smddp's ProcessGroup, the engine and the ``nccl``
communicator (its direct path, :mod:`smddp.comm.backends.nccl.direct`), a world of one. Contenders,
on a 256-element float32 tensor, all through ``torch.distributed.all_reduce``:

- ``sync``: ``all_reduce(t)`` (torch >= 2.8 passes ``asyncOp=False``: NCCL on the current stream);
- ``async``: ``all_reduce(t, async_op=True).wait()`` (the group's stream, a CUDA-aware future);
- ``null``: ``all_reduce(t)`` on a Python ProcessGroup that returns at once (a completed ``Work``
  made once, for ``async_op=True``): what torch's API and a Python backend cost at the least.
- ``args``: ``all_reduce(t)`` on a Python ProcessGroup that reads what every backend must read of
  the call (the tensor, the reduction and ``asyncOp`` of torch's options; whether torch's profiler
  records) and returns: the floor of any Python group that does the work asked.
- ``inline``: ``all_reduce(t)`` on a Python ProcessGroup that does the direct path's synchronous
  steps itself, each written inline in its one method, on smddp's lane: the argument reads, the
  checks of dtype, reduction, device and layout, the engine's start lock and a sequence number,
  the current stream and the capture check, a deadline record (a list, in a deque of its own),
  NCCL's call, an event from a pool recorded after it. No engine, no direct path, no watchdog
  thread: what smddp's layers add is ``sync`` minus ``inline``.
- ``torchfake``: ``all_reduce(t)`` on a torch ``ProcessGroup`` whose CPU backend is torch's
  ``FakeProcessGroup`` (a C++ backend that does nothing): torch's own dispatch to a C++ backend, the
  route torch's NCCL group takes; the issue's bars are against it.
- ``delegate``: ``all_reduce(t)`` on smddp's delegated route (the default on GPUs,
  :mod:`smddp.torch.delegating_group`) handing the tensor to that same ``FakeProcessGroup`` object:
  what smddp's group adds to torch's backend where it delegates (bar: at most 1.0x ``torchfake``).

Each round times ``--iters`` calls of each contender in turn (CPU time of the whole process,
``time.process_time``: the watchdog's and any other thread's too); each line is the median over
rounds of the CPU time per call, in microseconds::

    HOSTCOST sync <us>
    HOSTCOST async <us>
    HOSTCOST null <us>
    HOSTCOST args <us>
    HOSTCOST inline <us>
    HOSTCOST torchfake <us>
    HOSTCOST delegate <us>

followed by the ratios to ``null`` and to ``torchfake``, medians of the within-round ratios (with the
bars of issue 51 where it sets one: ``sync`` at most 1.5x ``torchfake``, ``async`` 2.2x, ``delegate``
1.0x), and the NCCL
watchdog's event queries per smddp call (its thread's share of the host's cost, which the medians of short
rounds mostly miss: it looks every 50 ms). ``benchmarks/gpu_call_cost.py`` measures the same
path on a GPU host.

A contender is a function of :data:`CONTENDERS`, ``name(bench) -> call``: given the :class:`Bench`
(the world built once: the stand-in, smddp's group and engine, the tensor), it returns the
zero-argument callable that makes one call; :data:`BARS` lists the ratios printed with a bar.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from datetime import timedelta
from typing import Callable, Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "helpers"))  # the NCCL stand-in


class Bench:
    """The world the contenders share, built once: a world of one on the stand-in.

    Attributes:
        fake: the NCCL stand-in (``install(null=True)``).
        engine: smddp's engine over the ``nccl`` communicator (which takes the stand-in's CPU tensors).
        comm: that communicator; its lane is made by :meth:`open` (the first call's general path).
        group: smddp's ProcessGroup over the engine.
        tensor: the tensor every contender all-reduces (256 float32 elements).
        done: a completed C++ ``Work``, for the groups that return one for ``async_op=True``.
    """

    def __init__(self, monkeypatch):
        import torch
        import torch.distributed as tdist
        from nccl_standin import install

        from smddp.comm.backends.nccl.communicator import NCCLCommunicator
        from smddp.comm.base import Context
        from smddp.comm.engine import Engine
        from smddp.job.topology import Topology
        from smddp.torch.process_group import SmddpProcessGroup

        self.fake = install(monkeypatch, null=True)
        topology = Topology(rank=0, size=1, local_rank=0, local_size=1, launcher="none")
        ctx = Context(topology, timedelta(seconds=60), tdist.HashStore(), None)
        self.comm = NCCLCommunicator(ctx)
        self.engine = Engine({"cpu": self.comm}, timeout=60)  # the stand-in's tensors live on the CPU
        self.group = SmddpProcessGroup(self.engine, 0, 1)
        self.tensor = torch.ones(256)
        future = torch.futures.Future()
        future.set_result([])
        self.done = torch._C._distributed_c10d._create_work_from_future(future)
        self.keep: list = []  # what contenders made and close with the bench

    def open(self) -> None:
        """Make the communicator's lane (its first collective does, on the general path)."""
        import torch.distributed as tdist

        tdist.all_reduce(self.tensor, group=self.group)

    def close(self) -> None:
        for engine in self.keep:
            engine.close()
        self.engine.close()
        self.comm.close()
        for stream in self.fake.streams.values():
            stream.close()


# ---------------------------------------------------------------------------- the contenders
def sync(bench: Bench) -> Callable[[], None]:
    """smddp's group, ``all_reduce(t)``."""
    import torch.distributed as tdist

    t, group = bench.tensor, bench.group
    return lambda: tdist.all_reduce(t, group=group)


def async_wait(bench: Bench) -> Callable[[], None]:
    """smddp's group, ``all_reduce(t, async_op=True).wait()``."""
    import torch.distributed as tdist

    t, group = bench.tensor, bench.group
    return lambda: tdist.all_reduce(t, group=group, async_op=True).wait()


def null(bench: Bench) -> Callable[[], None]:
    """A Python ProcessGroup whose all-reduce returns at once."""
    import torch.distributed as tdist

    work = bench.done

    class NullGroup(tdist.ProcessGroup):
        def allreduce(self, tensors, opts=None):
            return work if getattr(opts, "asyncOp", True) else None

    t, group = bench.tensor, NullGroup(0, 1)
    return lambda: tdist.all_reduce(t, group=group)


def args(bench: Bench) -> Callable[[], None]:
    """A Python ProcessGroup whose all-reduce reads the call's arguments, then returns."""
    import torch.distributed as tdist

    from smddp.comm.engine.events import active as profiling
    from smddp.torch.process_group import torch_op

    work = bench.done

    class ArgsGroup(tdist.ProcessGroup):
        def allreduce(self, tensors, opts=None):
            if profiling():
                raise RuntimeError("not under torch.profiler")
            tensor, op = tensors[0], torch_op(opts.reduceOp)  # noqa: F841 - read, as any backend must
            return None if not opts.asyncOp else work

    t, group = bench.tensor, ArgsGroup(0, 1)
    return lambda: tdist.all_reduce(t, group=group)


def inline(bench: Bench) -> Callable[[], None]:
    """A Python ProcessGroup whose synchronous all-reduce does the direct path's steps inline
    (see the module docstring), on smddp's lane."""
    import collections

    import torch
    import torch.distributed as tdist

    from smddp import _compat
    from smddp.comm.engine.events import active as profiling
    from smddp.torch.process_group import _RED_OPS

    engine, direct = bench.engine, bench.comm.direct
    lane, streams, dtypes, ops = direct._lane, direct.streams, direct._dtypes, direct._ops
    lock, timeout, options = engine._start_lock, engine.timeout, tdist.AllreduceOptions
    records, pool, record = collections.deque(maxlen=4096), [torch.cuda.Event()], _compat.record_event
    state = {"seq": 0}

    class InlineGroup(tdist.ProcessGroup):
        def allreduce(self, tensors, opts=None):
            if profiling() or opts.__class__ is not options or opts.asyncOp:
                raise RuntimeError("synchronous calls of torch's API only, not under torch.profiler")
            tensor = tensors[0]
            op = _RED_OPS.get(hash(opts.reduceOp))
            dtype, code = dtypes.get(tensor.dtype), ops.get(op)
            if dtype is None or code is None or tensor.get_device() != -1 or not tensor.is_contiguous():
                raise RuntimeError("not a tensor the direct path takes")
            lock.acquire()
            try:
                now = time.monotonic()
                state["seq"] = seq = state["seq"] + 1
                lane.busy = True
                try:
                    nccl = lane.comm
                    key, current = streams.current()
                    if streams.capturing():
                        raise RuntimeError("not during a capture")
                    entry = [now + timeout, seq, "all_reduce", None]
                    records.append(entry)
                    nccl.check_async_error()
                    count = tensor.numel()
                    if count:
                        ptr = tensor.data_ptr()
                        nccl.allReduce(ptr, ptr, count, dtype, code, current.cuda_stream)
                    event = pool.pop()
                    record(event, current)
                    entry[3] = event
                    pool.append(event)  # as the watchdog gives it back once it completed
                finally:
                    lane.busy = False
            finally:
                lock.release()
            return None

    t, group = bench.tensor, InlineGroup(0, 1)
    return lambda: tdist.all_reduce(t, group=group)


def fake_backend():
    """torch's ``FakeProcessGroup``, a C++ backend object whose collectives do nothing (world of one)."""
    from torch._C._distributed_c10d import FakeProcessGroup

    return FakeProcessGroup._create_internal(0, 1, FakeProcessGroup.Options())


def torchfake(bench: Bench) -> Callable[[], None]:
    """A torch ``ProcessGroup`` whose CPU tensors go to torch's ``FakeProcessGroup`` backend (C++)."""
    import torch
    import torch.distributed as tdist

    group = tdist.ProcessGroup(tdist.HashStore(), 0, 1)
    kind = tdist.ProcessGroup.BackendType.CUSTOM
    group._set_default_backend(kind)
    group._register_backend(torch.device("cpu"), kind, fake_backend())
    t = bench.tensor
    return lambda: tdist.all_reduce(t, group=group)


def delegate(bench: Bench) -> Callable[[], None]:
    """smddp's delegated route (the default on GPUs): a :class:`~smddp.torch.delegating_group.DelegatingProcessGroup`
    that hands the CPU tensor to torch's ``FakeProcessGroup`` backend object, as a GPU job's group hands
    CUDA tensors to torch's ``ProcessGroupNCCL``."""
    import torch
    import torch.distributed as tdist

    from smddp.comm.backends.local import LocalCommunicator
    from smddp.comm.backends.torch_native import Delegate
    from smddp.comm.base import Context
    from smddp.comm.engine import Engine
    from smddp.job.topology import Topology
    from smddp.torch.delegating_group import DelegatingProcessGroup

    backend = fake_backend()
    ctx = Context(Topology(rank=0, size=1, local_rank=0, local_size=1, launcher="none"), timedelta(seconds=60))
    engine = Engine({"cpu": LocalCommunicator(ctx)}, timeout=60)
    group = DelegatingProcessGroup(engine, 0, 1, Delegate("cpu", backend, "CUSTOM", torch.device("cpu"),
                                                          "torch-gloo", backend))
    bench.keep.append(engine)
    t = bench.tensor
    return lambda: tdist.all_reduce(t, group=group)


#: The contenders, in the order each round times them: name to ``contender(bench) -> call``. Add one
#: here (a function as those above; :func:`fake_backend` gives a C++ backend object to hand tensors
#: to) and it gets its ``HOSTCOST`` line and its ratios to ``null`` and ``torchfake``; a bar of its
#: own goes in :data:`BARS`.
CONTENDERS: Dict[str, Callable[[Bench], Callable[[], None]]] = {
    "sync": sync, "async": async_wait, "null": null, "args": args, "inline": inline, "torchfake": torchfake,
    "delegate": delegate,
}
#: Ratios printed with a bar (``contender / against <= bar``): issue 51's, against torch's own route.
BARS = [("sync", "torchfake", 1.5), ("async", "torchfake", 2.2), ("delegate", "torchfake", 1.0)]
#: The contenders that call smddp's group (the watchdog's queries are counted per call of these).
SMDDP = ("sync", "async")


def measure(iters: int, rounds: int):
    """Per contender, the per-round CPU time per call (seconds); and the watchdog's queries per smddp call."""
    import pytest

    with pytest.MonkeyPatch.context() as monkeypatch:
        bench = Bench(monkeypatch)
        bench.open()
        calls = {name: make(bench) for name, make in CONTENDERS.items()}
        for call in calls.values():
            for _ in range(200):
                call()
        queries = len(bench.fake.queries)
        times: Dict[str, List[float]] = {name: [] for name in calls}
        for _ in range(rounds):
            for name, call in calls.items():
                start = time.process_time()
                for _ in range(iters):
                    call()
                times[name].append((time.process_time() - start) / iters)
        queries = len(bench.fake.queries) - queries  # before close(): its drain asks what is left
        bench.close()
    return times, queries / (len(SMDDP) * iters * rounds)


def ratio(times: Dict[str, List[float]], name: str, against: str) -> float:
    """The median of the within-round ratios ``name / against``."""
    return statistics.median(a / b for a, b in zip(times[name], times[against]))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=2000, help="calls per contender per round (default 2000)")
    parser.add_argument("--rounds", type=int, default=20, help="rounds (default 20)")
    options = parser.parse_args(argv)
    import platform

    import torch

    print(f"# python {platform.python_version()}, torch {torch.__version__}, {platform.machine()}, "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}", flush=True)
    times, queries = measure(options.iters, options.rounds)
    for name in times:
        print(f"HOSTCOST {name} {statistics.median(times[name]) * 1e6:.2f}")
    for name in times:
        if name != "null":
            print(f"# {name} / null: {ratio(times, name, 'null'):.2f}x (median of within-round ratios)")
    for name in times:
        if name not in ("null", "torchfake"):
            print(f"# {name} / torchfake: {ratio(times, name, 'torchfake'):.2f}x")
    for name, against, bar in BARS:
        got = ratio(times, name, against)
        print(f"# bar: {name} / {against} {got:.2f}x, at most {bar}x: {'met' if got <= bar else 'NOT met'}")
    print(f"# the NCCL watchdog's event queries per smddp call: {queries:.3f}")
    print(f"# load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
