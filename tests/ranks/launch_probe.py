"""Prints what smddprun gave this process, for tests/launch/test_smddprun.py.

One line per rank: ``PROBE <rank> <json>`` with the topology, ``SMDATAPARALLEL_LOCAL_RANK``,
the script's arguments, and whether the ``smdistributed`` names are smddp's own objects.
"""

from __future__ import annotations

import json
import os
import sys

import smdistributed.dataparallel.torch.distributed as sm_dist
import smdistributed.dataparallel.torch.torch_smddp  # noqa: F401
from smdistributed.dataparallel.torch.parallel import DistributedDataParallel as SmParallelDDP
from smdistributed.dataparallel.torch.parallel.distributed import DistributedDataParallel as SmDDP

import smddp.torch.distributed as smddp_dist
from smddp.job.topology import discover
from smddp.torch.parallel.distributed import DistributedDataParallel

topo = discover(os.environ)
report = {
    "rank": topo.rank,
    "size": topo.size,
    "local_rank": topo.local_rank,
    "launcher": topo.launcher,
    "SMDATAPARALLEL_LOCAL_RANK": os.environ.get("SMDATAPARALLEL_LOCAL_RANK"),
    "argv": sys.argv[1:],
    "argv0": sys.argv[0],
    "same_distributed": sm_dist is smddp_dist,
    "same_ddp": SmDDP is DistributedDataParallel and SmParallelDDP is DistributedDataParallel,
    "spec_name": smddp_dist.__spec__.name,
}
print(f"PROBE {topo.rank} {json.dumps(report)}", flush=True)
