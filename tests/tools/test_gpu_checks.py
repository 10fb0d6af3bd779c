"""tools/gpu_checks.py runs its steps in order under one budget, ends a step that overruns with every
process it started, and pools the benchmarks' within-round ratios into gpu-checks.json."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
import textwrap

from launchers import ROOT

TOOL = str(ROOT / "tools" / "gpu_checks.py")


def _module(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def checks(tmp_path, *args: str, timeout: float = 120):
    return subprocess.run([sys.executable, TOOL, "--out", str(tmp_path), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


def test_the_steps_run_in_order_and_a_missing_gpu_is_reported_not_fatal(tmp_path):
    done = checks(tmp_path, "--steps", "host-cost,machine", "--budget", "100")
    report = json.loads((tmp_path / "gpu-checks.json").read_text())
    steps = report["steps"]
    # in the tool's order, whatever order they were named in
    assert [s["step"] for s in steps] == ["machine: nvidia-smi", "machine: versions", "nccl_host_cost.py"], steps
    assert steps[1]["exit"] == 0 and steps[2]["exit"] == 0, steps
    if shutil.which("nvidia-smi") is None:  # a machine without a GPU: reported, and the run goes on
        assert steps[0]["exit"] == 127, steps
        assert done.returncode == 1 and "gpu none" in report["machine"], report["machine"]
    printed = done.stdout.splitlines()
    assert all(line.startswith(f"{s['step']}: exit {s['exit']} in ") for line, s in zip(printed, steps)), printed
    assert "no within-round ratios (no benchmark job completed)" in printed and report["ratios"] == []
    host = (tmp_path / "host-cost.log").read_text()
    for name in ("sync", "async", "null", "args", "inline"):
        assert f"HOSTCOST {name} " in host, host
        assert report["host_cost"][f"{name} us"] > 0, report["host_cost"]
    assert report["host_cost"]["sync / null"] > 0, report["host_cost"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu-checks.json", "host-cost.log", "machine.txt"]


def test_a_spent_budget_starts_nothing_and_an_unknown_step_is_refused(tmp_path):
    done = checks(tmp_path, "--steps", "machine,pytest", "--budget", "0")
    # two machine calls, then the GPU tests' two parts (the delegated route's file first)
    assert done.returncode == 0 and done.stdout.count("not run, the budget was spent") == 4, done.stdout
    steps = [s["step"] for s in json.loads((tmp_path / "gpu-checks.json").read_text())["steps"]]
    assert steps[2:] == ["pytest -m gpu: tests/torch/test_delegated_gpu.py", "pytest -m gpu: the rest of pytest -m gpu"]
    assert (ROOT / "tests/torch/test_delegated_gpu.py").is_file()
    refused = checks(tmp_path, "--steps", "pytest,tests")
    assert refused.returncode == 2 and "unknown steps tests" in refused.stderr


def test_a_step_past_its_limit_is_ended_with_every_process_below_it(tmp_path):
    """Its own process group, and a grandchild that moved to a session of its own (as mpirun's ranks do)
    and ignores SIGTERM: SIGKILL follows."""
    tool = _module(TOOL, "gpu_checks_under_test")
    pids = tmp_path / "pids"
    script = textwrap.dedent(f"""
        import subprocess, sys, time
        same = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        deaf = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)"
        moved = subprocess.Popen([sys.executable, "-c", deaf], start_new_session=True)
        open({str(pids)!r}, "w").write(f"{{same.pid}} {{moved.pid}}")
        time.sleep(120)
    """)
    run = tool.Run(tmp_path, budget=100)
    # 8 s: time for the interpreter and its two children to start on a busy machine
    rc = run.call("sleeper", "sleeper.log", [sys.executable, "-c", script], limit=8)
    assert rc == 124 and run.failed
    assert "stopped after 8 s" in (tmp_path / "sleeper.log").read_text()
    assert pids.exists(), "the step did not get as far as starting its children"
    left = [pid for pid in map(int, pids.read_text().split()) if tool._alive(pid)]
    assert left == [], f"processes of the ended step still run: {left}"
    assert json.loads((tmp_path / "gpu-checks.json").read_text())["steps"][0]["exit"] == 124


def test_the_benchmarks_figures_pool_into_min_median_max_of_the_within_round_ratios():
    """What gpu_allreduce.py and gpu_call_cost.py write (their own summarize()) is what the tool reads."""
    tool = _module(TOOL, "gpu_checks_under_test")
    allreduce = _module(ROOT / "benchmarks" / "gpu_allreduce.py", "gpu_allreduce_under_test")
    call_cost = _module(ROOT / "benchmarks" / "gpu_call_cost.py", "gpu_call_cost_under_test")

    def per_round(mine, theirs):
        return {"smddp": mine, "smddp v1": mine, "torch-nccl": theirs, "smddp async": mine,
                "torch-nccl async": theirs}

    first = allreduce.summarize("torch-nccl", {1024: (per_round([1.0, 2.0], [1.0, 1.0]), 200)},
                                ({"smddp": [3.0], "torch-nccl": [2.0], "compute": [1.0]}, 25))
    second = allreduce.summarize("torch-nccl", {1024: (per_round([4.0], [1.0]), 200)}, None)
    cupy = allreduce.summarize("nccl", {1024: (per_round([1.5], [1.0]), 200)}, None)
    host = call_cost.summarize("torch-nccl", {
        "smddp all_reduce": [2.0, 3.0], "torch's group all_reduce": [1.0, 1.0],
        "smddp group.allreduce([t])": [1.1, 1.1], "delegate.backend.allreduce([t])": [1.0, 1.0]})
    jobs = [{"tree": "this tree", "route": "torch-nccl", "measures": tool.measures("gpu_allreduce.py", first)},
            {"tree": "this tree", "route": "torch-nccl", "measures": tool.measures("gpu_allreduce.py", second)},
            {"tree": "this tree", "route": "nccl", "measures": tool.measures("gpu_allreduce.py", cupy)},
            {"tree": "this tree", "route": "torch-nccl", "measures": tool.measures("gpu_call_cost.py", host)}]
    rows = {(row["route"], row["measure"]): row for row in tool.pooled(jobs)}
    sync = rows[("torch-nccl", "all_reduce 1K sync")]
    assert (sync["n"], sync["min"], sync["median"], sync["max"]) == (3, 1.0, 2.0, 4.0), sync
    assert (sync["bar"], sync["verdict"]) == (1.02, "MISS"), sync
    ddp = rows[("torch-nccl", "DDP step")]
    assert (ddp["n"], ddp["median"], ddp["verdict"]) == (1, 1.5, "MISS"), ddp
    assert rows[("torch-nccl", "all_reduce 1K v1")]["bar"] is None
    # the CuPy route has no bar; its rows stay apart from the delegated route's
    cupy_async = rows[("nccl", "all_reduce 1K async")]
    assert (cupy_async["median"], cupy_async["bar"], cupy_async["verdict"]) == (1.5, None, None), cupy_async
    assert rows[("torch-nccl", "host: smddp all_reduce")]["median"] == 2.5
    assert abs(rows[("torch-nccl", "host: smddp group.allreduce([t])")]["median"] - 1.1) < 1e-9
    table = "\n".join(tool.ratio_table(tool.pooled(jobs)))
    assert "all_reduce 1K sync" in table and "1.02 MISS" in table
