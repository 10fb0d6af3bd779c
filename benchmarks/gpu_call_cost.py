"""Host time per call of the CUDA primitives smddp's ``nccl`` backend uses, and of its collectives.

::

    python benchmarks/gpu_call_cost.py                          # one GPU, world size 1
    SMDDP_NCCL_STREAM=current python benchmarks/gpu_call_cost.py

Each line is the mean host time of 20,000 calls (5,000 for the collectives) after 200 warm-up
calls: what a Python caller pays before the GPU sees anything. At world size 1 NCCL moves nothing,
so ``smddp all_reduce`` is the engine's and the backend's cost per call. docs/performance.md
("First GPU run") reports these figures; profile before changing the hot path, with
``python -m cProfile -s tottime``.
"""

from __future__ import annotations

import argparse
import time
from typing import Callable

import torch
import torch.distributed as tdist

import smddp.torch.distributed as dist
from smddp.torch import groups


def per_call(name: str, call: Callable[[], object], calls: int = 20000) -> float:
    """Print and return the mean host time of ``calls`` calls (microseconds), after 200 warm-up calls."""
    for _ in range(200):
        call()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    micros = (time.perf_counter() - start) / calls * 1e6
    torch.cuda.synchronize()
    print(f"{name:45s} {micros:7.2f} us", flush=True)
    return micros


def main(argv=None) -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    dist.init_process_group(backend="nccl")
    torch.cuda.set_device(0)
    t = torch.ones(256, device="cuda")
    dist.all_reduce(t)  # the communicator exists before anything is timed
    torch.cuda.synchronize()
    comm = groups.current().engine.comms["cuda"]
    lane = comm._lane
    device = torch.device("cuda", 0)
    current = torch.cuda.current_stream()
    side = lane.side or torch.cuda.Stream()
    event = torch.cuda.Event()
    event.record(current)

    def record() -> None:
        torch.cuda.Event().record(side)

    def device_context() -> None:
        with torch.cuda.device(0):
            pass

    def calling() -> None:
        with lane.calling(comm._refusal):
            pass

    def async_wait() -> None:
        dist.all_reduce(t, async_op=True).wait()

    ptr = t.data_ptr()
    per_call("current_stream(torch.device)", lambda: torch.cuda.current_stream(device))
    per_call("current_stream(int)", lambda: torch.cuda.current_stream(0))
    per_call("current_stream()", torch.cuda.current_stream)
    per_call("_C._cuda_getCurrentStream(0)", lambda: torch._C._cuda_getCurrentStream(0))
    per_call("side.wait_stream(cur)", lambda: side.wait_stream(current))
    per_call("Event()", torch.cuda.Event)
    per_call("Event()+record(side)", record)
    per_call("cur.wait_event(ev)", lambda: current.wait_event(event))
    per_call("with torch.cuda.device(0)", device_context)
    per_call("lane.calling", calling)
    per_call("comm.check_async_error", lambda: lane.comm.check_async_error())
    per_call("comm.check()", comm.check)
    per_call("lane.streams.current()", lane.streams.current)
    per_call("lane.streams.capturing()", lane.streams.capturing)
    per_call("watch.event()+record(current)", lambda: comm._watch.event().record(current))
    per_call("cupy allReduce 256 on side", lambda: lane.comm.allReduce(ptr, ptr, 256, 7, 0, side.cuda_stream), 5000)
    per_call("smddp all_reduce 256 (v1)", lambda: dist.all_reduce(t), 5000)
    per_call("smddp all_reduce async+wait (v1)", async_wait, 5000)
    per_call("torch.distributed.all_reduce 256", lambda: tdist.all_reduce(t), 5000)
    per_call("torch.distributed async+wait", lambda: tdist.all_reduce(t, async_op=True).wait(), 5000)
    group = tdist.new_group(backend="nccl")
    tdist.all_reduce(t, group=group)
    torch.cuda.synchronize()
    per_call("torch's NCCL group all_reduce 256", lambda: tdist.all_reduce(t, group=group), 5000)
    per_call("torch's NCCL group async+wait", lambda: tdist.all_reduce(t, group=group, async_op=True).wait(), 5000)
    tdist.destroy_process_group(group)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
