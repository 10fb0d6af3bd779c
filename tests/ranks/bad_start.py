"""A rank's start in a bad environment: ``init_process_group()``, then one all-reduce checked exactly.

``python bad_start.py TOKEN``: the test sets the environment (a taken ``MASTER_PORT``, a mistyped
``SMDDP_SOCKET_IFNAME``, ``SMDDP_TIMEOUT=0``, an ``SMDDP_SHM_DIR`` the job cannot write) and reads
the lines each rank prints: ``STARTED <rank>`` once ``init_process_group()`` returned, then
``EXACT <rank> <plane>`` (or ``WRONG``) after an all-reduce whose sum is known here. ``TOKEN`` is
only carried on the command line, so that the test can look for processes left behind by it.
"""

from __future__ import annotations

import torch
from checklist import say

import smddp.torch.distributed as dist
from smddp.torch import groups

torch.set_num_threads(1)

dist.init_process_group()
rank, size = dist.get_rank(), dist.get_world_size()
say(f"STARTED {rank}")
t = torch.arange(5, dtype=torch.float64) * (rank + 1)
dist.all_reduce(t)
want = torch.arange(5, dtype=torch.float64) * sum(r + 1 for r in range(size))
cpu = groups.current().engine.comms["cpu"]
plane = getattr(cpu, "plane", None) or cpu.name
say(f"{'EXACT' if torch.equal(t, want) else 'WRONG'} {rank} {plane}")
