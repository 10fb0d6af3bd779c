"""Holds a job open for smddprun's failure and signal tests.

Usage: ``launch_hold.py PIDDIR FAILING_RANK``. Every rank starts a grandchild (a second
Python process), writes both pids into PIDDIR, waits until every rank has done so, then
rank FAILING_RANK raises while the others wait forever: in an MPI barrier when mpirun
started the job, else in a sleep. Pass -1 to let no rank fail.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from smddp.job.topology import discover

piddir, failing = Path(sys.argv[1]), int(sys.argv[2])
topo = discover(os.environ)
comm = None
if topo.mpi:
    from mpi4py import MPI  # initializes MPI: a failing rank must now abort the job

    comm = MPI.COMM_WORLD

child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
(piddir / f"rank{topo.rank}.{os.getpid()}.{child.pid}").write_text("")
print(f"HOLDING {topo.rank} {os.getpid()} {child.pid}", flush=True)

# Start together, so that the failure happens while every rank is running.
deadline = time.monotonic() + 60
while len(list(piddir.iterdir())) < topo.size and time.monotonic() < deadline:
    time.sleep(0.05)

if topo.rank == failing:
    raise RuntimeError(f"rank {failing} fails on purpose")
if comm is not None:
    comm.Barrier()
time.sleep(600)
