"""Job-to-job spread of the CPU all_reduce: N separate jobs, smddp beside a reference in each.

::

    python benchmarks/allreduce_jobs.py --jobs 10                          # 10 mpirun -np 2 jobs
    python benchmarks/allreduce_jobs.py --jobs 10 --launcher torchrun
    python benchmarks/allreduce_jobs.py --jobs 10 --launcher smddprun-local
    python benchmarks/allreduce_jobs.py --jobs 10 --trees /tmp/before,.   # two checkouts, jobs alternated
    python benchmarks/allreduce_jobs.py --jobs 10 --json out.json          # every job's figures and state

Every other benchmark reports medians over rounds within one job; a job that settles into a slow
state for its whole life is then one sample among many, or never seen. This one starts ``--jobs``
separate jobs, one after the other (do not wrap it in a launcher), each timing in the same two
processes, per size (float32 SUM, in place):

- ``smddp``: ``smddp.torch.distributed.all_reduce(t)``;
- ``ref``: the other library in the same processes: Open MPI (``comm.Allreduce(MPI.IN_PLACE,
  a)`` on a numpy array: mpi4py's fastest call) under ``mpirun`` and ``smddprun`` (which starts
  mpirun); torch's gloo (``torch.distributed.all_reduce`` on ``new_group(backend="gloo")``)
  under ``torchrun`` and ``smddprun-local``, where the processes have no MPI world;
- ``floor``: numpy's ``add(x, y, out=x)`` on every rank at once on arrays of the message's size,
  scaled to an all-reduce's least memory traffic (as ``allreduce_cpu.py``'s): what the
  job's cores and memory give, whatever the library.

Within a job each round runs the three in an order that rotates, each after a barrier for
``iters`` calls timed one by one; a round's figure is the median call on the slowest rank, and the
job's figure the median over its rounds. The report gives, per size and method, the distribution of
the per-job figures (min, median, max) and how many jobs took over 2x the median job; and the
issue's bar (issue 55): no job whose smddp figure is over 2x the median job's while its
reference stays within 1.5x of the reference's median job. Each job also records what it can see
of its own state, per rank, over its smddp turns: the CPUs it may run on (``Cpus_allowed_list``)
and did run on, its run delay (``/proc/self/schedstat``: time runnable but not running) and
context switches, and, where the shared-memory core counts them, its sleeps on a peer and how
late the peer's publish woke them. ``--json`` keeps all of it.

``--trees A,B``: alternate the jobs among checkouts (``PYTHONPATH``), this worker in each: the
same jobs, before and after a change, under the same load. The load average is printed with
every job.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import sysconfig
import time
from pathlib import Path
from typing import Dict, List

HERE = Path(__file__).resolve()
ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE.parent))
from launchers_cpu import fmt_time, run_worker  # noqa: E402 - the job runner, next to this file

DEFAULT_SIZES = "64K,1M,16M"
LAUNCHERS = ("mpirun", "torchrun", "smddprun", "smddprun-local")
METHODS = ("smddp", "ref", "floor")
SLOW = 2.0  # a job over SLOW x the median job's smddp figure is slow ...
REF_HOLDS = 1.5  # ... unless its reference is over REF_HOLDS x the reference's median job too


def _iters(nbytes: int) -> int:
    return 100 if nbytes <= 64 << 10 else 20 if nbytes <= 1 << 20 else 5


# ---------------------------------------------------------------------------- inside a job
def _proc_state() -> Dict[str, object]:
    """This process's CPU placement and scheduling figures, summed over its threads."""
    status = Path("/proc/self/status").read_text()
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    delay = switches = forced = 0
    for task in Path("/proc/self/task").iterdir():
        try:
            delay += int((task / "schedstat").read_text().split()[1])
            tfields = dict(line.split(":", 1) for line in (task / "status").read_text().splitlines() if ":" in line)
            switches += int(tfields["voluntary_ctxt_switches"])
            forced += int(tfields["nonvoluntary_ctxt_switches"])
        except (OSError, KeyError, IndexError, ValueError):
            continue  # a thread that ended meanwhile
    cpu = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[36])
    return {"allowed": fields.get("Cpus_allowed_list", "?").strip(), "cpu": cpu, "run_delay_ns": delay,
            "switches": switches, "forced_switches": forced}


_CORE_COUNTERS = ("sleeps", "slept_ns", "woken_late_ns", "moves")


def _core_counters(segment) -> Dict[str, int]:
    """The shared-memory core's own counters, where this checkout's core keeps them."""
    return {name: int(getattr(segment, name)) for name in _CORE_COUNTERS if hasattr(segment, name)}


def worker(sizes: List[int], rounds: int, launcher: str) -> None:
    """Run inside a job: time each method; rank 0 prints ``RESULT <json>``."""
    import numpy as np
    import torch
    import torch.distributed as tdist

    import smddp
    import smddp.torch.distributed as dist
    from smddp.torch import groups

    dist.init_process_group()
    rank, size = dist.get_rank(), dist.get_world_size()
    communicator = groups.current().engine.comms["cpu"]
    if launcher in ("mpirun", "smddprun"):
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
        barrier = comm.Barrier
        ref_name = "Open MPI"

        def gather(value):
            return comm.allgather(value)

        def reference(array, _tensor):
            comm.Allreduce(MPI.IN_PLACE, array, op=MPI.SUM)
    else:
        gloo = tdist.new_group(backend="gloo")
        barrier = dist.barrier
        ref_name = "gloo"

        def gather(value):
            out = [None] * size
            tdist.all_gather_object(out, value, group=gloo)
            return out

        def reference(_array, tensor):
            tdist.all_reduce(tensor, group=gloo)

    factor = (3 * size - 1) / (3 * size)  # allreduce_cpu.py's floor: least traffic over numpy add's
    per_size = {}
    for nbytes in sizes:
        numel = nbytes // 4
        tensor, ref_tensor = torch.ones(numel), torch.ones(numel)
        array = np.ones(numel, dtype=np.float32)
        x, y = np.ones(numel, dtype=np.float32), np.ones(numel, dtype=np.float32)
        calls = {"smddp": lambda t=tensor: dist.all_reduce(t),
                 "ref": lambda a=array, t=ref_tensor: reference(a, t),
                 "floor": lambda x=x, y=y: np.add(x, y, out=x)}
        for name in METHODS:  # warm up: first touches of the buffers, the planes' caches
            for _ in range(3):
                calls[name]()
        tensor.fill_(1.0)
        dist.all_reduce(tensor)
        plane = getattr(communicator, "_shm", None)  # made by a group's first collective, or as it is made
        segment = getattr(plane, "_seg", None)
        if float(tensor[0]) != size:
            raise RuntimeError(f"all_reduce of {nbytes} bytes gave {float(tensor[0])}, expected {size}")
        iters = _iters(nbytes)
        figures: Dict[str, List[float]] = {name: [] for name in METHODS}
        state = {"run_delay_ns": 0, "switches": 0, "forced_switches": 0, "trace": [], "smddp_s": 0.0}
        counters = dict.fromkeys(_core_counters(segment), 0)
        for r in range(rounds):
            order = METHODS[r % 3:] + METHODS[:r % 3]
            for name in order:
                call = calls[name]
                barrier()
                if name == "smddp":
                    before, core_before, began = _proc_state(), _core_counters(segment), time.perf_counter()
                samples = []
                for _ in range(iters):
                    start = time.perf_counter()
                    call()
                    samples.append(time.perf_counter() - start)
                if name == "smddp":
                    state["smddp_s"] += time.perf_counter() - began
                    after, core_after = _proc_state(), _core_counters(segment)
                    for key in ("run_delay_ns", "switches", "forced_switches"):
                        state[key] += after[key] - before[key]
                    state["trace"] += [before["cpu"], after["cpu"]]
                    for key in counters:
                        counters[key] += core_after[key] - core_before[key]
                figures[name].append(statistics.median(samples))
        state["allowed"] = _proc_state()["allowed"]
        state["core"] = counters
        state["calls"] = rounds * iters
        ranks = gather({"figures": figures, "state": state})
        slowest = {name: [max(rk["figures"][name][i] for rk in ranks) for i in range(rounds)] for name in METHODS}
        slowest["floor"] = [t * factor for t in slowest["floor"]]
        per_size[str(nbytes)] = {"median_s": {name: statistics.median(slowest[name]) for name in METHODS},
                                 "ranks": [rk["state"] for rk in ranks]}
    if rank == 0:
        print("RESULT " + json.dumps({"sizes": per_size, "ref": ref_name, "plane": getattr(communicator, "plane", "?"),
                                      "native": bool(getattr(plane, "native", False)),
                                      "smddp": str(Path(smddp.__file__).parent.parent)}), flush=True)
    dist.destroy_process_group()


# ---------------------------------------------------------------------------- the driver
def _command(launcher: str, np: int, worker_args: List[str]) -> List[str]:
    me = [str(HERE), "--worker", "--launcher", launcher, *worker_args]
    if launcher == "mpirun":
        mpirun = Path(sysconfig.get_path("scripts")) / "mpirun"
        mpirun = str(mpirun) if mpirun.exists() else shutil.which("mpirun")
        if mpirun is None:
            raise SystemExit("mpirun not found: pip install 'smddp[mpi]'")
        return [mpirun, "-np", str(np), "-x", "PYTHONPATH", "-x", "OMP_NUM_THREADS", sys.executable, *me]
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(np), *me]
    # smddprun under mpirun (its SageMaker-like path, with an MPI world) or its own local launcher
    how = ["--launcher", "local" if launcher == "smddprun-local" else "mpirun"]
    return [sys.executable, "-m", "smddp.launch", *how, "-np", str(np), *me]


def run_job(launcher: str, np: int, worker_args: List[str], tree: Path, extra_env: Dict[str, str]) -> Dict:
    return run_worker(launcher, _command(launcher, np, worker_args), tree, extra_env)


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def slow_jobs(smddp: List[float], ref: List[float]) -> List[int]:
    """Indexes of the jobs the issue's bar counts: smddp over SLOW x its median job while the
    reference in the same job is within REF_HOLDS x the reference's median job."""
    s_med, r_med = statistics.median(smddp), statistics.median(ref)
    return [i for i, (s, r) in enumerate(zip(smddp, ref)) if s > SLOW * s_med and r <= REF_HOLDS * r_med]


def _state_line(job: Dict, key: str) -> str:
    """One job's state at one size, per rank: CPUs, run delay and switches per call, the core's sleeps."""
    ranks = job["sizes"][key]["ranks"]
    together = sum(len(set(cpus)) == 1 for cpus in zip(*(st["trace"] for st in ranks)))
    cells = [f"one CPU {together}/{len(ranks[0]['trace'])}"]
    for rank, st in enumerate(ranks):
        calls = max(1, st["calls"])
        cell = (f"r{rank} cpus {st['allowed']}/{','.join(map(str, sorted(set(st['trace']))))} "
                f"delay {st['run_delay_ns'] / max(st['smddp_s'], 1e-9) / 1e9:.0%} "
                f"sw {st['switches'] / calls:.1f}/{st['forced_switches'] / calls:.1f}")
        core = st.get("core") or {}
        if "sleeps" in core:
            sleeps = core["sleeps"]
            cell += f" sleeps {sleeps / calls:.1f}"
            if sleeps:
                cell += f" late {core['woken_late_ns'] / sleeps / 1e3:.0f}us"
        if core.get("moves"):
            cell += f" moved {core['moves']}x"
        cells.append(cell)
    return "; ".join(cells)


def report(launcher: str, np: int, sizes: List[int], runs: Dict[str, List[Dict]], rounds: int, argv: List[str],
           format_size) -> Dict:
    first = next(job for jobs in runs.values() for job in jobs)
    print(f"# smddp all_reduce, job to job: float32 SUM in place, {np} ranks, {launcher}")
    print(f"# command:  python benchmarks/allreduce_jobs.py {' '.join(argv)}")
    print(f"# machine:  {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, {platform.system()} "
          f"{platform.release()}; CPU plane {first['plane']} ({'compiled core' if first['native'] else 'Python path'})")
    print(f"# figures:  per job, the median over {rounds} rounds of the slowest rank's median call; ref: "
          f"{first['ref']} in the same processes; floor: numpy's add on every rank at once, scaled")
    print(f"# bar:      no job with smddp over {SLOW:g}x the median job while ref is within {REF_HOLDS:g}x of its own")
    summary = {}
    for tree, jobs in runs.items():
        if len(runs) > 1:
            print(f"\n## tree {tree}")
        print(f"\n{'size':<6}{'method':<8}{'jobs':>5}{'min':>11}{'median':>11}{'max':>11}{'max/med':>9}"
              f"{'>2x':>5}   bar")
        tree_summary = {}
        for nbytes in sizes:
            key = str(nbytes)
            series = {m: [job["sizes"][key]["median_s"][m] for job in jobs] for m in METHODS}
            slow = slow_jobs(series["smddp"], series["ref"])
            row = {}
            for m in METHODS:
                values = series[m]
                med = statistics.median(values)
                over = sum(v > SLOW * med for v in values)
                bar = ""
                if m == "smddp":
                    bar = f"MISS (jobs {', '.join(str(i + 1) for i in slow)})" if slow else "PASS"
                label = first["ref"] if m == "ref" else m
                print(f"{format_size(nbytes):<6}{label[:8]:<8}{len(values):>5}{fmt_time(min(values)):>11}{fmt_time(med):>11}"
                      f"{fmt_time(max(values)):>11}{max(values) / med:>8.2f}x{over:>5}   {bar}")
                row[m] = {"min": min(values), "median": med, "max": max(values), "over_2x": over, "jobs": values}
            row["slow_jobs"] = [i + 1 for i in slow]
            tree_summary[format_size(nbytes)] = row
        summary[tree] = tree_summary
        print("\njob  load  " + "".join(f"{format_size(n) + ' smddp/ref':>18}" for n in sizes))
        for i, job in enumerate(jobs):
            medians = [job["sizes"][str(n)]["median_s"] for n in sizes]
            cells = "".join(f"{m['smddp'] / m['ref']:>17.2f}x" for m in medians)
            print(f"{i + 1:<4} {job['load'].split()[0]:>5}{cells}")
        print("\nper job and size, over its smddp turns: how often every rank was on one CPU (sampled as each turn "
              "began and ended); each rank's CPUs allowed/run on, run delay (share of the wall time), "
              "voluntary/forced switches per call, and where the core counts them, sleeps on a peer per call and "
              "how late the peer's publish woke them, and its moves off a peer's CPU")
        for i, job in enumerate(jobs):
            for nbytes in sizes:
                print(f"  job {i + 1} {format_size(nbytes)}: {_state_line(job, str(nbytes))}")
    return summary


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=10, help="separate jobs to start (default: 10)")
    parser.add_argument("--launcher", choices=LAUNCHERS, default="mpirun",
                        help="what starts each job (default: mpirun)")
    parser.add_argument("--np", type=int, default=2, help="ranks per job (default: 2)")
    parser.add_argument("--sizes", default=DEFAULT_SIZES, help=f"message sizes (default: {DEFAULT_SIZES})")
    parser.add_argument("--rounds", type=int, default=10, help="rounds per job (default: 10)")
    parser.add_argument("--trees", default="", help="comma-separated checkouts whose smddp the jobs import, "
                                                    "alternated (default: this one)")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="set in every job's environment (repeatable)")
    parser.add_argument("--json", metavar="FILE", help="write every job's figures and state to FILE")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not args.worker:  # a job imports the smddp of its tree (PYTHONPATH), whatever this file's is
        sys.path.insert(0, str(ROOT))
    from smddp.bench import format_size, parse_size

    sizes = [parse_size(s) for s in args.sizes.split(",")]
    if args.worker:
        worker(sizes, args.rounds, args.launcher)
        return 0
    trees = [Path(t).resolve() for t in args.trees.split(",") if t] or [ROOT]
    extra_env = dict(item.split("=", 1) for item in args.env)
    worker_args = ["--sizes", args.sizes, "--rounds", str(args.rounds)]
    runs: Dict[str, List[Dict]] = {str(t): [] for t in trees}
    for i in range(args.jobs):
        for tree in trees if i % 2 == 0 else trees[::-1]:
            load = _load()
            began = time.monotonic()
            job = run_job(args.launcher, args.np, worker_args, tree, extra_env)
            if Path(job["smddp"]).resolve() != tree:
                raise SystemExit(f"a job of tree {tree} imported smddp from {job['smddp']}")
            job["load"], job["wall_s"] = load, time.monotonic() - began
            runs[str(tree)].append(job)
            print(f"job {i + 1}/{args.jobs} ({tree.name or tree}): load {load}, "
                  + ", ".join(f"{format_size(n)} smddp {fmt_time(job['sizes'][str(n)]['median_s']['smddp'])} "
                              f"ref {fmt_time(job['sizes'][str(n)]['median_s']['ref'])}" for n in sizes),
                  file=sys.stderr, flush=True)
    summary = report(args.launcher, args.np, sizes, runs, args.rounds, argv, format_size)
    print(f"\n# load average after: {_load()}")
    if args.json:
        Path(args.json).write_text(json.dumps({"argv": argv, "launcher": args.launcher, "np": args.np,
                                               "summary": summary, "jobs": runs}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
