"""Run torch's own distributed test suite against the smddp backend and against gloo.

torch ships its suite in the wheel (``torch/testing/_internal/distributed/distributed_test.py``,
``DistributedTest._DistTestBase`` run by ``TestDistBackend``). It gates many tests on the
backend's name through ``DistTestCases.backend_feature``; smddp is added wherever gloo is there
(and as a plugin), so smddp is judged as gloo's peer. Each test starts ``WORLD_SIZE`` processes
(forked, as torch's old ``test_distributed_fork`` did: spawning re-imports torch per rank).

Usage::

    python tools/torch_suite.py                       # the whole suite, both backends
    python tools/torch_suite.py -k all_reduce -k barrier --json /tmp/r.json
    python tools/torch_suite.py --markdown docs/torch-suite.md

Each backend runs in a subprocess of its own (``--worker``), which writes one JSON record per
test. The parent compares them: a test that gloo passes and smddp does not is a regression,
unless :data:`CANNOT_PASS` gives the reason smddp legitimately cannot pass it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import unittest
from pathlib import Path
from typing import Dict, List, Optional, Sequence

_NAMED_MODEL = ("the test builds its DDP model only when BACKEND is named mpi or gloo (a check of the "
                "name inside the test body), so under any other name it fails before it communicates")
_MONITORED = ("torch.distributed.monitored_barrier raises ValueError for every backend not named gloo "
              "(torch checks the name before it calls the group)")
#: Tests gloo passes that smddp legitimately cannot, with the reason (shown in the docs table).
CANNOT_PASS: Dict[str, str] = {
    "test_accumulate_gradients_no_sync": _NAMED_MODEL,
    "test_accumulate_gradients_no_sync_allreduce_hook": _NAMED_MODEL,
    "test_accumulate_gradients_no_sync_allreduce_with_then_hook": _NAMED_MODEL,
    "test_accumulate_gradients_no_sync_grad_is_view": _NAMED_MODEL,
    "test_monitored_barrier_gloo": _MONITORED,
    "test_monitored_barrier_gloo_subgroup": _MONITORED,
}

OUTCOMES = ("passed", "failed", "error", "skipped")


# ---------------------------------------------------------------------------- worker
def _prepare_torch_suite(backend: str, gates: str):
    """Import torch's suite with ``backend`` judged as gloo's peer; return its test class.

    ``gates="features"``: smddp is added wherever gloo is in ``DistTestCases.backend_feature``.
    ``gates="gloo"`` (also): the suite is imported as if ``BACKEND`` were gloo, so the tests that
    torch gates on the name gloo when it defines them (``require_backend_is_available({"gloo"})``,
    ``BACKEND not in ("mpi", "nccl", "gloo")``) run on smddp too; inside the tests ``BACKEND`` is
    smddp, so run-time checks of the name still take the non-gloo path.
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
        if gates == "gloo":
            os.environ["BACKEND"] = "gloo"

    import torch.multiprocessing
    from torch.testing._internal.distributed import distributed_test as suite

    suite.BACKEND = os.environ["BACKEND"] = backend

    class TorchSuite(suite.TestDistBackend, suite.DistributedTest._DistTestBase):
        def setUp(self):
            super().setUp()
            self._start_processes(torch.multiprocessing.get_context("fork").Process)

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
    tests = unittest.TestSuite(cls(n) for n in names)
    with open(args.worker, "a") as out:
        tests.run(_Recorder(out))
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


def markdown(gloo: Dict[str, dict], smddp: Dict[str, dict], command: str, world_size: int) -> str:
    """The comparison as a Markdown page."""
    g, s = counts(gloo), counts(smddp)
    lines = [
        "# torch's distributed test suite on smddp",
        "",
        "torch ships its own distributed test suite in the wheel "
        "(`torch/testing/_internal/distributed/distributed_test.py`). smddp runs it as gloo's peer: "
        "`\"smddp\"` is added wherever `\"gloo\"` appears in `DistTestCases.backend_feature`, so the "
        "DDP, subgroup and coalesced tests that torch gates by backend name run on smddp too. "
        "Tests that check `BACKEND == \"gloo\"` by name still skip on smddp.",
        "",
        f"Produced by `{command}` ({world_size} ranks per test, CPU).",
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
    lines += ["## Tests gloo passes that smddp does not", ""]
    if not lost:
        lines += ["None.", ""]
    else:
        lines += ["| test | smddp | reason |", "|---|---|---|"]
        for name in lost:
            reason = CANNOT_PASS.get(name, "not yet understood")
            lines.append(f"| `{name}` | {smddp.get(name, {}).get('outcome', 'not run')} | {reason} |")
        lines.append("")
    lines += ["## Tests smddp passes that gloo does not", ""]
    if not gained:
        lines += ["None.", ""]
    else:
        lines += ["| test | gloo |", "|---|---|"]
        for name in gained:
            detail = gloo[name]["detail"].splitlines()[-1][:120] if gloo.get(name, {}).get("detail") else ""
            lines.append(f"| `{name}` | {gloo.get(name, {}).get('outcome', 'not run')}: {detail} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-k", action="append", default=[], metavar="REGEX",
                        help="run the tests whose name matches REGEX (repeatable; default: all)")
    parser.add_argument("--exclude", action="append", default=[], metavar="REGEX",
                        help="skip the tests whose name matches REGEX (repeatable)")
    parser.add_argument("--test", action="append", default=[], help="run this exact test (repeatable)")
    parser.add_argument("--backend", action="append", default=None, choices=("gloo", "smddp"),
                        help="backends to run (repeatable; default: gloo and smddp)")
    parser.add_argument("--world-size", type=int, default=2, help="processes per test (default 2)")
    parser.add_argument("--test-timeout", type=int, default=120,
                        help="seconds torch's harness gives each test (default 120)")
    parser.add_argument("--gates", choices=("gloo", "features"), default="gloo",
                        help="smddp passes torch's backend-name gates as gloo does (default), or only "
                             "those in DistTestCases.backend_feature")
    parser.add_argument("--json", type=Path, help="write both backends' records here")
    parser.add_argument("--markdown", type=Path, help="write the comparison page here")
    parser.add_argument("--log-dir", type=Path, help="write each backend's progress log here")
    parser.add_argument("--reuse", type=Path, metavar="JSON",
                        help="take the records of backends not run now from this earlier --json output")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        args.backend = args.backend[0]
        return _worker(args)
    backends = args.backend or ["gloo", "smddp"]
    results = json.loads(args.reuse.read_text()) if args.reuse else {}
    for backend in backends:
        log = args.log_dir / f"{backend}.log" if args.log_dir else None
        if args.log_dir:
            args.log_dir.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        results[backend] = run_backend(backend, args.k, args.test, args.world_size, args.test_timeout, log,
                                       args.gates, args.exclude)
        c = counts(results[backend])
        print(f"{backend}: {len(results[backend])} tests, {c['passed']} passed, {c['failed']} failed, "
              f"{c['error']} errors, {c['skipped']} skipped ({time.monotonic() - started:.0f} s)", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    if "gloo" in results and "smddp" in results:
        lost = regressions(results["gloo"], results["smddp"])
        print(f"gloo passes and smddp does not ({len(lost)}): {' '.join(lost) or 'none'}")
        if args.markdown:
            command = "python tools/torch_suite.py " + " ".join(argv if argv is not None else sys.argv[1:])
            args.markdown.write_text(markdown(results["gloo"], results["smddp"], command.strip(), args.world_size))
        return 1 if lost else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
