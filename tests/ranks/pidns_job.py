"""Two ranks that share the host name and IPC but not a process-id namespace (containers in one pod).

Started by tests/comm/planes/test_layout.py, each rank under ``unshare --pid --fork`` with ``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``. Their host identities differ (the pid
namespace is part of it), so they are not host-mates: neither checks the other's pid, which it
cannot see. Prints ``PLANE <rank> <plane> <hosts>``; ``LATE <rank> <result>`` after an
all-reduce that rank 1 joins 5 s late (no error may come of it); then rank 1 exits with status
3 while rank 0 all-reduces, which must fail on rank 0 (``FAILED 0 <error class>``), not hang.
"""

from __future__ import annotations

import os
import sys
import time

import torch

import smddp.torch.distributed as dist
from smddp.torch import groups

dist.init_process_group()
rank = dist.get_rank()
comm = groups.current().engine.comms["cpu"]
# One write per line: processes that share the pipe cannot split it.
print(f"PLANE {rank} {comm.plane} {len(comm.layout.mates.hosts)}\n", end="", flush=True)
tensor = torch.full((4,), float(rank + 1))
dist.all_reduce(tensor)
assert tensor.tolist() == [3.0] * 4, tensor
if rank == 1:
    time.sleep(5)
tensor = torch.full((1 << 16,), float(rank + 1))
dist.all_reduce(tensor)
print(f"LATE {rank} {tensor.unique().tolist()}\n", end="", flush=True)
if rank == 1:
    os._exit(3)
try:
    dist.all_reduce(tensor)
except Exception as exc:  # noqa: BLE001 - reported, the test judges it
    print(f"FAILED {rank} {type(exc).__name__} {' '.join(str(exc).split())[:300]}\n", end="", flush=True)
    sys.stdout.flush()
    os._exit(0)
print(f"NO_ERROR {rank}\n", end="", flush=True)
os._exit(1)
