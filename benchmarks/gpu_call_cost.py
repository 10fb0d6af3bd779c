"""Host time per call of smddp's collectives on CUDA beside torch's own NCCL group, and of the primitives under them.

::

    python benchmarks/gpu_call_cost.py                          # the delegated route (torch-nccl), one GPU
    python benchmarks/gpu_call_cost.py --backend nccl           # CuPy's NCCL, with its lane's steps
    SMDDP_NCCL_STREAM=current python benchmarks/gpu_call_cost.py --backend nccl
    python benchmarks/gpu_call_cost.py --rounds 10 --json out.json

Host time is what a Python caller pays before the GPU sees anything; at world size 1 NCCL moves
nothing, so a collective's figure is the cost of the call through each layer. A job measures one of
smddp's routes (``--backend``, as ``benchmarks/gpu_allreduce.py``: ``torch-nccl``, smddp's default on
CUDA, hands device tensors to torch's ``ProcessGroupNCCL``; ``nccl`` calls NCCL through CuPy).

1. The collectives, an all-reduce of 256 floats, in ``--rounds`` rounds (order rotating), each
   contender ``--calls`` calls per round (the mean host time per call; the device synchronized
   after each contender, outside the timing): ``torch.distributed.all_reduce`` on smddp's group,
   synchronous and ``async_op=True`` with ``wait()``; smddp's v1 ``all_reduce``, the same two; torch's
   own NCCL group (``new_group(backend="nccl")``), the same two; on the delegated route also
   ``group.allreduce([t])`` (smddp's group method called from Python, without torch's dispatch) and
   ``delegate.backend.allreduce([t])`` (the torch backend object it hands the call to, called from
   Python). Each line: the median over rounds and, for smddp's calls, the min, median and max of the
   within-round ratios to torch's group's same call (``group.allreduce``'s: to the backend object's).
2. The primitives, one pass each (20,000 calls after 200 warm-up calls, the mean): the CUDA calls a
   route makes per collective (the current stream, events, a stream waiting on another) and, on
   the CuPy route, its lane's steps (its lock, NCCL's error check, the watchdog's event, CuPy's
   ``allReduce`` on the group's stream). docs/performance.md ("First GPU run") reports such
   figures; profile before changing the hot path, with ``python -m cProfile -s tottime``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Callable, Dict, List

import torch
import torch.distributed as tdist

import smddp.torch.distributed as dist

#: Each smddp contender and the call of torch's own group it is compared with.
AGAINST = {
    "smddp all_reduce": "torch's group all_reduce",
    "smddp async+wait": "torch's group async+wait",
    "smddp v1 all_reduce": "torch's group all_reduce",
    "smddp v1 async+wait": "torch's group async+wait",
    # the delegated route's own layer: smddp's group method against the torch backend object it calls
    "smddp group.allreduce([t])": "delegate.backend.allreduce([t])",
}


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


def rounds_of(methods: Dict[str, Callable[[], object]], rounds: int, calls: int) -> Dict[str, List[float]]:
    """Per-round mean host microseconds per call of each method (order rotating every round)."""
    names = list(methods)
    for call in methods.values():
        for _ in range(200):
            call()
    torch.cuda.synchronize()
    per_round: Dict[str, List[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            call = methods[name]
            start = time.perf_counter()
            for _ in range(calls):
                call()
            per_round[name].append((time.perf_counter() - start) / calls * 1e6)
            torch.cuda.synchronize()
    return per_round


def summarize(backend: str, per_round: Dict[str, List[float]]) -> dict:
    """What ``--json`` writes of part 1: per collective, the median over rounds (``us``), each round's
    figure and, for smddp's calls, the within-round ratios to torch's group's same call (each, and
    their min, median and max)."""
    summary: dict = {"backend": backend, "collectives": {}, "primitives": {}}
    for name, values in per_round.items():
        entry: dict = {"us": statistics.median(values), "per_round_us": values}
        if name in AGAINST:
            ratios = [x / y for x, y in zip(values, per_round[AGAINST[name]])]
            entry.update(against=AGAINST[name], ratios=ratios,
                         ratio={"min": min(ratios), "median": statistics.median(ratios), "max": max(ratios)})
        summary["collectives"][name] = entry
    return summary


def collectives(t: torch.Tensor, group, backend: str) -> Dict[str, Callable[[], object]]:
    """The contenders of part 1 (``group``: torch's own NCCL group)."""
    methods = {
        "smddp all_reduce": lambda: tdist.all_reduce(t),
        "smddp async+wait": lambda: tdist.all_reduce(t, async_op=True).wait(),
        "smddp v1 all_reduce": lambda: dist.all_reduce(t),
        "smddp v1 async+wait": lambda: dist.all_reduce(t, async_op=True).wait(),
        "torch's group all_reduce": lambda: tdist.all_reduce(t, group=group),
        "torch's group async+wait": lambda: tdist.all_reduce(t, group=group, async_op=True).wait(),
    }
    if backend == "torch-nccl":
        world = tdist.group.WORLD
        delegate = world.delegate.backend
        tensors = [t]
        methods["smddp group.allreduce([t])"] = lambda: world.allreduce(tensors).wait()
        methods["delegate.backend.allreduce([t])"] = lambda: delegate.allreduce(tensors).wait()
    return methods


def primitives(t: torch.Tensor, backend: str) -> Dict[str, float]:
    """Part 2: the CUDA primitives, and the CuPy route's lane steps."""
    device = torch.device("cuda", 0)
    current = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    event = torch.cuda.Event()
    event.record(current)

    def record() -> None:
        torch.cuda.Event().record(side)

    def device_context() -> None:
        with torch.cuda.device(0):
            pass

    calls: Dict[str, Callable[[], object]] = {
        "current_stream(torch.device)": lambda: torch.cuda.current_stream(device),
        "current_stream(int)": lambda: torch.cuda.current_stream(0),
        "current_stream()": torch.cuda.current_stream,
        "_C._cuda_getCurrentStream(0)": lambda: torch._C._cuda_getCurrentStream(0),
        "side.wait_stream(cur)": lambda: side.wait_stream(current),
        "Event()": torch.cuda.Event,
        "Event()+record(side)": record,
        "cur.wait_event(ev)": lambda: current.wait_event(event),
        "with torch.cuda.device(0)": device_context,
    }
    figures = {name: per_call(name, call) for name, call in calls.items()}
    if backend == "nccl":
        from smddp.torch import groups

        comm = groups.current().engine.comms["cuda"]
        lane = comm._lane
        lane_side = lane.side or side
        ptr = t.data_ptr()

        def calling() -> None:
            with lane.calling(comm.refusal):
                pass

        steps: Dict[str, Callable[[], object]] = {
            "lane.calling": calling,
            "comm.check_async_error": lambda: lane.comm.check_async_error(),
            "comm.check()": comm.check,
            "lane.streams.current()": lane.streams.current,
            "lane.streams.capturing()": lane.streams.capturing,
            "watch.event()+record(current)": lambda: comm.watch.event().record(current),
        }
        figures.update({name: per_call(name, call) for name, call in steps.items()})
        name = "cupy allReduce 256 on the group's stream"
        figures[name] = per_call(name, lambda: lane.comm.allReduce(ptr, ptr, 256, 7, 0, lane_side.cuda_stream), 5000)
    return figures


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=("nccl", "torch-nccl"), default="torch-nccl",
                        help="smddp's route: torch-nccl (the delegated route, smddp's default on CUDA) or "
                             "nccl (CuPy's); default: torch-nccl")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of the collectives (default: 5)")
    parser.add_argument("--calls", type=int, default=2000, help="calls per collective per round (default: 2000)")
    parser.add_argument("--json", metavar="FILE", help="write the figures to FILE")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_call_cost.py needs a CUDA GPU; torch sees none", file=sys.stderr)
        return 2
    torch.cuda.set_device(0)
    dist.init_process_group(backend=args.backend)
    t = torch.ones(256, device="cuda")
    dist.all_reduce(t)  # the communicators exist before anything is timed
    group = tdist.new_group(backend="nccl")
    tdist.all_reduce(t, group=group)
    torch.cuda.synchronize()

    print(f"# smddp {args.backend} vs torch's own NCCL group: host time per call, all_reduce of 256 floats, "
          f"{args.calls} calls per round, {args.rounds} rounds; {torch.cuda.get_device_name(0)}, torch "
          f"{torch.__version__}", flush=True)
    per_round = rounds_of(collectives(t, group, args.backend), args.rounds, args.calls)
    summary = {"command": "python " + " ".join(sys.argv), "rounds": args.rounds, "calls": args.calls,
               **summarize(args.backend, per_round)}
    print(f"{'collective':45s} {'median':>10s}   / torch's group's call: min  median  max")
    for name, entry in summary["collectives"].items():
        line = f"{name:45s} {entry['us']:7.2f} us"
        if "ratio" in entry:
            line += "   " + "  ".join(f"{entry['ratio'][k]:.3f}" for k in ("min", "median", "max"))
        print(line, flush=True)
    print(f"{'primitive':45s} {'mean':>10s}")
    summary["primitives"] = primitives(t, args.backend)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    tdist.destroy_process_group(group)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
