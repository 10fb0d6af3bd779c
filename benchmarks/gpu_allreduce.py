"""smddp's ``nccl`` backend (NCCL through CuPy) against torch's own NCCL group, on CUDA.

::

    python benchmarks/gpu_allreduce.py                          # one GPU, world size 1
    mpirun -np 8 python benchmarks/gpu_allreduce.py             # one rank per GPU
    torchrun --nproc-per-node 8 benchmarks/gpu_allreduce.py
    SMDDP_NCCL_STREAM=current python benchmarks/gpu_allreduce.py  # on the caller's stream, not the group's
    python benchmarks/gpu_allreduce.py --sizes 1K,1M --no-ddp --json out.json

Contenders, in the same processes, on the same GPUs, each through ``torch.distributed``:

- ``smddp``: ``torch.distributed.all_reduce(t)`` on smddp's group (``init_process_group``'s,
  ``nccl`` backend), the call torch's DDP, Hugging Face and Lightning make; ``smddp v1`` (an
  extra column): ``smddp.torch.distributed.all_reduce(t)``, the call a SageMaker script makes;
  for the DDP step, ``smddp.torch.parallel.DistributedDataParallel`` (torch's DDP on smddp's group);
- ``torch-nccl``: ``torch.distributed.all_reduce(t, group=g)`` with
  ``g = torch.distributed.new_group(backend="nccl")``; for the DDP step, torch's
  ``DistributedDataParallel(model, process_group=g)``;
- ``... async``: ``all_reduce(t, async_op=True).wait()`` on each group (the second table);
- ``compute`` (DDP table only): the plain module, no communication: the floor.

all_reduce: float32 SUM in place at each size. A call is timed with a CUDA event before and
after it on the current stream, so the figure is what the next kernel waits for, including
the host's time to launch when the GPU is idle. Each round runs every contender (order
rotating every round) for ``iters`` calls; a round's figure is the median of its calls on the
slowest rank. The table shows the median over rounds; a ratio is the median over rounds of
the within-round ratio (paired, so drift between rounds cancels).

DDP step: a 3-layer MLP of about 25M bfloat16 parameters (2048 -> 4096 -> 2048 -> 4096),
batch 32, ``zero_grad()``, forward, MSE loss, ``backward()``, ``SGD.step()``; the step is timed
with CUDA events, both DDPs with 25 MB buckets.

The bars (issue 43): a synchronous call no slower than torch's NCCL group (ratio <= 1.00), an
asynchronous one with ``wait()`` within 1.10, the DDP step within 1.03.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
from typing import Callable, Dict, List

import torch
import torch.distributed as tdist

import smddp
import smddp.torch.distributed as dist
from smddp.bench import format_size, parse_size

BARS = {"sync": 1.00, "async": 1.10, "ddp": 1.03}  # smddp / torch-nccl


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


def ratio(per_round: Dict[str, List[float]], a: str, b: str) -> float:
    return statistics.median(x / y for x, y in zip(per_round[a], per_round[b]))


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


def ddp_rounds(group, rounds: int, steps: int, device) -> Dict[str, List[float]]:
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from smddp.torch.parallel.distributed import DistributedDataParallel as SmddpDDP

    torch.manual_seed(0)
    base = torch.nn.Sequential(
        torch.nn.Linear(2048, 4096), torch.nn.ReLU(),
        torch.nn.Linear(4096, 2048), torch.nn.ReLU(),
        torch.nn.Linear(2048, 4096),
    ).to(device, torch.bfloat16)
    params = sum(p.numel() for p in base.parameters())
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
    per_round = rounds_of(methods, rounds, steps)
    per_round["_params"] = [float(params)]
    return per_round


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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    dist.init_process_group(backend="nccl")
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
        from smddp.comm.backends.nccl.communicator import stream_mode

        print(f"# smddp nccl (CuPy, {stream_mode()} stream) vs torch's NCCL group: {size} rank(s), one GPU each")
        print(f"# command:  {_command()}")
        print(f"# machine:  {torch.cuda.get_device_name(device)} x {torch.cuda.device_count()}, "
              f"{platform.node()}, {os.cpu_count()} CPUs")
        print(f"# versions: {_versions()}")
        print(f"# figures:  time per call between CUDA events, median of ITERS calls per round, slowest rank, "
              f"median over {args.rounds} rounds; ratios: median of within-round ratios")
        print()
        print(f"{'all_reduce':<12s}{'iters':>6s}{'smddp':>14s}{'smddp v1':>14s}{'torch-nccl':>14s}"
              f"{'smddp/torch':>14s}  bar {BARS['sync']:.2f}")
        summary = {"command": _command(), "ranks": size, "versions": _versions(), "bars": BARS, "all_reduce": {}}
        for nbytes, (per_round, iters) in results.items():
            a, v1, b = (statistics.median(per_round[n]) for n in ("smddp", "smddp v1", "torch-nccl"))
            r = ratio(per_round, "smddp", "torch-nccl")
            verdict = "PASS" if r <= BARS["sync"] else "MISS"
            print(f"{format_size(nbytes):<12s}{iters:>6d}{_fmt(a):>14s}{_fmt(v1):>14s}{_fmt(b):>14s}"
                  f"{r:>13.3f}x  {verdict}")
            summary["all_reduce"][format_size(nbytes)] = {
                "smddp_s": a, "smddp_v1_s": v1, "torch_nccl_s": b, "ratio": r, "verdict": verdict,
                "per_round_s": per_round}
        print()
        print(f"{'async+wait':<12s}{'iters':>6s}{'smddp':>14s}{'':>14s}{'torch-nccl':>14s}"
              f"{'smddp/torch':>14s}  bar {BARS['async']:.2f}")
        for nbytes, (per_round, iters) in results.items():
            a, b = (statistics.median(per_round[n]) for n in ("smddp async", "torch-nccl async"))
            r = ratio(per_round, "smddp async", "torch-nccl async")
            verdict = "PASS" if r <= BARS["async"] else "MISS"
            print(f"{format_size(nbytes):<12s}{iters:>6d}{_fmt(a):>14s}{'':>14s}{_fmt(b):>14s}{r:>13.3f}x  {verdict}")
            summary["all_reduce"][format_size(nbytes)].update(
                {"async_smddp_s": a, "async_torch_nccl_s": b, "async_ratio": r, "async_verdict": verdict})
        if ddp is not None:
            params = int(ddp.pop("_params")[0])
            a, b, c = (statistics.median(ddp[n]) for n in ("smddp", "torch-nccl", "compute"))
            r = ratio(ddp, "smddp", "torch-nccl")
            verdict = "PASS" if r <= BARS["ddp"] else "MISS"
            print()
            print(f"DDP step, {params / 1e6:.1f}M bf16 parameters, {args.ddp_steps} steps per round")
            print(f"{'':<12s}{'':>6s}{'smddp':>14s}{'torch-nccl':>14s}{'smddp/torch':>14s}  bar {BARS['ddp']:.2f}  "
                  f"compute")
            print(f"{'step':<12s}{'':>6s}{_fmt(a):>14s}{_fmt(b):>14s}{r:>13.3f}x  {verdict}  {_fmt(c)}")
            summary["ddp_step"] = {"params": params, "smddp_s": a, "torch_nccl_s": b, "compute_s": c,
                                   "ratio": r, "verdict": verdict, "per_round_s": ddp}
        if args.json:
            with open(args.json, "w") as f:
                json.dump(summary, f, indent=2)
    tdist.destroy_process_group(group)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
