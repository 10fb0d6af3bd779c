"""The host's cost of one ``torch.distributed.all_reduce`` on smddp's ``nccl`` path, with CUDA and NCCL stubbed.

::

    python benchmarks/nccl_host_cost.py                  # 20 rounds of 2,000 calls each
    python benchmarks/nccl_host_cost.py --rounds 40 --iters 5000

No GPU is needed: the suite's NCCL stand-in (``tests/helpers/nccl_standin.py``) takes CuPy's NCCL module
and torch's CUDA streams and events, with NCCL calls that move nothing (``null``), so what is
timed is the host path a GPU job pays per call: torch's Python API, smddp's ProcessGroup, the
engine and the ``nccl`` communicator (its direct path, :mod:`smddp.comm.backends.nccl.direct`),
a world of one. Contenders, on a 256-element float32 tensor, all through
``torch.distributed.all_reduce``:

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

Each round times ``--iters`` calls of each contender in turn (CPU time of the whole process,
``time.process_time``: the watchdog's and any other thread's too); each line is the median over
rounds of the CPU time per call, in microseconds::

    HOSTCOST sync <us>
    HOSTCOST async <us>
    HOSTCOST null <us>
    HOSTCOST args <us>
    HOSTCOST inline <us>

followed by the ratios to ``null``, medians of the within-round ratios, and the NCCL watchdog's
event queries per smddp call (its thread's share of the host's cost, which the medians of short
rounds mostly miss: it looks every 50 ms). The stand-in's own
streams and events are Python, a little dearer than torch's C calls: the figures are an upper
bound of smddp's share on a GPU host (``benchmarks/gpu_call_cost.py`` measures that one there).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from datetime import timedelta

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "helpers"))  # the NCCL stand-in


def build(monkeypatch):
    """A world of one on the stand-in: smddp's ProcessGroup over an engine whose tensors go to NCCL,
    a null ProcessGroup and one that reads its arguments.

    Returns ``(smddp_group, null_group, args_group, fake, engine)``."""
    import torch
    import torch.distributed as tdist
    from nccl_standin import install

    from smddp.comm.backends.nccl.communicator import NCCLCommunicator
    from smddp.comm.base import Context
    from smddp.comm.engine import Engine
    from smddp.job.topology import Topology
    from smddp.torch.process_group import SmddpProcessGroup

    fake = install(monkeypatch)
    fake.null = True
    topology = Topology(rank=0, size=1, local_rank=0, local_size=1, launcher="none")
    ctx = Context(topology, timedelta(seconds=60), tdist.HashStore(), None)
    comm = NCCLCommunicator(ctx)
    engine = Engine({"cpu": comm}, timeout=60)  # the stand-in's tensors live on the CPU
    group = SmddpProcessGroup(engine, 0, 1)

    done = torch.futures.Future()
    done.set_result([])
    work = torch._C._distributed_c10d._create_work_from_future(done)

    class NullGroup(tdist.ProcessGroup):
        """A Python ProcessGroup whose all-reduce returns at once."""

        def allreduce(self, tensors, opts=None):
            return work if getattr(opts, "asyncOp", True) else None

    from smddp.comm.engine.events import active as profiling
    from smddp.torch.process_group import torch_op

    class ArgsGroup(tdist.ProcessGroup):
        """A Python ProcessGroup whose all-reduce reads the call's arguments, then returns."""

        def allreduce(self, tensors, opts=None):
            if profiling():
                raise RuntimeError("not under torch.profiler")
            tensor, op = tensors[0], torch_op(opts.reduceOp)  # noqa: F841 - read, as any backend must
            return None if not opts.asyncOp else work

    return group, NullGroup(0, 1), ArgsGroup(0, 1), fake, engine


def inline_group(engine, comm):
    """The ``inline`` contender (see the module docstring), on ``comm``'s lane (made already)."""
    import collections

    import torch
    import torch.distributed as tdist

    from smddp.comm.engine.events import active as profiling
    from smddp.torch.process_group import _RED_OPS

    direct = comm.direct
    lane, streams, dtypes, ops = direct._lane, direct.streams, direct._dtypes, direct._ops
    lock, timeout, options = engine._start_lock, engine.timeout, tdist.AllreduceOptions
    records, pool = collections.deque(maxlen=4096), [torch.cuda.Event()]
    state = {"seq": 0}

    class InlineGroup(tdist.ProcessGroup):
        """A Python ProcessGroup whose synchronous all-reduce does the direct path's steps inline."""

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
                    record = [now + timeout, seq, "all_reduce", None]
                    records.append(record)
                    count = tensor.numel()
                    if count:
                        ptr = tensor.data_ptr()
                        nccl.allReduce(ptr, ptr, count, dtype, code, current.cuda_stream)
                    event = pool.pop()
                    event.record(current)
                    record[3] = event
                    pool.append(event)  # as the watchdog gives it back once it completed
                finally:
                    lane.busy = False
            finally:
                lock.release()
            return None

    return InlineGroup(0, 1)


def measure(iters: int, rounds: int):
    """Per contender, the per-round CPU time per call (seconds), and the within-round ratios to null."""
    import pytest
    import torch
    import torch.distributed as tdist

    with pytest.MonkeyPatch.context() as monkeypatch:
        group, null, args, fake, engine = build(monkeypatch)
        t = torch.ones(256)
        tdist.all_reduce(t, group=group)  # makes the communicator (the first call's general path)
        inline = inline_group(engine, engine.comms["cpu"])

        def sync():
            tdist.all_reduce(t, group=group)

        def async_wait():
            tdist.all_reduce(t, group=group, async_op=True).wait()

        def null_call():
            tdist.all_reduce(t, group=null)

        def args_call():
            tdist.all_reduce(t, group=args)

        def inline_call():
            tdist.all_reduce(t, group=inline)

        contenders = {"sync": sync, "async": async_wait, "null": null_call, "args": args_call, "inline": inline_call}
        for call in contenders.values():
            for _ in range(200):
                call()
        queries = len(fake.queries)
        times = {name: [] for name in contenders}
        for _ in range(rounds):
            for name, call in contenders.items():
                start = time.process_time()
                for _ in range(iters):
                    call()
                times[name].append((time.process_time() - start) / iters)
        queries = len(fake.queries) - queries  # before close(): its drain asks what is left
        engine.close()
        comm = engine.comms["cpu"]
        comm.close()
        for stream in fake.streams.values():
            stream.close()
    return times, queries / (2 * iters * rounds)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=2000, help="calls per contender per round (default 2000)")
    parser.add_argument("--rounds", type=int, default=20, help="rounds (default 20)")
    args = parser.parse_args(argv)
    import platform

    import torch

    print(f"# python {platform.python_version()}, torch {torch.__version__}, {platform.machine()}, "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}", flush=True)
    times, queries = measure(args.iters, args.rounds)
    for name in ("sync", "async", "null", "args", "inline"):
        print(f"HOSTCOST {name} {statistics.median(times[name]) * 1e6:.2f}")
    for name in ("sync", "async", "args", "inline"):
        ratio = statistics.median(a / b for a, b in zip(times[name], times["null"]))
        print(f"# {name} / null: {ratio:.2f}x (median of within-round ratios)")
    print(f"# the NCCL watchdog's event queries per smddp call: {queries:.3f}")
    print(f"# load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
