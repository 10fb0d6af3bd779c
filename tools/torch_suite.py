"""Run torch's own distributed test suite against the smddp backend and against gloo.

torch ships its suite in the wheel (``torch/testing/_internal/distributed/distributed_test.py``,
``DistributedTest._DistTestBase`` run by ``TestDistBackend``). It gates many tests on the
backend's name (``DistTestCases.backend_feature``, and checks of ``BACKEND`` when it defines the
tests); smddp is judged as gloo's peer (see :func:`_prepare_torch_suite`). Each test starts ``WORLD_SIZE`` processes
(forked, as torch's old ``test_distributed_fork`` did: spawning re-imports torch per rank).

Usage::

    python tools/torch_suite.py                       # the whole suite, both backends, 2 ranks
    python tools/torch_suite.py -k all_reduce -k barrier --json /tmp/r.json
    python tools/torch_suite.py --world-size 2 --world-size 3 --mpi-peer all_to_all \\
        --markdown docs/torch-suite.md                # the page in the docs

Each backend runs in a subprocess of its own (``--worker``), which writes one JSON record per
test. The parent compares them: a test that gloo passes and smddp does not is a regression,
unless :data:`CANNOT_PASS` gives the reason smddp legitimately cannot pass it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import unittest
from pathlib import Path
from typing import Dict, List, Optional, Sequence

_MONITORED = ("torch.distributed.monitored_barrier raises ValueError for every backend not named gloo "
              "(torch checks the name before it calls the group)")
#: Tests gloo passes that smddp legitimately cannot, with the reason. They are not run on smddp
#: (recorded as skipped, with the reason) and the docs table lists them.
CANNOT_PASS: Dict[str, str] = {
    "test_monitored_barrier_gloo": _MONITORED,
    "test_monitored_barrier_gloo_subgroup": _MONITORED,
    "test_monitored_barrier_gloo_rank_0_timeout": (
        "calls the group's own monitored_barrier method, which torch dispatches to the group's "
        "torch-native gloo backend; that backend connects on first use and rank 1 never uses it, so "
        "rank 0 may wait for the connection instead of timing out at once (passes or hangs by timing)"),
}

#: Tests whose body picks its model by the backend's name (``if BACKEND == "mpi" or BACKEND ==
#: "gloo"``) and has no path for any other name. On smddp their body reads ``BACKEND`` as gloo
#: (in the rank processes, after smddp's world is up), so they run the CPU path on smddp's group.
BODY_AS_GLOO = frozenset({
    "test_accumulate_gradients_no_sync",
    "test_accumulate_gradients_no_sync_allreduce_hook",
    "test_accumulate_gradients_no_sync_allreduce_with_then_hook",
    "test_accumulate_gradients_no_sync_grad_is_view",
})

OUTCOMES = ("passed", "failed", "error", "skipped")


# ---------------------------------------------------------------------------- worker
def _prepare_torch_suite(backend: str, gates: str):
    """Import torch's suite with ``backend`` judged as gloo's peer; return its test class.

    ``gates="features"``: smddp is added wherever gloo is in ``DistTestCases.backend_feature``.
    ``gates="gloo"`` (also): the suite is imported as if ``BACKEND`` were gloo, so the tests that
    torch gates on the name gloo when it defines them (``require_backend_is_available({"gloo"})``,
    ``BACKEND not in ("mpi", "nccl", "gloo")``) run on smddp too; inside the tests ``BACKEND`` is
    smddp, so run-time checks of the name still take the non-gloo path.
    ``gates="mpi"``: the same as MPI's peer (torch runs its CPU ``all_to_all`` tests on MPI only).
    """
    if backend == "smddp":
        import smddp.torch.torch_smddp  # noqa: F401 - registers the "smddp" backend with torch

    from torch.testing._internal import common_distributed

    features = common_distributed.DistTestCases.backend_feature
    if backend == "smddp":
        for backends in features.values():
            if "gloo" in backends:
                backends.add("smddp")
        features["plugin"].add("smddp")
        if gates in ("gloo", "mpi"):
            os.environ["BACKEND"] = gates

    import torch.multiprocessing
    from torch.testing._internal.distributed import distributed_test as suite

    suite.BACKEND = os.environ["BACKEND"] = backend

    class TorchSuite(suite.TestDistBackend, suite.DistributedTest._DistTestBase):
        def setUp(self):
            super().setUp()
            self._start_processes(torch.multiprocessing.get_context("fork").Process)

        def run_test(self, test_name, parent_pipe):
            # In a rank's process, after init_process_group: see BODY_AS_GLOO.
            if backend == "smddp" and test_name in BODY_AS_GLOO:
                suite.BACKEND = "gloo"
            super().run_test(test_name, parent_pipe)

    TorchSuite.__module__ = __name__
    TorchSuite.__qualname__ = TorchSuite.__name__ = "TorchSuite"
    globals()["TorchSuite"] = TorchSuite
    return TorchSuite


def _select(cls, patterns: Sequence[str], names: Sequence[str], exclude: Sequence[str] = ()) -> List[str]:
    found = sorted(n for n in dir(cls) if n.startswith("test_"))
    if names:
        wanted = set(names)
        return [n for n in found if n in wanted]
    if patterns:
        found = [n for n in found if any(re.search(p, n) for p in patterns)]
    return [n for n in found if not any(re.search(p, n) for p in exclude)]


class _Recorder(unittest.TestResult):
    """Records one outcome per test, and flushes each to ``out`` as it ends."""

    def __init__(self, out):
        super().__init__()
        self._out = out
        self._started = 0.0

    def _record(self, test, outcome: str, detail: str = "") -> None:
        name = test.id().rsplit(".", 1)[-1]
        record = {"test": name, "outcome": outcome, "detail": detail[-2000:],
                  "seconds": round(time.monotonic() - self._started, 2)}
        self._out.write(json.dumps(record) + "\n")
        self._out.flush()
        print(f"{outcome:8s} {record['seconds']:7.2f}s {name}", file=sys.stderr, flush=True)

    def startTest(self, test):  # noqa: N802 - unittest's name
        super().startTest(test)
        self._started = time.monotonic()

    def addSuccess(self, test):  # noqa: N802
        self._record(test, "passed")

    def addFailure(self, test, err):  # noqa: N802
        self._record(test, "failed", self._exc_info_to_string(err, test))

    def addError(self, test, err):  # noqa: N802
        self._record(test, "error", self._exc_info_to_string(err, test))

    def addSkip(self, test, reason):  # noqa: N802
        self._record(test, "skipped", str(reason))

    def addExpectedFailure(self, test, err):  # noqa: N802
        self._record(test, "passed", "expected failure")

    def addUnexpectedSuccess(self, test):  # noqa: N802
        self._record(test, "failed", "unexpected success")


def _worker(args) -> int:
    os.environ["BACKEND"] = args.backend
    os.environ["WORLD_SIZE"] = str(args.world_size)
    os.environ.setdefault("DISTRIBUTED_TESTS_DEFAULT_TIMEOUT", str(args.test_timeout))
    temp = tempfile.mkdtemp(prefix=f"torch-suite-{args.backend}-")
    os.environ["TEMP_DIR"] = temp
    # Both backends run the same way: no launcher variables leak in from a surrounding job.
    for key in [k for k in os.environ if k.startswith(("OMPI_", "PMI_", "PMIX_", "SLURM_"))]:
        del os.environ[key]
    cls = _prepare_torch_suite(args.backend, args.gates)
    names = _select(cls, args.k, args.test, args.exclude)
    try:
        with open(args.worker, "a") as out:
            recorder = _Recorder(out)
            if args.backend == "smddp":
                for name in [n for n in names if n in CANNOT_PASS]:
                    recorder._started = time.monotonic()
                    recorder._record(cls(name), "skipped", f"cannot pass on smddp: {CANNOT_PASS[name]}")
                names = [n for n in names if n not in CANNOT_PASS]
            unittest.TestSuite(cls(n) for n in names).run(recorder)
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    return 0


# ---------------------------------------------------------------------------- parent
def run_backend(backend: str, patterns: Sequence[str], names: Sequence[str], world_size: int,
                test_timeout: int, log: Optional[Path] = None, gates: str = "gloo",
                exclude: Sequence[str] = ()) -> Dict[str, dict]:
    """Run the selected tests of torch's suite on ``backend`` in a subprocess.

    Args:
        backend: ``"gloo"`` or ``"smddp"``.
        patterns: regular expressions; a test runs when its name matches one (none: all).
        names: exact test names (overrides ``patterns``).
        world_size: processes per test.
        test_timeout: seconds torch's harness gives each test.
        log: where the worker's progress lines go (None: inherited stderr).
        gates: how smddp passes torch's backend-name gates (see :func:`_prepare_torch_suite`).
        exclude: regular expressions; a test whose name matches one does not run.

    Returns:
        test name to its record (``outcome``, ``detail``, ``seconds``).
    """
    with tempfile.NamedTemporaryFile("r", suffix=".jsonl", delete=False) as handle:
        path = handle.name
    cmd = [sys.executable, __file__, "--worker", path, "--backend", backend, "--world-size", str(world_size),
           "--test-timeout", str(test_timeout), "--gates", gates]
    for p in patterns:
        cmd += ["-k", p]
    for n in names:
        cmd += ["--test", n]
    for x in exclude:
        cmd += ["--exclude", x]
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    stderr = open(log, "w") if log is not None else None
    try:
        subprocess.run(cmd, env=env, stderr=stderr, stdout=stderr, check=False)
    finally:
        if stderr is not None:
            stderr.close()
    records = {}
    with open(path) as handle:
        for line in handle:
            record = json.loads(line)
            records[record["test"]] = record
    os.unlink(path)
    return records


def counts(records: Dict[str, dict]) -> Dict[str, int]:
    """How many tests ended in each outcome."""
    out = {o: 0 for o in OUTCOMES}
    for record in records.values():
        out[record["outcome"]] += 1
    return out


def regressions(gloo: Dict[str, dict], smddp: Dict[str, dict]) -> List[str]:
    """Tests gloo passes and smddp does not, less those in :data:`CANNOT_PASS`."""
    return sorted(name for name, record in gloo.items()
                  if record["outcome"] == "passed"
                  and smddp.get(name, {}).get("outcome") != "passed"
                  and name not in CANNOT_PASS)


_INTRO = """\
# torch's distributed test suite on smddp

torch ships its own distributed test suite in the wheel
(`torch/testing/_internal/distributed/distributed_test.py`, `DistributedTest._DistTestBase` run by
`TestDistBackend`). `tools/torch_suite.py` runs it on gloo and on smddp, one process per rank,
and judges smddp as gloo's peer: `"smddp"` is added wherever `"gloo"` appears in
`DistTestCases.backend_feature`, and the suite is imported as if its `BACKEND` were gloo, so the
tests torch gates on the name gloo when it defines them run on smddp too. Inside each test
`BACKEND` is `"smddp"`, so checks of the name in a test's body take the non-gloo path, except in
the few tests whose body has no path for another name (they pick their DDP model by the name);
those read `BACKEND` as gloo inside the rank processes, after smddp's world is up. Tests smddp
legitimately cannot pass are not run on smddp: they are counted as skipped and listed below with
the reason.
`tests/torch/test_torch_suite.py` runs a subset of it in CI and fails when smddp does not pass a test
that gloo passes.

Most skipped tests need CUDA devices, NCCL or MPI by name, or a larger world; they skip on both
backends alike.
"""


def _section(gloo: Dict[str, dict], smddp: Dict[str, dict], world_size: int) -> List[str]:
    g, s = counts(gloo), counts(smddp)
    lines = [
        f"## {world_size} ranks per test",
        "",
        "| backend | tests | passed | failed | errors | skipped |",
        "|---|---|---|---|---|---|",
        f"| gloo | {len(gloo)} | {g['passed']} | {g['failed']} | {g['error']} | {g['skipped']} |",
        f"| smddp | {len(smddp)} | {s['passed']} | {s['failed']} | {s['error']} | {s['skipped']} |",
        "",
    ]
    lost = sorted(n for n, r in gloo.items()
                  if r["outcome"] == "passed" and smddp.get(n, {}).get("outcome") != "passed")
    gained = sorted(n for n, r in smddp.items()
                    if r["outcome"] == "passed" and gloo.get(n, {}).get("outcome") != "passed")
    lines += ["Tests gloo passes that smddp does not:", ""]
    if not lost:
        lines += ["None.", ""]
    else:
        lines += ["| test | smddp | reason |", "|---|---|---|"]
        for name in lost:
            reason = CANNOT_PASS.get(name, "not yet understood")
            lines.append(f"| `{name}` | {smddp.get(name, {}).get('outcome', 'not run')} | {reason} |")
        lines.append("")
    lines += ["Tests smddp passes that gloo does not:", ""]
    if not gained:
        lines += ["None.", ""]
    else:
        lines += [", ".join(f"`{name}`" for name in gained), ""]
    return lines


def markdown(results: Dict[str, Dict[str, Dict[str, dict]]], command: str,
             mpi_peer: Optional[Dict[str, dict]] = None) -> str:
    """The comparison as a Markdown page.

    Args:
        results: world size (as a string) to backend to test records.
        command: the command that produced them.
        mpi_peer: smddp's records as MPI's peer (``--gates mpi``), if run.
    """
    lines = [_INTRO, f"Produced by `{command}` on CPU.", ""]
    for world_size in sorted(results, key=int):
        lines += _section(results[world_size]["gloo"], results[world_size]["smddp"], int(world_size))
    if mpi_peer:
        passed = sorted(n for n, r in mpi_peer.items() if r["outcome"] == "passed")
        bad = sorted(n for n, r in mpi_peer.items() if r["outcome"] in ("failed", "error"))
        lines += [
            "## As MPI's peer",
            "",
            "torch runs its CPU `all_to_all` tests on MPI only. Imported as if `BACKEND` were mpi "
            "(`--gates mpi`, 2 ranks), smddp runs them on its own communicators:",
            "",
            f"{len(mpi_peer)} tests, {len(passed)} passed, {len(bad)} failed or errors: "
            + ", ".join(f"`{name}`" for name in passed) + ".",
            "",
        ]
    return "\n".join(lines)


def _report(backend: str, records: Dict[str, dict], seconds: float, world_size: int) -> None:
    c = counts(records)
    print(f"{backend} ({world_size} ranks): {len(records)} tests, {c['passed']} passed, {c['failed']} failed, "
          f"{c['error']} errors, {c['skipped']} skipped ({seconds:.0f} s)", flush=True)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-k", action="append", default=[], metavar="REGEX",
                        help="run the tests whose name matches REGEX (repeatable; default: all)")
    parser.add_argument("--exclude", action="append", default=[], metavar="REGEX",
                        help="skip the tests whose name matches REGEX (repeatable)")
    parser.add_argument("--test", action="append", default=[], help="run this exact test (repeatable)")
    parser.add_argument("--backend", action="append", default=None, choices=("gloo", "smddp"),
                        help="backends to run (repeatable; default: gloo and smddp)")
    parser.add_argument("--world-size", type=int, action="append", default=None,
                        help="processes per test (repeatable; default 2)")
    parser.add_argument("--test-timeout", type=int, default=120,
                        help="seconds torch's harness gives each test (default 120)")
    parser.add_argument("--gates", choices=("gloo", "mpi", "features"), default="gloo",
                        help="smddp passes torch's backend-name gates as gloo does (default), as MPI "
                             "does, or only those in DistTestCases.backend_feature")
    parser.add_argument("--mpi-peer", action="append", default=[], metavar="REGEX",
                        help="also run the tests matching REGEX on smddp as MPI's peer (--gates mpi, 2 ranks)")
    parser.add_argument("--json", type=Path, help="write every run's records here")
    parser.add_argument("--markdown", type=Path, help="write the comparison page here")
    parser.add_argument("--log-dir", type=Path, help="write each run's progress log here")
    parser.add_argument("--reuse", type=Path, metavar="JSON",
                        help="take the records of runs not made now from this earlier --json output")
    parser.add_argument("--render-only", action="store_true",
                        help="run nothing: write --markdown from the --reuse records (the command shown "
                             "is then --command's)")
    parser.add_argument("--command", help="the command to name on the page (with --render-only)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        args.backend = args.backend[0]
        args.world_size = args.world_size[0]
        return _worker(args)
    backends = args.backend or ["gloo", "smddp"]
    world_sizes = args.world_size or [2]
    saved = json.loads(args.reuse.read_text()) if args.reuse else {}
    results: Dict[str, Dict[str, Dict[str, dict]]] = saved.get("runs", {})
    if args.log_dir:
        args.log_dir.mkdir(parents=True, exist_ok=True)
    for world_size in [] if args.render_only else world_sizes:
        runs = results.setdefault(str(world_size), {})
        for backend in backends:
            log = args.log_dir / f"{backend}-{world_size}.log" if args.log_dir else None
            started = time.monotonic()
            runs[backend] = run_backend(backend, args.k, args.test, world_size, args.test_timeout, log,
                                        args.gates, args.exclude)
            _report(backend, runs[backend], time.monotonic() - started, world_size)
    mpi_peer = saved.get("mpi_peer")
    if args.mpi_peer and not args.render_only:
        log = args.log_dir / "smddp-mpi-peer.log" if args.log_dir else None
        started = time.monotonic()
        mpi_peer = run_backend("smddp", args.mpi_peer, [], 2, args.test_timeout, log, "mpi", args.exclude)
        _report("smddp as MPI's peer", mpi_peer, time.monotonic() - started, 2)
    if args.json:
        args.json.write_text(json.dumps({"runs": results, "mpi_peer": mpi_peer}, indent=1))
    lost_any = False
    for world_size, runs in sorted(results.items()):
        if "gloo" in runs and "smddp" in runs:
            lost = regressions(runs["gloo"], runs["smddp"])
            lost_any = lost_any or bool(lost)
            print(f"{world_size} ranks: gloo passes and smddp does not ({len(lost)}): {' '.join(lost) or 'none'}")
    if args.markdown and all("gloo" in r and "smddp" in r for r in results.values()):
        ran = "python tools/torch_suite.py " + " ".join(argv if argv is not None else sys.argv[1:])
        command = args.command or ran
        args.markdown.write_text(markdown(results, command.strip(), mpi_peer))
    return 1 if lost_any else 0


if __name__ == "__main__":
    sys.exit(main())
