"""smddp's CPU all_reduce under each launcher, side by side in one run.

::

    python benchmarks/launchers_cpu.py                       # 2 ranks, 4K..64M, 3 rounds
    python benchmarks/launchers_cpu.py --np 2 --sizes 4K,16M --rounds 5 --json out.json

Every round starts one job per launcher, in an order that rotates every round:

- ``mpirun``: ``mpirun -np N python this.py --worker`` (the ``mpi`` backend);
- ``torchrun``: ``torchrun --standalone --nproc-per-node N`` (the ``gloo`` backend beneath);
- ``smddprun-local``: ``smddprun --launcher local -np N`` (smddprun starting the ranks itself);
- ``torchrun-gloo``: torchrun with ``SMDDP_CPU_PLANE=gloo``: every collective through gloo, as
  smddp ran under torchrun before its shared-memory plane met its ranks through the store.

Each job's ranks call ``smddp.torch.distributed.all_reduce`` on float32 (SUM, in place), time
every call, and report the median per size on the slowest rank, with the CPU plane they took.
The table shows each launcher's median over rounds and its time relative to mpirun's, paired
within a round (load that drifts between rounds cancels out). The issue's goal: torchrun and
the local launcher within 1.2x of mpirun at every size.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from typing import Dict, List, Optional

HERE = Path(__file__).resolve()
ROOT = HERE.parent.parent
DEFAULT_SIZES = "4K,64K,1M,16M,64M"
LAUNCHERS = ("mpirun", "torchrun", "smddprun-local", "torchrun-gloo")


def _iters(nbytes: int) -> int:
    return 200 if nbytes <= 64 << 10 else 50 if nbytes <= 1 << 20 else 10 if nbytes <= 16 << 20 else 5


def worker(sizes: List[int]) -> None:
    """Run inside a job: time the all-reduces; rank 0 prints ``RESULT <json>``."""
    import torch

    import smddp.torch.distributed as dist
    from smddp.torch import groups

    dist.init_process_group()
    rank, size = dist.get_rank(), dist.get_world_size()
    medians = {}
    for nbytes in sizes:
        tensor = torch.ones(nbytes // 4)
        for _ in range(3):  # warm up: first touches of the buffers, the plane's caches
            dist.all_reduce(tensor)
        tensor.fill_(1.0)
        dist.all_reduce(tensor)
        if float(tensor[0]) != size:
            raise RuntimeError(f"all_reduce of {nbytes} bytes gave {float(tensor[0])}, expected {size}")
        dist.barrier()
        samples = []
        for _ in range(_iters(nbytes)):
            start = time.perf_counter()
            dist.all_reduce(tensor)
            samples.append(time.perf_counter() - start)
        slowest = torch.tensor([statistics.median(samples)], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        medians[str(nbytes)] = float(slowest)
    comm = groups.current().engine.comms["cpu"]
    if rank == 0:
        print("RESULT " + json.dumps({"medians": medians, "backend": comm.name, "plane": comm.plane}), flush=True)
    dist.destroy_process_group()


def _command(launcher: str, np: int, sizes: str) -> List[str]:
    me = [str(HERE), "--worker", "--sizes", sizes]
    if launcher == "mpirun":
        mpirun = Path(sysconfig.get_path("scripts")) / "mpirun"
        mpirun = str(mpirun) if mpirun.exists() else shutil.which("mpirun")
        if mpirun is None:
            raise SystemExit("mpirun not found: pip install 'smddp[mpi]'")
        return [mpirun, "-np", str(np), "--oversubscribe", "-x", "PYTHONPATH", "-x", "OMP_NUM_THREADS",
                sys.executable, *me]
    if launcher.startswith("torchrun"):
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(np), *me]
    return [sys.executable, "-m", "smddp.launch", "--launcher", "local", "-np", str(np), *me]


def run_worker(name: str, command: List[str], tree: Path = ROOT, extra_env: Optional[Dict[str, str]] = None) -> Dict:
    """Run one job of a benchmark's workers (``command``), importing ``tree``'s smddp; its RESULT line, parsed.

    Also used by allreduce_jobs.py. Raises RuntimeError with the job's output tail if no rank printed one.
    """
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")])),
               **(extra_env or {}))
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900, cwd=str(tree))
    for line in done.stdout.splitlines():
        head, _, body = line.partition("RESULT ")
        if body and ("]" in head or not head.strip()):
            return json.loads(body)
    raise RuntimeError(f"{name} job failed (exit {done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")


def run_job(launcher: str, np: int, sizes: str) -> Dict:
    extra = {"SMDDP_CPU_PLANE": "gloo"} if launcher == "torchrun-gloo" else None
    return run_worker(launcher, _command(launcher, np, sizes), extra_env=extra)


def fmt_time(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.1f} us"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--np", type=int, default=2, help="ranks per job (default: 2)")
    parser.add_argument("--sizes", default=DEFAULT_SIZES, help=f"message sizes (default: {DEFAULT_SIZES})")
    parser.add_argument("--rounds", type=int, default=3, help="rounds; each starts one job per launcher (default: 3)")
    parser.add_argument("--launchers", default=",".join(LAUNCHERS),
                        help=f"comma-separated subset of {', '.join(LAUNCHERS)} (mpirun is the reference)")
    parser.add_argument("--json", metavar="FILE", help="write medians and ratios to FILE")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from smddp.bench import format_size, parse_size

    sizes = [parse_size(s) for s in args.sizes.split(",")]
    if args.worker:
        worker(sizes)
        return 0
    launchers = [name for name in args.launchers.split(",") if name]
    unknown = set(launchers) - set(LAUNCHERS)
    if unknown or "mpirun" not in launchers:
        parser.error(f"--launchers takes {', '.join(LAUNCHERS)} and must include mpirun; got {args.launchers}")
    results: Dict[str, List[Dict]] = {name: [] for name in launchers}
    for r in range(args.rounds):
        order = launchers[r % len(launchers):] + launchers[:r % len(launchers)]
        for name in order:
            results[name].append(run_job(name, args.np, args.sizes))
            print(f"round {r + 1}/{args.rounds}: {name} done", file=sys.stderr, flush=True)
    print(f"# smddp.torch.distributed.all_reduce under each launcher: float32 SUM in place, {args.np} ranks")
    print(f"# command:  python benchmarks/launchers_cpu.py {' '.join(argv if argv is not None else sys.argv[1:])}")
    print(f"# machine:  {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, {platform.system()} "
          f"{platform.release()}")
    print(f"# figures:  median over {args.rounds} rounds of the slowest rank's median call; ratios to mpirun "
          f"paired within each round")
    print("# planes:   " + ", ".join(f"{name}: {results[name][0]['backend']}/{results[name][0]['plane']}"
                                    for name in launchers))
    header = f"{'size':<7}" + "".join(f"{name:>18}" for name in launchers)
    header += "".join(f"{name + '/mpirun':>22}" for name in launchers if name != "mpirun")
    print(header)
    summary = {}
    for nbytes in sizes:
        key = str(nbytes)
        med = {name: statistics.median(job["medians"][key] for job in results[name]) for name in launchers}
        ratio = {name: statistics.median(results[name][i]["medians"][key] / results["mpirun"][i]["medians"][key]
                                         for i in range(args.rounds)) for name in launchers if name != "mpirun"}
        line = f"{format_size(nbytes):<7}" + "".join(f"{fmt_time(med[name]):>18}" for name in launchers)
        line += "".join(f"{ratio[name]:>21.2f}x" for name in ratio)
        print(line)
        summary[key] = {"median_seconds": med, "ratio_to_mpirun": ratio}
    if args.json:
        Path(args.json).write_text(json.dumps({"np": args.np, "rounds": args.rounds, "sizes": summary}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
