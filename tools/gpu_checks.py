"""The GPU checks of a lent device in one call: the GPU tests, then the GPU benchmarks, logs in one folder.

A lent GPU machine comes for minutes (docs/performance.md, "GPUs"): everything it should run is
here, in the order that matters if time runs out, each step under its own time limit and all of
them under one budget, so that one call to the device does the lot. Usage, from the repository
root::

    python tools/gpu_checks.py --out "$OUT"                 # the device tool's folder
    python tools/gpu_checks.py --out "$OUT" --base base     # also another tree's benchmarks, alternated
    python tools/gpu_checks.py --steps machine,host-cost    # some steps only (they run in this order)

A base tree for ``--base`` (main, against a change) is a plain copy, not a git worktree (a nested
repository travels to the device without its files): ``mkdir .base && git archive main | tar -x -C
.base``, ``.base`` added to ``.git/info/exclude`` and named in the device call's ``carry``.

Steps:

- ``machine``: the GPU, driver and versions (``nvidia-smi``, torch, CuPy, NCCL), to name the
  machine beside the figures;
- ``install``: the README's offline install (``python -m pip install --no-index --no-deps
  --no-build-isolation -e .``), which also builds the shared-memory plane's core;
- ``pytest``: ``python -m pytest -m gpu`` (about 3 minutes on one H100);
- ``bench``: rounds of ``benchmarks/gpu_call_cost.py`` (the host's time per CUDA primitive and
  per collective) and ``benchmarks/gpu_allreduce.py --rounds 6`` (smddp's ``nccl`` beside torch's
  NCCL group through ``torch.distributed``, synchronous, asynchronous with ``wait()``, the DDP
  step), this tree and ``--base``'s in turn (``PYTHONPATH``), ``--alternations`` times or until
  the budget is spent;
- ``host-cost``: ``benchmarks/nccl_host_cost.py`` (the host path on the NCCL stand-in), on the
  device's CPU, for the CPU figures' sake.

Each step writes its own log (``machine.txt``, ``install.log``, ``pytest-gpu.log``,
``call-cost.log``, ``allreduce.log``, ``host-cost.log``; at most 8 files, as the device tool
brings back) and ``summary.txt`` says what each step returned and how long it took. A step that
fails does not stop the next: the summary says so, and the exit status is 1.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

ROOT = Path(__file__).resolve().parent.parent
STEPS = ("machine", "install", "pytest", "bench", "host-cost")

_VERSIONS = (
    "import platform, torch\n"
    "print('python', platform.python_version(), 'torch', torch.__version__, 'cuda', torch.version.cuda)\n"
    "print('gpu', torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none')\n"
    "print('torch nccl', torch.cuda.nccl.version() if torch.cuda.is_available() else 'none')\n"
    "try:\n"
    "    import cupy\n"
    "    from cupy.cuda import nccl\n"
    "    print('cupy', cupy.__version__, 'nccl', nccl.get_version())\n"
    "except Exception as exc:\n"
    "    print('cupy: not usable:', type(exc).__name__, exc)\n"
)


class Run:
    """The steps' logs and their summary, under one deadline.

    Args:
        out: the folder the logs go to.
        budget: seconds from now after which no step starts.
    """

    def __init__(self, out: Path, budget: float):
        self.out, self.stop = out, time.monotonic() + budget
        self.lines: List[str] = []
        self.failed = False

    def left(self) -> float:
        """Seconds of the budget left."""
        return self.stop - time.monotonic()

    def call(self, name: str, log: str, argv: Sequence[str], limit: float,
             env: Optional[Dict[str, str]] = None, heading: str = "") -> Optional[int]:
        """Run ``argv`` from the repository root, its output appended to ``log``, for at most ``limit``
        seconds (or what is left of the budget); None if the budget had no room for it."""
        limit = min(limit, self.left())
        if limit < 5:
            self.lines.append(f"{name}: not run, the budget was spent")
            return None
        start = time.monotonic()
        with open(self.out / log, "a") as sink:
            sink.write(f"== {heading or name}: {' '.join(argv)}\n")
            sink.flush()
            try:
                rc = subprocess.run(list(argv), cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT,
                                    env={**os.environ, **(env or {})}, timeout=limit).returncode
            except subprocess.TimeoutExpired:
                rc = 124
                sink.write(f"\n== stopped after {limit:.0f} s\n")
            except OSError as exc:  # the program is not there (nvidia-smi on a CPU machine)
                rc = 127
                sink.write(f"{type(exc).__name__}: {exc}\n")
        took = time.monotonic() - start
        self.failed |= rc != 0
        self.lines.append(f"{name}: exit {rc} in {took:.0f} s ({log})")
        return rc

    def summary(self) -> str:
        text = "\n".join(self.lines) + "\n"
        (self.out / "summary.txt").write_text(text)
        return text


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT") or "gpu-checks",
                        help="folder for the logs (default: $OUT, else ./gpu-checks)")
    parser.add_argument("--base", help="another tree (a copy of main) whose benchmarks alternate with this one's")
    parser.add_argument("--steps", default=",".join(STEPS), help=f"comma-separated steps (default: {','.join(STEPS)})")
    parser.add_argument("--budget", type=float, default=480.0,
                        help="seconds after which no step starts (default 480: a device call may run 600)")
    parser.add_argument("--alternations", type=int, default=3,
                        help="rounds of the benchmarks, each tree in turn (default 3)")
    args = parser.parse_args(argv)
    steps = [step.strip() for step in args.steps.split(",") if step.strip()]
    unknown = sorted(set(steps) - set(STEPS))
    if unknown:
        parser.error(f"unknown steps {', '.join(unknown)}; the steps are {', '.join(STEPS)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    run = Run(out, args.budget)
    py = sys.executable
    for step in STEPS:  # always in this order
        if step not in steps:
            continue
        if step == "machine":
            run.call("machine: nvidia-smi", "machine.txt", ["nvidia-smi"], 30)
            run.call("machine: versions", "machine.txt", [py, "-c", _VERSIONS], 60)
        elif step == "install":
            run.call("install", "install.log",
                     [py, "-m", "pip", "install", "--no-index", "--no-deps", "--no-build-isolation", "-e", "."], 180)
        elif step == "pytest":
            run.call("pytest -m gpu", "pytest-gpu.log",
                     [py, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider"], 300)
        elif step == "bench":
            trees = [("this tree", str(ROOT))] + ([("base", str(Path(args.base).resolve()))] if args.base else [])
            for i in range(1, args.alternations + 1):
                for label, tree in trees:
                    env = {"PYTHONPATH": tree}
                    heading = f"{label} ({tree}), alternation {i}"
                    run.call(f"gpu_call_cost.py, {label}, {i}", "call-cost.log",
                             [py, os.path.join(tree, "benchmarks", "gpu_call_cost.py")], 90, env, heading)
                    bench = os.path.join(tree, "benchmarks")
                    run.call(f"gpu_allreduce.py, {label}, {i}", "allreduce.log",
                             [py, os.path.join(bench, "gpu_allreduce.py"), "--rounds", "6"], 150, env, heading)
        elif step == "host-cost":
            run.call("nccl_host_cost.py", "host-cost.log", [py, "benchmarks/nccl_host_cost.py", "--rounds", "10"], 90)
    sys.stdout.write(run.summary())
    return 1 if run.failed else 0


if __name__ == "__main__":
    sys.exit(main())
