"""A rank that opens everything smddp opens, then holds still while the test looks at its sockets.

Usage: ``exposure_probe.py PIDDIR``. Every rank joins the "smddp" process group (the job's
store, the CPU plane, the gloo backend torch's functional collectives use), runs a small and a
large all-reduce (800 KB: MPI's large-message path) and checks them against the sums of every
rank's seeded inputs computed here (small integers: exact in any order), prints
``REDUCED <rank> ok``, writes ``rank<N>.<pid>`` into PIDDIR, and waits (60 s at most) for the
file ``release`` in PIDDIR before it leaves the group.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import smddp.torch.torch_smddp  # noqa: F401 - registers the "smddp" backend

piddir = Path(sys.argv[1])
dist.init_process_group(backend="smddp")
rank, size = dist.get_rank(), dist.get_world_size()
exact = True
for numel in (1000, 100_000):
    inputs = [torch.randint(-1000, 1000, (numel,), generator=torch.Generator().manual_seed(100 + r))
              .to(torch.float64) for r in range(size)]
    tensor = inputs[rank].clone()
    dist.all_reduce(tensor)
    exact = exact and torch.equal(tensor, torch.stack(inputs).sum(0))
print(f"REDUCED {rank} {'ok' if exact else 'WRONG'}", flush=True)
ready = piddir / f".rank{rank}.{os.getpid()}"
ready.write_text("")
ready.rename(piddir / f"rank{rank}.{os.getpid()}")
deadline = time.monotonic() + 60
while not (piddir / "release").exists() and time.monotonic() < deadline:
    time.sleep(0.05)
dist.destroy_process_group()
