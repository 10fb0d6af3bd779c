"""DDP step time, side by side: smddp's DistributedDataParallel against torch's on gloo.

::

    python benchmarks/ddp_step.py                       # the table for the docs (about a minute)
    python benchmarks/ddp_step.py --jobs 5 --rounds 30  # more samples on a noisy machine
    python benchmarks/ddp_step.py --json out.json

The driver starts ``mpirun -np 2`` and ``mpirun -np 1`` jobs of this script (``--worker``),
alternated ``--jobs`` times. In each job both contenders run in the same processes on the
same data, with the same model and optimizer:

- ``smddp``: ``smddp.torch.parallel.DistributedDataParallel(model)`` on smddp's default CPU
  backend under ``mpirun`` (``mpi``), with smddp's defaults;
- ``smddp-bucket-view``: the same with ``gradient_as_bucket_view=True`` (the default, as in
  torch, is ``False``), to tell that flag's share from the communication's;
- ``torch-gloo``: ``torch.nn.parallel.DistributedDataParallel(model, process_group=g)``,
  ``g = torch.distributed.new_group(backend="gloo")``, with torch's defaults;
- ``no-comm``: smddp's DDP with a communication hook that hands each bucket back unreduced:
  torch's reducer (hooks, bucket copies) with no communication at all, the floor every backend
  under torch's DDP stands on. ``torch-gloo / no-comm`` is the most any backend can gain;
- ``compute``: the plain module, no DDP: the floor both stand on.

A round is a barrier, then ``--block`` timed steps of each contender in turn, the order
rotating every round; the first rounds are warm-up. A step is ``zero_grad()``, forward,
cross-entropy, ``backward()``, ``SGD.step()``, timed on each rank; a contender's figure is the
median over all its steps (every job, every rank). One thread per rank
(``torch.set_num_threads(1)``, ``OMP_NUM_THREADS=1``). Scaling efficiency is weak scaling:
the step time of one rank alone divided by the step time with two ranks, each on its own
batch of the same size.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List

CONTENDERS = ("smddp", "smddp-bucket-view", "torch-gloo", "no-comm", "compute")


# --------------------------------------------------------------------------- worker (one rank)
def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as tdist

    torch.set_num_threads(1)
    import smddp.torch.distributed as dist
    from smddp.torch.parallel import DistributedDataParallel as DDP

    dist.init_process_group()
    rank, size = dist.get_rank(), dist.get_world_size()
    gloo = tdist.new_group(backend="gloo")

    def mlp() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(
            torch.nn.Linear(args.features, args.hidden), torch.nn.ReLU(),
            torch.nn.Linear(args.hidden, args.features), torch.nn.ReLU(),
            torch.nn.Linear(args.features, 10),
        )

    def unreduced(state, bucket):  # no annotations: torch checks them, and this file's are strings
        future = torch.futures.Future()
        future.set_result(bucket.buffer())
        return future

    models = {
        "smddp": DDP(mlp()),
        "smddp-bucket-view": DDP(mlp(), gradient_as_bucket_view=True),
        "torch-gloo": torch.nn.parallel.DistributedDataParallel(mlp(), process_group=gloo),
        "no-comm": DDP(mlp()),
        "compute": mlp(),
    }
    models["no-comm"].register_comm_hook(None, unreduced)
    optimizers = {name: torch.optim.SGD(m.parameters(), lr=1e-3) for name, m in models.items()}
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch_size, args.features, generator=gen)
    y = torch.randint(0, 10, (args.batch_size,), generator=gen)

    def step(name: str) -> None:
        model, opt = models[name], optimizers[name]
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    times: Dict[str, List[float]] = {name: [] for name in models}
    order = list(models)
    for rnd in range(args.warmup + args.rounds):
        for name in order:
            tdist.barrier(group=gloo)
            for _ in range(args.block):
                start = time.perf_counter()
                step(name)
                elapsed = time.perf_counter() - start
                if rnd >= args.warmup:
                    times[name].append(elapsed)
        order = order[1:] + order[:1]

    params = sum(p.numel() for p in models["compute"].parameters())
    gathered: List[dict] = [None] * size  # type: ignore[list-item]
    # Over smddp's group, not gloo's: torch's gloo group joins its worker threads holding the
    # GIL when it is destroyed, and a worker still releasing an all_gather's Python tensors
    # waits for the GIL (a hang at exit: torch issue 56297).
    tdist.all_gather_object(gathered, {"rank": rank, "times": times})
    if rank == 0:
        with open(args.worker_out, "w") as f:
            json.dump({"ranks": size, "params": params, "backend": dist.get_backend(),
                       "bucket_mb": models["smddp"].bucket_bytes_cap / 2**20, "per_rank": gathered}, f)
    dist.barrier()
    dist.destroy_process_group()


# --------------------------------------------------------------------------- driver
def _versions() -> Dict[str, str]:
    import torch

    import smddp

    found = {"python": platform.python_version(), "torch": torch.__version__, "smddp": smddp.__version__}
    try:
        import mpi4py

        found["mpi4py"] = mpi4py.__version__
        out = subprocess.run(["mpirun", "--version"], capture_output=True, text=True, timeout=30).stdout
        found["mpi"] = out.splitlines()[0] if out else "?"
    except Exception:  # noqa: BLE001 - the report says what it could not find
        found.setdefault("mpi4py", "not installed")
    return found


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def _launch(np: int, args: argparse.Namespace, out: str) -> dict:
    mpirun = shutil.which(args.mpirun) or args.mpirun
    cmd = [mpirun, "-np", str(np), "--oversubscribe", sys.executable, os.path.abspath(__file__), "--worker",
           "--worker-out", out, "--rounds", str(args.rounds), "--warmup", str(args.warmup),
           "--block", str(args.block), "--batch-size", str(args.batch_size), "--features", str(args.features),
           "--hidden", str(args.hidden)]
    env = dict(os.environ, OMP_NUM_THREADS="1", OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH", "")]))
    for name in ("SMDDP_BACKEND", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0:
        raise SystemExit(f"benchmark job failed ({' '.join(cmd)}):\n{proc.stdout}\n{proc.stderr}")
    with open(out) as f:
        return json.load(f)


def _median_ms(samples: List[float]) -> float:
    return 1e3 * statistics.median(samples)


def _quantile_ms(samples: List[float], q: float) -> float:
    ordered = sorted(samples)
    return 1e3 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def driver(args: argparse.Namespace) -> dict:
    versions = _versions()
    load_before = os.getloadavg()
    samples: Dict[int, Dict[str, List[float]]] = {n: {c: [] for c in CONTENDERS} for n in (args.ranks, 1)}
    meta: dict = {}
    started = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        for job in range(args.jobs):
            for np in (args.ranks, 1):  # alternated, so both see the same machine
                print(f"ddp_step: job {job + 1}/{args.jobs}, {np} rank(s)", file=sys.stderr, flush=True)
                found = _launch(np, args, os.path.join(tmp, f"{job}-{np}.json"))
                meta = {k: found[k] for k in ("params", "backend", "bucket_mb")} if np > 1 else meta
                job_samples: Dict[str, List[float]] = {c: [] for c in CONTENDERS}
                for rank in found["per_rank"]:
                    for name, values in rank["times"].items():
                        samples[np][name].extend(values)
                        job_samples[name].extend(values)
                print("ddp_step:   medians " + ", ".join(f"{c} {_median_ms(v):.1f} ms" for c, v in job_samples.items())
                      + f"; load average {os.getloadavg()[0]:.2f}", file=sys.stderr, flush=True)
    report = {
        "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
        "machine": {"cores": os.cpu_count(), "usable_cores": len(os.sched_getaffinity(0)),
                    "cpu": _cpu_model(), "load_before": load_before, "load_after": os.getloadavg()},
        "versions": versions, "seconds": round(time.time() - started, 1),
        "setup": {"ranks": args.ranks, "batch_size": args.batch_size, "threads_per_rank": 1,
                  "model": f"MLP {args.features}-{args.hidden}-{args.features}-10", **meta,
                  "jobs": args.jobs, "rounds": args.rounds, "block": args.block},
        "ms_per_step": {n: {c: {"median": _median_ms(v), "p10": _quantile_ms(v, 0.1), "p90": _quantile_ms(v, 0.9),
                                "samples": len(v)} for c, v in by.items()} for n, by in samples.items()},
    }
    two, one = report["ms_per_step"][args.ranks], report["ms_per_step"][1]
    report["speedup"] = two["torch-gloo"]["median"] / two["smddp"]["median"]
    report["speedup_bucket_view"] = two["torch-gloo"]["median"] / two["smddp-bucket-view"]["median"]
    report["speedup_ceiling"] = two["torch-gloo"]["median"] / two["no-comm"]["median"]
    report["scaling_efficiency"] = {c: one[c]["median"] / two[c]["median"] for c in CONTENDERS if c != "compute"}
    return report


def format_report(report: dict) -> str:
    s, m, v = report["setup"], report["machine"], report["versions"]
    n = s["ranks"]
    two, one = report["ms_per_step"][n], report["ms_per_step"][1]
    lines = [
        f"DDP step time: {s['model']} ({s['params'] / 1e6:.1f}M parameters), batch {s['batch_size']} per rank, "
        f"1 thread per rank, smddp backend {s['backend']}, bucket {s['bucket_mb']:g} MB",
        "",
        f"| ms per step (median, p10-p90) | {n} ranks | 1 rank | scaling efficiency |",
        "|---|---|---|---|",
    ]
    labels = (("smddp", "smddp DDP"), ("smddp-bucket-view", "smddp DDP, gradient_as_bucket_view=True"),
              ("torch-gloo", "torch DDP on gloo"), ("no-comm", "DDP, no communication (reducer only)"),
              ("compute", "no DDP (compute only)"))
    for c, label in labels:
        eff = report["scaling_efficiency"].get(c)
        lines.append(
            f"| {label} | {two[c]['median']:.2f} ({two[c]['p10']:.1f}-{two[c]['p90']:.1f}) "
            f"| {one[c]['median']:.2f} ({one[c]['p10']:.1f}-{one[c]['p90']:.1f}) "
            f"| {'' if eff is None else f'{100 * eff:.0f}%'} |"
        )
    lines += [
        "",
        f"smddp is {report['speedup']:.2f}x faster per step than torch DDP on gloo with {n} ranks "
        f"({report['speedup_bucket_view']:.2f}x with gradient_as_bucket_view=True). With no communication "
        f"at all, torch's DDP would be {report['speedup_ceiling']:.2f}x faster than on gloo: the most "
        f"any backend under torch's DDP can gain here.",
        "",
        f"command: {report['command']}",
        f"machine: {m['cores']} cores ({m['usable_cores']} usable), {m['cpu']}; load average "
        f"{m['load_before'][0]:.2f} before, {m['load_after'][0]:.2f} after",
        "versions: " + ", ".join(f"{k} {val}" for k, val in v.items()),
        f"samples: {s['jobs']} jobs per world size, {s['rounds']} rounds x {s['block']} steps per contender, "
        f"every rank; {report['seconds']} s",
    ]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=2, help="ranks of the parallel job (default 2)")
    parser.add_argument("--jobs", type=int, default=3, help="jobs per world size, alternated (default 3)")
    parser.add_argument("--rounds", type=int, default=12, help="measured rounds per job (default 12)")
    parser.add_argument("--warmup", type=int, default=2, help="warm-up rounds per job (default 2)")
    parser.add_argument("--block", type=int, default=3, help="steps per contender per round (default 3)")
    parser.add_argument("--batch-size", type=int, default=16, help="batch per rank (default 16)")
    parser.add_argument("--features", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--mpirun", default="mpirun")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per job")
    parser.add_argument("--json", help="also write the report here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)
    return parser


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    if args.worker:
        worker(args)
        return
    report = driver(args)
    print(format_report(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
