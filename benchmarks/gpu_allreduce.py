"""One of smddp's routes on CUDA against torch's own NCCL group: all_reduce per call and the DDP step.

::

    python benchmarks/gpu_allreduce.py                          # the delegated route (torch-nccl), one GPU
    python benchmarks/gpu_allreduce.py --backend nccl           # CuPy's NCCL, the opt-in route
    mpirun -np 8 python benchmarks/gpu_allreduce.py             # one rank per GPU
    torchrun --nproc-per-node 8 benchmarks/gpu_allreduce.py --backend nccl
    SMDDP_NCCL_STREAM=current python benchmarks/gpu_allreduce.py --backend nccl  # CuPy on the caller's stream
    python benchmarks/gpu_allreduce.py --sizes 1K,1M --no-ddp --json out.json

A job measures one route of smddp, chosen by ``--backend`` (a world has one backend, and its
subgroups take the world's): ``torch-nccl``, smddp's default on CUDA, whose group hands device
tensors straight to torch's ``ProcessGroupNCCL`` (the delegated route), or ``nccl``, NCCL called
through CuPy by smddp's engine. ``tools/gpu_checks.py`` runs one job per route. Contenders, in the
same processes, on the same GPUs, each through ``torch.distributed``:

- ``smddp``: ``torch.distributed.all_reduce(t)`` on smddp's group (``init_process_group``'s), the
  call torch's DDP, Hugging Face and Lightning make; ``smddp v1`` (an extra column):
  ``smddp.torch.distributed.all_reduce(t)``, the call a SageMaker script makes; for the DDP step,
  ``smddp.torch.parallel.DistributedDataParallel`` (torch's DDP on smddp's group);
- ``torch-nccl``: ``torch.distributed.all_reduce(t, group=g)`` with
  ``g = torch.distributed.new_group(backend="nccl")``, torch's own group; for the DDP step, torch's
  ``DistributedDataParallel(model, process_group=g)``;
- ``... async``: ``all_reduce(t, async_op=True).wait()`` on each group (the second table);
- ``compute`` (DDP table only): the plain module, no communication: the floor.

all_reduce: float32 SUM in place at each size. A call is timed with a CUDA event before and
after it on the current stream, so the figure is what the next kernel waits for, including
the host's time to launch when the GPU is idle. Each round runs every contender (order
rotating every round) for ``iters`` calls; a round's figure is the median of its calls on the
slowest rank. The tables show the median over rounds of each contender, and the min, median and
max over rounds of the within-round ratio smddp / torch-nccl (paired, so drift between rounds
cancels); ``--json`` writes each round's ratio too.

DDP step: a 3-layer MLP of about 25M bfloat16 parameters (2048 -> 4096 -> 2048 -> 4096),
batch 32, ``zero_grad()``, forward, MSE loss, ``backward()``, ``SGD.step()``; the step is timed
with CUDA events, both DDPs with 25 MB buckets.

The bars (issue 51), for the delegated route only: the median within-round ratio at most 1.02 for
the synchronous call, the asynchronous one with ``wait()`` and the DDP step. The CuPy route is
reported without a bar (its bars are on the host's path: ``benchmarks/nccl_host_cost.py``).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as tdist

import smddp
import smddp.torch.distributed as dist
from smddp.bench import format_size, parse_size

ROUTES = {"torch-nccl": "the delegated route", "nccl": "CuPy's NCCL"}
#: smddp / torch-nccl, the median of the within-round ratios, per route (issue 51); None: no bar.
BARS: Dict[str, Optional[Dict[str, float]]] = {"torch-nccl": {"sync": 1.02, "async": 1.02, "ddp": 1.02},
                                               "nccl": None}


# ---------------------------------------------------------------------------- timing
def time_calls(call: Callable[[], None], iters: int) -> List[float]:
    """Seconds per call, each between two CUDA events on the current stream."""
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for start, end in events:
        start.record()
        call()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) / 1e3 for start, end in events]


def slowest(values: List[float]) -> List[float]:
    """Each value's maximum over ranks (a CPU tensor: smddp's CPU communicator carries it)."""
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def rounds_of(methods: Dict[str, Callable[[], None]], rounds: int, iters: int) -> Dict[str, List[float]]:
    """Per-round median seconds per call of each method, slowest rank."""
    names = list(methods)
    per_round: Dict[str, List[float]] = {name: [] for name in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        medians = {}
        for name in order:
            dist.barrier()
            medians[name] = statistics.median(time_calls(methods[name], iters))
        maxima = slowest([medians[name] for name in names])
        for name, value in zip(names, maxima):
            per_round[name].append(value)
    return per_round


def compare(per_round: Dict[str, List[float]], mine: str, theirs: str, bar: Optional[float]) -> dict:
    """``mine`` against ``theirs``: the medians over rounds and the within-round ratios (each, and
    their min, median and max), with the verdict where there is a bar."""
    ratios = [x / y for x, y in zip(per_round[mine], per_round[theirs])]
    median = statistics.median(ratios)
    return {"smddp_s": statistics.median(per_round[mine]), "torch_nccl_s": statistics.median(per_round[theirs]),
            "ratios": ratios, "ratio": {"min": min(ratios), "median": median, "max": max(ratios)},
            "bar": bar, "verdict": None if bar is None else ("PASS" if median <= bar else "MISS")}


# ---------------------------------------------------------------------------- contenders
def allreduce_rounds(nbytes: int, group, rounds: int, iters: int, device) -> Dict[str, List[float]]:
    numel = max(nbytes // 4, 1)
    mine = torch.ones(numel, device=device)
    theirs = torch.ones(numel, device=device)
    size = dist.get_world_size()
    # correctness first: one call each, then the values are reset
    dist.all_reduce(mine)
    tdist.all_reduce(theirs, group=group)
    for name, t in (("smddp", mine), ("torch-nccl", theirs)):
        got = float(t[0])
        if got != size:
            raise RuntimeError(f"{name} all_reduce at {format_size(nbytes)} gave {got}, expected {size}")
    mine.fill_(1.0)
    theirs.fill_(1.0)
    methods = {
        "smddp": lambda: tdist.all_reduce(mine),
        "smddp v1": lambda: dist.all_reduce(mine),
        "torch-nccl": lambda: tdist.all_reduce(theirs, group=group),
        "smddp async": lambda: tdist.all_reduce(mine, async_op=True).wait(),
        "torch-nccl async": lambda: tdist.all_reduce(theirs, group=group, async_op=True).wait(),
    }
    for call in methods.values():  # warm up (NCCL connects lazily, per size class)
        time_calls(call, 3)
    return rounds_of(methods, rounds, iters)


def ddp_rounds(group, rounds: int, steps: int, device) -> Tuple[Dict[str, List[float]], int]:
    """Per-round median seconds per DDP step of each contender, and the model's parameter count."""
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from smddp.torch.parallel.distributed import DistributedDataParallel as SmddpDDP

    torch.manual_seed(0)
    base = torch.nn.Sequential(
        torch.nn.Linear(2048, 4096), torch.nn.ReLU(),
        torch.nn.Linear(4096, 2048), torch.nn.ReLU(),
        torch.nn.Linear(2048, 4096),
    ).to(device, torch.bfloat16)
    g = torch.Generator(device=device).manual_seed(dist.get_rank())
    x = torch.randn(32, 2048, device=device, dtype=torch.bfloat16, generator=g)
    y = torch.randn(32, 4096, device=device, dtype=torch.bfloat16, generator=g)
    index = [device.index] if device.type == "cuda" else None
    models = {
        "smddp": SmddpDDP(copy.deepcopy(base), device_ids=index, bucket_cap_mb=25),
        "torch-nccl": TorchDDP(copy.deepcopy(base), device_ids=index, process_group=group, bucket_cap_mb=25),
        "compute": base,
    }
    optimizers = {name: torch.optim.SGD(m.parameters(), lr=1e-3) for name, m in models.items()}

    def step(name: str) -> Callable[[], None]:
        model, opt = models[name], optimizers[name]

        def run() -> None:
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.mse_loss(model(x).float(), y.float()).backward()
            opt.step()

        return run

    methods = {name: step(name) for name in models}
    for call in methods.values():
        time_calls(call, 3)
    return rounds_of(methods, rounds, steps), sum(p.numel() for p in base.parameters())


# ---------------------------------------------------------------------------- report
def _fmt(seconds: float) -> str:
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3f} ms"
    return f"{seconds * 1e6:.1f} us"


def _versions() -> str:
    parts = [f"smddp {smddp.__version__}", f"torch {torch.__version__}", f"CUDA {torch.version.cuda}"]
    try:
        parts.append("NCCL (torch) " + ".".join(map(str, torch.cuda.nccl.version())))
    except Exception:  # noqa: BLE001 - informational
        pass
    try:
        import cupy
        from cupy.cuda import nccl

        parts.append(f"CuPy {cupy.__version__}, NCCL (CuPy) {nccl.get_version()}")
    except Exception:  # noqa: BLE001 - informational
        parts.append("CuPy not importable")
    return ", ".join(parts)


def _command() -> str:
    launcher = os.environ.get("OMPI_COMM_WORLD_SIZE") and f"mpirun -np {os.environ['OMPI_COMM_WORLD_SIZE']} "
    if not launcher and os.environ.get("TORCHELASTIC_RUN_ID"):
        launcher = f"torchrun --nproc-per-node {os.environ.get('LOCAL_WORLD_SIZE', '?')} "
    stream = os.environ.get("SMDDP_NCCL_STREAM")
    prefix = f"SMDDP_NCCL_STREAM={stream} " if stream else ""
    return f"{prefix}{launcher or ''}python {' '.join(sys.argv)}"


def summarize(backend: str, results: dict, ddp: Optional[tuple]) -> dict:
    """The figures of a job (what ``--json`` writes, less the header's): per size, ``sync``, ``v1`` and
    ``async`` (:func:`compare`'s entries) and each contender's per-round seconds; the DDP step's entry.

    Args:
        backend: smddp's route (a key of :data:`ROUTES`).
        results: ``{bytes: (per_round, iters)}`` from :func:`allreduce_rounds`.
        ddp: ``(per_round, params)`` from :func:`ddp_rounds`, or None.
    """
    bars = BARS[backend] or {}
    summary: dict = {"backend": backend, "bars": BARS[backend], "all_reduce": {}}
    for nbytes, (per_round, iters) in results.items():
        summary["all_reduce"][format_size(nbytes)] = {
            "iters": iters,
            "sync": compare(per_round, "smddp", "torch-nccl", bars.get("sync")),
            "v1": compare(per_round, "smddp v1", "torch-nccl", None),
            "async": compare(per_round, "smddp async", "torch-nccl async", bars.get("async")),
            "per_round_s": per_round,
        }
    if ddp is not None:
        per_round, params = ddp
        summary["ddp_step"] = {"params": params, "compute_s": statistics.median(per_round["compute"]),
                               **compare(per_round, "smddp", "torch-nccl", bars.get("ddp")),
                               "per_round_s": per_round}
    return summary


def _row(label: str, iters: str, times: List[str], cmp: dict) -> str:
    r = cmp["ratio"]
    bar = f"{cmp['bar']:.2f} {cmp['verdict']}" if cmp["bar"] is not None else "-"
    return (f"{label:<12s}{iters:>6s}" + "".join(f"{t:>14s}" for t in times)
            + f"{r['min']:>9.3f}{r['median']:>9.3f}{r['max']:>9.3f}  {bar}")


def print_tables(summary: dict, ddp_steps: int) -> None:
    """The tables of :func:`summarize`'s figures."""
    ratio_head = f"{'min':>9s}{'median':>9s}{'max':>9s}  bar"
    print()
    print(f"{'all_reduce':<12s}{'iters':>6s}{'smddp':>14s}{'smddp v1':>14s}{'torch-nccl':>14s}  smddp/torch:"
          f"{ratio_head}")
    for size, entry in summary["all_reduce"].items():
        sync, v1 = entry["sync"], entry["v1"]
        print(_row(size, str(entry["iters"]), [_fmt(sync["smddp_s"]), _fmt(v1["smddp_s"]),
                                               _fmt(sync["torch_nccl_s"])], sync))
    print()
    print(f"{'async+wait':<12s}{'iters':>6s}{'smddp':>14s}{'torch-nccl':>14s}  smddp/torch:{ratio_head}")
    for size, entry in summary["all_reduce"].items():
        cmp = entry["async"]
        print(_row(size, str(entry["iters"]), [_fmt(cmp["smddp_s"]), _fmt(cmp["torch_nccl_s"])], cmp))
    ddp = summary.get("ddp_step")
    if ddp is not None:
        print()
        print(f"DDP step, {ddp['params'] / 1e6:.1f}M bf16 parameters, {ddp_steps} steps per round "
              f"(compute alone: {_fmt(ddp['compute_s'])})")
        print(f"{'':<12s}{'':>6s}{'smddp':>14s}{'torch-nccl':>14s}  smddp/torch:{ratio_head}")
        print(_row("step", "", [_fmt(ddp["smddp_s"]), _fmt(ddp["torch_nccl_s"])], ddp))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=sorted(ROUTES), default="torch-nccl",
                        help="smddp's route: torch-nccl (the delegated route, smddp's default on CUDA) or "
                             "nccl (CuPy's); default: torch-nccl")
    parser.add_argument("--sizes", default="1K,1M,64M,1G", help="comma-separated sizes (default: 1K,1M,64M,1G)")
    parser.add_argument("--rounds", type=int, default=10, help="rounds; each runs every contender (default: 10)")
    parser.add_argument("--iters", type=int, default=0,
                        help="timed calls per contender per round (default: 200 up to 1M, 20 to 64M, 5 above)")
    parser.add_argument("--ddp-steps", type=int, default=10, help="timed DDP steps per contender per round")
    parser.add_argument("--no-ddp", action="store_true", help="skip the DDP step table")
    parser.add_argument("--json", metavar="FILE", help="write the figures to FILE (rank 0)")
    args = parser.parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes.split(",")]

    if not torch.cuda.is_available():
        print("gpu_allreduce.py needs a CUDA GPU; torch sees none", file=sys.stderr)
        return 2
    dist.init_process_group(backend=args.backend)
    torch.cuda.set_device(dist.get_local_rank())
    device = torch.device("cuda", torch.cuda.current_device())
    group = tdist.new_group(backend="nccl")
    rank, size = dist.get_rank(), dist.get_world_size()

    results = {}
    for nbytes in sizes:
        iters = args.iters or (200 if nbytes <= 1 << 20 else 20 if nbytes <= 64 << 20 else 5)
        results[nbytes] = (allreduce_rounds(nbytes, group, args.rounds, iters, device), iters)
    ddp = None if args.no_ddp else ddp_rounds(group, args.rounds, args.ddp_steps, device)

    if rank == 0:
        route = ROUTES[args.backend]
        if args.backend == "nccl":
            from smddp.comm.backends.nccl.communicator import stream_mode

            route = f"{route}, {stream_mode()} stream"
        machine = (f"{torch.cuda.get_device_name(device)} x {torch.cuda.device_count()}, {platform.node()}, "
                   f"{os.cpu_count()} CPUs")
        print(f"# smddp {args.backend} ({route}) vs torch's own NCCL group: {size} rank(s), one GPU each")
        print(f"# command:  {_command()}")
        print(f"# machine:  {machine}")
        print(f"# versions: {_versions()}")
        print(f"# figures:  time per call between CUDA events, median of ITERS calls per round, slowest rank, "
              f"median over {args.rounds} rounds; smddp/torch: min, median, max of the within-round ratios")
        summary = {"command": _command(), "route": route, "ranks": size, "rounds": args.rounds,
                   "machine": machine, "versions": _versions(), **summarize(args.backend, results, ddp)}
        print_tables(summary, args.ddp_steps)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(summary, f, indent=2)
    tdist.destroy_process_group(group)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
