"""A job sees when its CPUs are taken (issue 55): its main thread's run delay, said under ``SMDDP_DEBUG``."""

from __future__ import annotations

import os
import time

import pytest

from smddp.job import run_delay

from launchers import python

# A process that spins on CPU 0 for a second, alone or beside a hog pinned to the same CPU, and
# prints its meter's share.
SPIN = """
import os, subprocess, sys, time
from smddp.job import run_delay
os.sched_setaffinity(0, {0})
hog = subprocess.Popen([sys.executable, "-c", "import os; os.sched_setaffinity(0, {0})\\nwhile True: pass"]) \\
    if sys.argv[1] == "hog" else None
time.sleep(0.3)  # the hog is spinning
meter = run_delay.Meter()
end = time.monotonic() + 1.0
while time.monotonic() < end:
    pass
share, seconds = meter.share()
print("SHARE", round(share, 3), round(seconds, 2))
print("REPORT", meter.report(3))
if hog is not None:
    hog.kill()
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/schedstat") or not hasattr(os, "sched_setaffinity"),
                    reason="needs Linux's /proc/<pid>/schedstat and sched_setaffinity")
def test_a_thread_sharing_its_cpu_with_a_spinning_process_is_seen_waiting():
    result = python(["-c", SPIN, "hog"], timeout=60).check()
    share = float(result.stdout.split("SHARE ", 1)[1].split()[0])
    # Two busy processes on one CPU: each runs about half the time (the scheduler's fair share).
    assert 0.25 < share < 1.0, result.stdout  # above 1 is impossible for one thread; other load may add to the half
    assert "REPORT smddp: rank 3: its main thread waited for a CPU" in result.stdout, result.stdout
    assert "this job's CPUs were taken" in result.stdout, result.stdout


@pytest.mark.unit
def test_where_linux_does_not_say_there_is_no_report(tmp_path):
    missing = str(tmp_path / "schedstat")
    assert run_delay.read(missing) is None
    assert run_delay.Meter(missing).report(0) is None
    (tmp_path / "schedstat").write_text("12 34 5\n")
    assert run_delay.read(missing) == 34


@pytest.mark.unit
def test_a_share_below_the_mark_is_said_without_advice(tmp_path):
    stat = tmp_path / "schedstat"
    stat.write_text("0 0 0\n")
    meter = run_delay.Meter(str(stat))
    time.sleep(0.2)
    stat.write_text(f"0 {10 ** 6} 0\n")  # 1 ms of delay in 0.2 s: well under 10%
    line = meter.report(1)
    assert line.startswith("smddp: rank 1: its main thread waited for a CPU 0% of the 0.") and "taken" not in line, line
    stat.write_text(f"0 {10 ** 9} 0\n")  # a second of delay in about 0.2 s: the CPUs were taken
    assert "this job's CPUs were taken" in meter.report(1)
