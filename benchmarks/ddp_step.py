"""DDP step time, side by side: smddp's DistributedDataParallel against torch's on gloo.

::

    python benchmarks/ddp_step.py                       # the table for the docs (about a minute)
    python benchmarks/ddp_step.py --jobs 5 --rounds 30  # more samples on a noisy machine
    python benchmarks/ddp_step.py --launcher torchrun   # torchrun jobs instead of mpirun
    python benchmarks/ddp_step.py --json out.json

The driver starts ``mpirun -np 2`` and ``mpirun -np 1`` jobs of this script (``--worker``; or
``torchrun --nproc-per-node``), alternated ``--jobs`` times. In each job every contender runs
in the same processes on the same data, with the same model and optimizer:

- ``smddp``: ``smddp.torch.parallel.DistributedDataParallel(model)`` with smddp's defaults
  (under ``mpirun`` on one host: the shared-memory plane, smddp's communication hook,
  ``gradient_as_bucket_view=True``);
- ``smddp-no-hook``: the same with ``SMDDP_DDP_HOOK=0``: torch's path (the group's
  asynchronous ``allreduce``, its Work and future, the progress thread), buckets as views;
- ``smddp-torch-path``: no hook and ``gradient_as_bucket_view=False``: smddp's defaults
  before issue 26;
- ``torch-gloo``: ``torch.nn.parallel.DistributedDataParallel(model, process_group=g)``,
  ``g = torch.distributed.new_group(backend="gloo")``, with torch's defaults;
- ``no-comm``: smddp's DDP (its defaults) with a communication hook that hands each bucket back
  unreduced: torch's reducer (the copy of each gradient into its bucket) with no communication,
  the floor every backend under torch's DDP stands on;
- ``lockstep``: the plain module with one barrier (smddp's group) as backward ends: what
  keeping the ranks in step costs by itself (each step waits for the slower rank), before a
  byte of gradient moves;
- ``compute``: the plain module, no DDP: the floor of the step itself.

A round is a barrier, then ``--block`` timed steps of each contender in turn, the order
rotating every round; the first rounds are warm-up. A step is ``zero_grad()``, forward,
cross-entropy, ``backward()``, ``SGD.step()``, timed on each rank; a contender's figure is the
median over all its steps (every job, every rank). The breakdown times the phases of the same
steps: ``zero_grad()`` and forward (with DDP's own forward work), ``backward()`` (with the
reducer's copies and the all-reduce), ``SGD.step()``. One thread per rank
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
from typing import Dict, List, Sequence

from smddp.info.report import cpu_model

CONTENDERS = ("smddp", "smddp-no-hook", "smddp-torch-path", "torch-gloo", "no-comm", "lockstep", "compute")
PHASES = ("forward", "backward", "optimizer")
GOAL_OVER_FLOOR, GOAL_SPEEDUP = 1.25, 2.0  # issue 26's goals for the smddp contender


# --------------------------------------------------------------------------- worker (one rank)
def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as tdist

    torch.set_num_threads(1)
    import smddp.torch.distributed as dist
    from smddp.torch.parallel import DistributedDataParallel as DDP

    dist.init_process_group()
    rank = dist.get_rank()
    gloo = tdist.new_group(backend="gloo")

    dims = _layers(args.layers)

    def no_hook_ddp(**kwargs) -> torch.nn.Module:
        saved = os.environ.get("SMDDP_DDP_HOOK")
        os.environ["SMDDP_DDP_HOOK"] = "0"  # read when the model is wrapped
        try:
            return DDP(mlp(dims), **kwargs)
        finally:
            if saved is None:
                del os.environ["SMDDP_DDP_HOOK"]
            else:
                os.environ["SMDDP_DDP_HOOK"] = saved

    def unreduced(state, bucket):  # no annotations: torch checks them, and this file's are strings
        future = torch.futures.Future()
        future.set_result(bucket.buffer())
        return future

    models = {
        "smddp": DDP(mlp(dims)),
        "smddp-no-hook": no_hook_ddp(),
        "smddp-torch-path": no_hook_ddp(gradient_as_bucket_view=False),
        "torch-gloo": torch.nn.parallel.DistributedDataParallel(mlp(dims), process_group=gloo),
        "no-comm": DDP(mlp(dims)),
        "lockstep": mlp(dims),
        "compute": mlp(dims),
    }
    models["no-comm"].register_comm_hook(None, unreduced)
    # The first layer's weight gets its gradient last in backward: the barrier ends backward.
    first = next(models["lockstep"].parameters())
    first.register_post_accumulate_grad_hook(lambda _param: tdist.barrier())
    results = timed_rounds(models, args, gloo, rank, dims)
    finish(args, results, {"params": sum(p.numel() for p in models["compute"].parameters()),
                           "backend": dist.get_backend(), "bucket_mb": models["smddp"].bucket_bytes_cap / 2**20,
                           "smddp_hook": [h.__qualname__ for h, _ in models["smddp"]._comm_hooks]})


def mlp(dims: List[int]):
    """The benchmarks' model: ``Linear`` layers of the given widths with ``ReLU`` between, seeded."""
    import torch

    torch.manual_seed(0)
    layers: List[torch.nn.Module] = []
    for a, b in zip(dims, dims[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def timed_rounds(models: dict, args: argparse.Namespace, group, rank: int, dims: List[int]) -> dict:
    """Time ``--block`` SGD steps of each model in turn, ``--warmup`` + ``--rounds`` rounds, order rotating.

    Every rank trains on its own seeded batch; a barrier on ``group`` starts each contender's block.

    Returns:
        ``{"times": {name: [seconds]}, "phases": {name: [(forward, backward, optimizer)]}}``.
    """
    import torch
    import torch.distributed as tdist

    optimizers = {name: torch.optim.SGD(m.parameters(), lr=1e-3) for name, m in models.items()}
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch_size, dims[0], generator=gen)
    y = torch.randint(0, dims[-1], (args.batch_size,), generator=gen)

    def step(name: str) -> tuple:
        model, opt = models[name], optimizers[name]
        start = time.perf_counter()
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        forward = time.perf_counter()
        loss.backward()
        backward = time.perf_counter()
        opt.step()
        end = time.perf_counter()
        return end - start, (forward - start, backward - forward, end - backward)

    times: Dict[str, List[float]] = {name: [] for name in models}
    phases: Dict[str, List[tuple]] = {name: [] for name in models}
    order = list(models)
    for rnd in range(args.warmup + args.rounds):
        for name in order:
            tdist.barrier(group=group)
            for _ in range(args.block):
                elapsed, parts = step(name)
                if rnd >= args.warmup:
                    times[name].append(elapsed)
                    phases[name].append(parts)
        order = order[1:] + order[:1]
    return {"times": times, "phases": phases}


def finish(args: argparse.Namespace, results: dict, meta: dict) -> None:
    """Gather every rank's ``results``; rank 0 writes them with ``meta`` to ``--worker-out``; end smddp."""
    import torch.distributed as tdist

    import smddp.torch.distributed as dist

    rank = dist.get_rank()
    gathered: List[dict] = [None] * dist.get_world_size()  # type: ignore[list-item]
    # Over smddp's group, not gloo's: torch's gloo group joins its worker threads holding the
    # GIL when it is destroyed, and a worker still releasing an all_gather's Python tensors
    # waits for the GIL (a hang at exit: torch issue 56297).
    tdist.all_gather_object(gathered, {"rank": rank, **results})
    if rank == 0:
        with open(args.worker_out, "w") as f:
            json.dump({"ranks": len(gathered), **meta, "per_rank": gathered}, f)
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


def _layers(text: str) -> List[int]:
    dims = [int(d) for d in text.split(",")]
    if len(dims) < 2 or min(dims) < 1:
        raise SystemExit(f"--layers {text!r}: give at least two positive widths, e.g. 512,2048,1024,512")
    return dims


def _launch(np: int, args: argparse.Namespace, out: str, script: str) -> dict:
    worker = [os.path.abspath(script), "--worker", "--worker-out", out, "--rounds", str(args.rounds),
              "--warmup", str(args.warmup), "--block", str(args.block), "--batch-size", str(args.batch_size),
              "--layers", args.layers]
    if args.launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(np), *worker]
    else:
        mpirun = shutil.which(args.mpirun) or args.mpirun
        cmd = [mpirun, "-np", str(np), "--oversubscribe", sys.executable, *worker]
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


def collect(args: argparse.Namespace, script: str, contenders: Sequence[str], phases: Sequence[str]) -> dict:
    """Run ``script``'s workers in ``--ranks``-rank and 1-rank jobs, alternated ``--jobs`` times.

    Each worker writes ``{"per_rank": [{"times": {contender: [s]}, "phases": {contender: [[s]]}}], ...}``
    (and whatever else it reports, kept as the setup of the parallel job).

    Returns:
        The report's common part: command, machine, versions, setup, ``ms_per_step`` (per world
        size and contender: median, p10, p90), ``per_job`` (each parallel job's medians),
        ``phases_ms`` (the parallel jobs' median of each phase), ``over_floor`` (each contender
        over ``compute``) and ``speedup`` (``torch-gloo`` over ``smddp``).
    """
    name = os.path.splitext(os.path.basename(script))[0]
    versions = _versions()
    load_before = os.getloadavg()
    samples: Dict[int, Dict[str, List[float]]] = {n: {c: [] for c in contenders} for n in (args.ranks, 1)}
    per_job: List[Dict[str, float]] = []  # each parallel job's medians, to show the spread between jobs
    parts: Dict[str, List[list]] = {c: [] for c in contenders}  # the parallel jobs' phase times
    meta: dict = {}
    started = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        for job in range(args.jobs):
            for np in (args.ranks, 1):  # alternated, so both see the same machine
                print(f"{name}: job {job + 1}/{args.jobs}, {np} rank(s)", file=sys.stderr, flush=True)
                found = _launch(np, args, os.path.join(tmp, f"{job}-{np}.json"), script)
                if np > 1:
                    meta = {k: v for k, v in found.items() if k != "per_rank"}
                job_samples: Dict[str, List[float]] = {c: [] for c in contenders}
                for rank in found["per_rank"]:
                    for contender, values in rank["times"].items():
                        samples[np][contender].extend(values)
                        job_samples[contender].extend(values)
                        if np > 1:
                            parts[contender].extend(rank["phases"][contender])
                if np > 1:
                    per_job.append({c: _median_ms(v) for c, v in job_samples.items()})
                print(f"{name}:   medians " + ", ".join(f"{c} {_median_ms(v):.1f} ms" for c, v in job_samples.items())
                      + f"; load average {os.getloadavg()[0]:.2f}", file=sys.stderr, flush=True)
    ms = {n: {c: {"median": _median_ms(v), "p10": _quantile_ms(v, 0.1), "p90": _quantile_ms(v, 0.9),
                  "samples": len(v)} for c, v in by.items()} for n, by in samples.items()}
    return {
        "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
        "machine": {"cores": os.cpu_count(), "usable_cores": len(os.sched_getaffinity(0)),
                    "cpu": cpu_model() or "?", "load_before": load_before, "load_after": os.getloadavg()},
        "versions": versions, "seconds": round(time.time() - started, 1),
        "setup": {"ranks": args.ranks, "batch_size": args.batch_size, "threads_per_rank": 1,
                  "model": "MLP " + "-".join(str(d) for d in _layers(args.layers)), "launcher": args.launcher, **meta,
                  "jobs": args.jobs, "rounds": args.rounds, "block": args.block},
        "ms_per_step": ms,
        "per_job": per_job,
        "phases_ms": {c: {p: _median_ms([t[i] for t in parts[c]]) for i, p in enumerate(phases)} for c in contenders},
        "over_floor": {c: ms[args.ranks][c]["median"] / ms[args.ranks]["compute"]["median"] for c in contenders},
        "speedup": ms[args.ranks]["torch-gloo"]["median"] / ms[args.ranks]["smddp"]["median"],
    }


def spread(report: dict, num: str, den: str) -> str:
    """The lowest and highest ratio ``num / den`` over the report's parallel jobs, paired per job."""
    ratios = [job[num] / job[den] for job in report["per_job"]]
    return f"{min(ratios):.2f}-{max(ratios):.2f}x"


def footer(report: dict) -> List[str]:
    """The report's last lines: command, machine and load, versions, samples."""
    s, m, v = report["setup"], report["machine"], report["versions"]
    return [
        f"command: {report['command']}",
        f"machine: {m['cores']} cores ({m['usable_cores']} usable), {m['cpu']}; load average "
        f"{m['load_before'][0]:.2f} before, {m['load_after'][0]:.2f} after",
        "versions: " + ", ".join(f"{k} {val}" for k, val in v.items()),
        f"samples: {s['jobs']} jobs per world size, {s['rounds']} rounds x {s['block']} steps per contender, "
        f"every rank; {report['seconds']} s",
    ]


def driver(args: argparse.Namespace) -> dict:
    report = collect(args, __file__, CONTENDERS, PHASES)
    two, one = report["ms_per_step"][args.ranks], report["ms_per_step"][1]
    report["speedup_torch_path"] = two["torch-gloo"]["median"] / two["smddp-torch-path"]["median"]
    report["speedup_ceiling"] = two["torch-gloo"]["median"] / two["no-comm"]["median"]
    report["scaling_efficiency"] = {c: one[c]["median"] / two[c]["median"] for c in CONTENDERS if c != "compute"}
    return report


def format_report(report: dict) -> str:
    s = report["setup"]
    n = s["ranks"]
    two, one = report["ms_per_step"][n], report["ms_per_step"][1]
    lines = [
        f"DDP step time: {s['model']} ({s['params'] / 1e6:.1f}M parameters), batch {s['batch_size']} per rank, "
        f"1 thread per rank, {s['launcher']}, smddp backend {s['backend']}, bucket {s['bucket_mb']:g} MB, "
        f"smddp hook {', '.join(s['smddp_hook']) or 'none'}",
        "",
        f"| ms per step (median, p10-p90) | {n} ranks | / floor | 1 rank | scaling efficiency |",
        "|---|---|---|---|---|",
    ]
    labels = (("smddp", "smddp DDP (its defaults)"),
              ("smddp-no-hook", "smddp DDP, no hook (SMDDP_DDP_HOOK=0)"),
              ("smddp-torch-path", "smddp DDP, torch's path (no hook, gradient_as_bucket_view=False)"),
              ("torch-gloo", "torch DDP on gloo"), ("no-comm", "DDP, no communication (reducer only)"),
              ("lockstep", "no DDP, one barrier per step (ranks in step)"),
              ("compute", "no DDP (compute only): the floor"))
    for c, label in labels:
        eff = report["scaling_efficiency"].get(c)
        lines.append(
            f"| {label} | {two[c]['median']:.2f} ({two[c]['p10']:.1f}-{two[c]['p90']:.1f}) "
            f"| {report['over_floor'][c]:.2f}x "
            f"| {one[c]['median']:.2f} ({one[c]['p10']:.1f}-{one[c]['p90']:.1f}) "
            f"| {'' if eff is None else f'{100 * eff:.0f}%'} |"
        )
    lines += ["", f"| where a step's time goes ({n} ranks, ms, medians) | forward | backward | optimizer |",
              "|---|---|---|---|"]
    for c, label in labels:
        ph = report["phases_ms"][c]
        lines.append(f"| {label} | " + " | ".join(f"{ph[p]:.2f}" for p in PHASES) + " |")
    lines += [
        "",
        f"smddp's DDP step is {report['over_floor']['smddp']:.2f}x the no-communication floor (jobs: "
        f"{spread(report, 'smddp', 'compute')}) and {report['speedup']:.2f}x faster than torch DDP on gloo (jobs: "
        f"{spread(report, 'torch-gloo', 'smddp')}); torch's path on smddp: "
        f"{report['over_floor']['smddp-torch-path']:.2f}x the floor, {report['speedup_torch_path']:.2f}x gloo. "
        f"With no communication at all, torch's DDP would be "
        f"{report['speedup_ceiling']:.2f}x faster than on gloo and {report['over_floor']['no-comm']:.2f}x the floor: "
        f"the most any backend under torch's reducer can reach. Without smddp's hook (SMDDP_DDP_HOOK=0) the step "
        f"takes {two['smddp-no-hook']['median'] / two['smddp']['median']:.2f}x smddp's (jobs: "
        f"{spread(report, 'smddp-no-hook', 'smddp')}). Keeping the ranks in step alone (one barrier per step, "
        f"no DDP) costs {report['over_floor']['lockstep']:.2f}x the floor.",
        f"goals (issue 26): within {GOAL_OVER_FLOOR}x of the floor: "
        f"{'PASS' if report['over_floor']['smddp'] <= GOAL_OVER_FLOOR else 'MISS'}; at least {GOAL_SPEEDUP}x "
        f"faster than torch DDP on gloo: {'PASS' if report['speedup'] >= GOAL_SPEEDUP else 'MISS'}",
        "",
        *footer(report),
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
    parser.add_argument("--layers", default="512,2048,1024,512",
                        help="widths of the MLP's layers (default 512,2048,1024,512: 3.7M parameters)")
    parser.add_argument("--launcher", choices=("mpirun", "torchrun"), default="mpirun",
                        help="start the jobs with mpirun (default) or torchrun")
    parser.add_argument("--mpirun", default="mpirun")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per job")
    parser.add_argument("--json", help="also write the report here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)
    return parser


def run(argv, description: str, worker_fn, driver_fn, format_fn) -> None:
    """A step benchmark's entry point: a rank (``--worker``), or the driver that prints (and saves) the report."""
    parser = build_parser()
    parser.description = description
    args = parser.parse_args(argv)
    if args.worker:
        worker_fn(args)
        return
    report = driver_fn(args)
    print(format_fn(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


def main(argv=None) -> None:
    run(argv, __doc__.split("\n")[0], worker, driver, format_report)


if __name__ == "__main__":
    main()
