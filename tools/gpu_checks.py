"""The GPU checks of a lent device in one call: the GPU benchmarks, then the GPU tests, under one budget.

A lent GPU machine comes for minutes (docs/performance.md, "GPUs": 15 minutes of device time a
session, the machine's start included): everything it should run is here, in the order that
matters if time runs out, each step under its own time limit and all of them under one budget
(300 s by default, so that the run fits twice in a session), so that one call to the device does
the lot. Usage, from the repository root::

    python tools/gpu_checks.py --out "$OUT"                 # the device tool's folder; its timeout_s 330
    python tools/gpu_checks.py --out "$OUT" --base .base    # also another tree's benchmarks, alternated
    python tools/gpu_checks.py --steps machine,bench        # some steps only (they run in this order)

A base tree for ``--base`` (main, against a change) is a plain copy, not a git worktree (a nested
repository travels to the device without its files): ``mkdir .base && git archive main | tar -x -C
.base``, ``.base`` added to ``.git/info/exclude`` and named in the device call's ``carry``. Its
benchmarks must take ``--backend`` (this tool's own revision or later).

Steps:

- ``machine``: the GPU and driver (``nvidia-smi``), torch, CUDA, NCCL and CuPy, to name the
  machine beside the figures;
- ``install``: the README's offline install (``python -m pip install --no-index --no-deps
  --no-build-isolation -e .``), which also builds the shared-memory plane's core;
- ``bench``: ``benchmarks/gpu_allreduce.py`` (all_reduce at 1K, 1M, 64M and 1G, synchronous and
  ``async_op=True`` with ``wait()``, and the DDP step; 10 rounds) and ``benchmarks/gpu_call_cost.py``
  (the host's time per call; 5 rounds), each once per smddp route: ``--backend torch-nccl`` (the
  delegated route, smddp's default on CUDA: device tensors handed to torch's ProcessGroupNCCL) and
  ``--backend nccl`` (NCCL through CuPy), each beside torch's own NCCL group in the same rounds;
  this tree's and ``--base``'s jobs in turn (``PYTHONPATH``), ``--alternations`` times, no job
  started once ``--bench-budget`` is spent;
- ``host-cost``: ``benchmarks/nccl_host_cost.py`` (the host path on the NCCL stand-in) on the
  device's CPU;
- ``pytest``: ``tests/torch/test_delegated_gpu.py`` first (ordering and lifetime at world size 1,
  both routes beside torch's own group), then the rest of ``python -m pytest -m gpu``.

Each step, and each benchmark job, runs in a session of its own; one that runs past its limit (or
past the budget) is ended with its process group and every process below it (SIGTERM, then SIGKILL
to what is left 5 s later) and reported as exit 124, so a run ends at most about 10 s past its budget (a device
call's ``timeout_s`` of 330 leaves it room). A step that fails does not stop the next; the exit
status is then 1.

What comes back (the device tool brings back at most 8 files; this writes 6): a log per step
(``machine.txt``, ``install.log``, ``bench.log``, ``host-cost.log``, ``pytest-gpu.log``) and
``gpu-checks.json``: each step's exit status and time, the machine, pytest's summaries, the host
costs, and for every tree, route and measure the min, median and max of the within-round ratios
smddp / torch's own group, pooled over the alternations, with issue 51's bar where the benchmark
sets one (the delegated route: 1.02). The JSON is rewritten after every step, so a run cut short
leaves what it had; the same table ends the printed output.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

ROOT = Path(__file__).resolve().parent.parent
STEPS = ("machine", "install", "bench", "host-cost", "pytest")
ROUTES = ("torch-nccl", "nccl")
REPORT = "gpu-checks.json"
#: The GPU tests of ordering and lifetime, run before the rest of ``pytest -m gpu``.
FIRST_TESTS = "tests/torch/test_delegated_gpu.py"
#: Each benchmark: its script, its arguments, its time limit (seconds).
BENCHMARKS = (
    ("gpu_allreduce.py", ("--rounds", "10"), 120),
    ("gpu_call_cost.py", ("--rounds", "5"), 60),
)
GRACE = 5.0  # seconds a stopped step's processes get to end after SIGTERM, then after SIGKILL

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


# ---------------------------------------------------------------------------- processes
def descendants(pid: int) -> List[int]:
    """Every process below ``pid`` (children, their children, ...), read from /proc."""
    children: Dict[int, List[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    ppid = int(stat.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def stop(proc: subprocess.Popen) -> None:
    """End ``proc`` (started in a session of its own), its process group and every process below it,
    wherever they moved (mpirun puts its ranks in process groups of their own): SIGTERM, then SIGKILL to
    what is still there after :data:`GRACE` seconds; returns once they are gone (or GRACE after SIGKILL)."""
    below: List[int] = []
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if proc.poll() is None:  # once it is gone, its pid is no longer its own to look below
            below = sorted(set(below) | set(descendants(proc.pid)))
        below = [pid for pid in below if _alive(pid)]
        if sig == signal.SIGKILL and proc.poll() is not None and not below:
            return
        try:
            os.killpg(proc.pid, sig)  # the group keeps its id while a member lives
        except ProcessLookupError:
            pass
        for pid in below:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + GRACE
        while time.monotonic() < deadline and (proc.poll() is None or any(map(_alive, below))):
            time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


# ---------------------------------------------------------------------------- the run
class Run:
    """The steps' logs and ``gpu-checks.json``, under one deadline.

    Args:
        out: the folder the logs and the JSON go to.
        budget: seconds from now after which no step starts (and a running one is ended).
    """

    def __init__(self, out: Path, budget: float):
        self.out, self.budget, self.start = out, budget, time.monotonic()
        self.stop = self.start + budget
        self.lines: List[str] = []
        self.failed = False
        self.record: dict = {"budget_s": budget, "steps": [], "machine": [], "bench": [], "host_cost": {},
                             "pytest": [], "ratios": []}

    def left(self) -> float:
        """Seconds of the budget left."""
        return self.stop - time.monotonic()

    def call(self, name: str, log: str, argv: Sequence[str], limit: float, env: Optional[Dict[str, str]] = None,
             heading: str = "", cwd: Path = ROOT) -> Optional[int]:
        """Run ``argv`` in a session of its own, its output appended to ``log``, for at most ``limit``
        seconds (or what is left of the budget); None if the budget had no room for it."""
        limit = min(limit, self.left())
        if limit < 5:
            self._step(name, log, None, 0.0, "not run, the budget was spent")
            return None
        start = time.monotonic()
        with open(self.out / log, "a") as sink:
            command = " ".join(argv).replace("\n", "\\n")  # the versions' script on one line
            sink.write(f"== {heading or name}: {command}\n")
            sink.flush()
            try:
                proc = subprocess.Popen(list(argv), cwd=cwd, stdout=sink, stderr=subprocess.STDOUT,
                                        env={**os.environ, **(env or {})}, start_new_session=True)
            except OSError as exc:  # the program is not there (nvidia-smi on a CPU machine)
                rc = 127
                sink.write(f"{type(exc).__name__}: {exc}\n")
            else:
                try:
                    rc = proc.wait(timeout=limit)
                except subprocess.TimeoutExpired:
                    stop(proc)
                    rc = 124
                    sink.write(f"\n== stopped after {limit:.0f} s, with every process it started\n")
                except BaseException:  # Ctrl-C: the step's processes go too
                    stop(proc)
                    raise
        self._step(name, log, rc, time.monotonic() - start)
        return rc

    def skip(self, name: str, why: str) -> None:
        self._step(name, "", None, 0.0, f"not run, {why}")

    def _step(self, name: str, log: str, rc: Optional[int], took: float, note: str = "") -> None:
        self.failed |= rc not in (0, None)
        self.lines.append(f"{name}: {note}" if note else f"{name}: exit {rc} in {took:.0f} s ({log})")
        self.record["steps"].append({"step": name, "log": log, "exit": rc, "seconds": round(took, 1),
                                     **({"note": note} if note else {})})
        self.save()

    def save(self) -> None:
        self.record["ratios"] = pooled(self.record["bench"])
        self.record["took_s"] = round(time.monotonic() - self.start, 1)
        (self.out / REPORT).write_text(json.dumps(self.record, indent=1) + "\n")

    def summary(self) -> str:
        """What the run printed last: the steps, pytest's outcomes, the host costs' ratios, the ratio table."""
        lines = self.lines + [""]
        for part in self.record["pytest"]:
            lines += [f"pytest, {part['part']}: {part['summary']}"] + [f"  {p}" for p in part["problems"]]
        ratios = {k: v for k, v in self.record["host_cost"].items() if " / " in k}
        if ratios:
            lines.append("nccl_host_cost.py: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))
        return "\n".join(lines + [""] + ratio_table(self.record["ratios"])) + "\n"


# ---------------------------------------------------------------------------- the figures
def measures(kind: str, figures: dict) -> Dict[str, dict]:
    """``{measure: {"ratios": [...], "bar": ...}}`` from one benchmark job's ``--json``.

    Args:
        kind: ``"gpu_allreduce.py"`` or ``"gpu_call_cost.py"``.
        figures: what the job wrote (``summarize()``'s figures of that benchmark).
    """
    found: Dict[str, dict] = {}
    if kind == "gpu_allreduce.py":
        for size, entry in figures.get("all_reduce", {}).items():
            for call in ("sync", "async", "v1"):
                if call in entry:
                    found[f"all_reduce {size} {call}"] = {"ratios": entry[call]["ratios"], "bar": entry[call]["bar"]}
        if "ddp_step" in figures:
            found["DDP step"] = {"ratios": figures["ddp_step"]["ratios"], "bar": figures["ddp_step"]["bar"]}
    else:
        for name, entry in figures.get("collectives", {}).items():
            if "ratios" in entry:
                found[f"host: {name}"] = {"ratios": entry["ratios"], "bar": None}
    return found


def pooled(jobs: List[dict]) -> List[dict]:
    """Each tree's, route's and measure's within-round ratios over all its jobs: min, median, max."""
    pools: Dict[tuple, dict] = {}
    for job in jobs:
        for measure, entry in job["measures"].items():
            pool = pools.setdefault((job["tree"], job["route"], measure), {"ratios": [], "bar": entry["bar"]})
            pool["ratios"].extend(entry["ratios"])
    rows = []
    for (tree, route, measure), pool in pools.items():
        ratios, bar = pool["ratios"], pool["bar"]
        if not ratios:
            continue
        median = statistics.median(ratios)
        rows.append({"tree": tree, "route": route, "measure": measure, "n": len(ratios), "min": min(ratios),
                     "median": median, "max": max(ratios), "bar": bar,
                     "verdict": None if bar is None else ("PASS" if median <= bar else "MISS")})
    return rows


def ratio_table(rows: List[dict]) -> List[str]:
    if not rows:
        return ["no within-round ratios (no benchmark job completed)"]
    lines = ["within-round ratios, smddp / torch's own NCCL group (pooled over alternations)",
             f"{'tree':<10s} {'route':<11s} {'measure':<38s} {'n':>3s} {'min':>7s} {'median':>7s} {'max':>7s}  bar"]
    for row in rows:
        bar = f"{row['bar']:.2f} {row['verdict']}" if row["bar"] is not None else "-"
        lines.append(f"{row['tree']:<10s} {row['route']:<11s} {row['measure']:<38s} {row['n']:>3d} "
                     f"{row['min']:>7.3f} {row['median']:>7.3f} {row['max']:>7.3f}  {bar}")
    return lines


def host_costs(text: str) -> Dict[str, float]:
    """``nccl_host_cost.py``'s figures: ``HOSTCOST name us`` lines and its ``# a / b: Nx`` ratios."""
    found = {f"{m[1]} us": float(m[2]) for m in re.finditer(r"^HOSTCOST (\S+) ([\d.]+)", text, re.M)}
    found.update({f"{m[1]} / {m[2]}": float(m[3]) for m in re.finditer(r"^# (\S+) / (\S+): ([\d.]+)x", text, re.M)})
    return found


def pytest_outcome(text: str) -> dict:
    """pytest's last summary line and its FAILED/ERROR lines, from the part of the log it wrote."""
    finals = re.findall(r"^=+ (.+ in [\d.]+s.*?) =+$", text, re.M)
    problems = re.findall(r"^((?:FAILED|ERROR) \S+.*)$", text, re.M)
    return {"summary": finals[-1] if finals else "no summary (stopped?)", "problems": problems[:40]}


# ---------------------------------------------------------------------------- the steps
def machine(run: Run, py: str) -> None:
    run.call("machine: nvidia-smi", "machine.txt",
             ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"], 30)
    run.call("machine: versions", "machine.txt", [py, "-c", _VERSIONS], 60)
    log = run.out / "machine.txt"
    if log.exists():
        run.record["machine"] = [line for line in log.read_text().splitlines() if line and not line.startswith("== ")]
        run.save()


def bench(run: Run, py: str, trees: List[tuple], alternations: int, bench_budget: float) -> None:
    stop_at = time.monotonic() + bench_budget
    with tempfile.TemporaryDirectory(prefix="gpu-checks-") as scratch:
        for i in range(1, alternations + 1):
            for script, extra, limit in BENCHMARKS:
                for route in ROUTES:
                    for label, tree in trees:
                        name = f"{script} --backend {route}, {label}, {i}"
                        if time.monotonic() >= stop_at:
                            run.skip(name, "the bench budget was spent")
                            continue
                        figures = Path(scratch) / f"{script}-{route}-{label.replace(' ', '-')}-{i}.json"
                        argv = [py, str(tree / "benchmarks" / script), "--backend", route, *extra,
                                "--json", str(figures)]
                        rc = run.call(name, "bench.log", argv, limit, {"PYTHONPATH": str(tree)},
                                      f"{label} ({tree}), alternation {i}", cwd=tree)
                        if rc == 0 and figures.exists():
                            run.record["bench"].append({"tree": label, "route": route, "benchmark": script,
                                                        "alternation": i,
                                                        "measures": measures(script, json.loads(figures.read_text()))})
                            run.save()


def host_cost(run: Run, py: str) -> None:
    log = run.out / "host-cost.log"
    offset = log.stat().st_size if log.exists() else 0
    run.call("nccl_host_cost.py", "host-cost.log", [py, "benchmarks/nccl_host_cost.py", "--rounds", "10"], 90)
    if log.exists():
        run.record["host_cost"] = host_costs(log.read_text()[offset:])
        run.save()


def gpu_tests(run: Run, py: str) -> None:
    log = run.out / "pytest-gpu.log"
    common = [py, "-m", "pytest", "-m", "gpu", "-v", "-p", "no:cacheprovider"]
    for part, argv, limit in (
        (FIRST_TESTS, [*common, FIRST_TESTS], 150),
        ("the rest of pytest -m gpu", [*common, f"--ignore={FIRST_TESTS}"], 600),
    ):
        offset = log.stat().st_size if log.exists() else 0
        rc = run.call(f"pytest -m gpu: {part}", "pytest-gpu.log", argv, limit)
        if rc is not None:
            run.record["pytest"].append({"part": part, "exit": rc, **pytest_outcome(log.read_text()[offset:])})
            run.save()


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT") or "gpu-checks",
                        help="folder for the logs and gpu-checks.json (default: $OUT, else ./gpu-checks)")
    parser.add_argument("--base", help="another tree (a copy of main) whose benchmarks alternate with this one's")
    parser.add_argument("--steps", default=",".join(STEPS), help=f"comma-separated steps (default: {','.join(STEPS)})")
    parser.add_argument("--budget", type=float, default=300.0,
                        help="seconds after which no step starts and a running one is ended (default 300: "
                             "twice in a session's 15 minutes of device time)")
    parser.add_argument("--bench-budget", type=float, default=100.0,
                        help="seconds after which no benchmark job starts (default 100)")
    parser.add_argument("--alternations", type=int, default=1,
                        help="rounds of the benchmark jobs, each route and tree in turn (default 1)")
    args = parser.parse_args(argv)
    steps = [step.strip() for step in args.steps.split(",") if step.strip()]
    unknown = sorted(set(steps) - set(STEPS))
    if unknown:
        parser.error(f"unknown steps {', '.join(unknown)}; the steps are {', '.join(STEPS)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    run = Run(out, args.budget)
    py = sys.executable
    trees = [("this tree", ROOT)] + ([("base", Path(args.base).resolve())] if args.base else [])
    for step in STEPS:  # always in this order
        if step not in steps:
            continue
        if step == "machine":
            machine(run, py)
        elif step == "install":
            run.call("install", "install.log",
                     [py, "-m", "pip", "install", "--no-index", "--no-deps", "--no-build-isolation", "-e", "."], 120)
        elif step == "bench":
            bench(run, py, trees, args.alternations, args.bench_budget)
        elif step == "host-cost":
            host_cost(run, py)
        elif step == "pytest":
            gpu_tests(run, py)
    run.save()
    sys.stdout.write(run.summary())
    return 1 if run.failed else 0


if __name__ == "__main__":
    sys.exit(main())
