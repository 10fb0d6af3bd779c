"""tools/gpu_checks.py runs its steps in order under one budget and says what each returned."""

from __future__ import annotations

import shutil
import subprocess
import sys

from launchers import ROOT

TOOL = str(ROOT / "tools" / "gpu_checks.py")


def checks(tmp_path, *args: str, timeout: float = 120):
    return subprocess.run([sys.executable, TOOL, "--out", str(tmp_path), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


def test_the_steps_run_and_a_missing_gpu_is_reported_not_fatal(tmp_path):
    done = checks(tmp_path, "--steps", "host-cost,machine", "--budget", "100")
    summary = (tmp_path / "summary.txt").read_text().splitlines()
    # in the tool's order, whatever order they were named in
    assert [line.split(":")[0] for line in summary] == ["machine", "machine", "nccl_host_cost.py"], summary
    assert " exit 0 " in summary[1] and " exit 0 " in summary[2], summary
    if shutil.which("nvidia-smi") is None:  # a machine without a GPU: reported, and the run goes on
        assert summary[0].startswith("machine: nvidia-smi: exit 127"), summary
        assert done.returncode == 1 and "gpu none" in (tmp_path / "machine.txt").read_text()
    assert done.stdout.splitlines() == summary
    host = (tmp_path / "host-cost.log").read_text()
    assert all(f"HOSTCOST {name} " in host for name in ("sync", "async", "null", "args", "inline")), host
    assert sorted(p.name for p in tmp_path.iterdir()) == ["host-cost.log", "machine.txt", "summary.txt"]


def test_a_spent_budget_starts_nothing_and_an_unknown_step_is_refused(tmp_path):
    done = checks(tmp_path, "--steps", "machine,pytest", "--budget", "0")
    assert done.returncode == 0 and done.stdout.count("not run, the budget was spent") == 3, done.stdout
    refused = checks(tmp_path, "--steps", "pytest,tests")
    assert refused.returncode == 2 and "unknown steps tests" in refused.stderr
