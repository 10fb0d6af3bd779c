"""Prints the runtime variables this process got and checks torch's env:// on them, for tests/job/test_runtime.py.

One line per rank: ``RUNTIME <RANK> <json>`` with every variable of ``smddp.job.runtime.VARIABLES``
as the process found it, and (with ``--init``) what ``init_process_group(backend="smddp",
init_method="env://")`` then made of them. The script itself reads only the environment, as
AWS's examples do.
"""

from __future__ import annotations

import json
import os
import sys

from smddp.job.runtime import VARIABLES

report = {name: os.environ.get(name) for name in VARIABLES}
report["job"] = os.environ.get("SLURM_JOB_ID")
if "--init" in sys.argv:
    import smdistributed.dataparallel.torch.torch_smddp  # noqa: F401
    import torch
    import torch.distributed as tdist

    tdist.init_process_group(backend="smddp", init_method="env://")
    t = torch.tensor([float(int(os.environ["RANK"]) + 1)])
    tdist.all_reduce(t)
    report["torch_rank"], report["torch_size"], report["sum"] = tdist.get_rank(), tdist.get_world_size(), t.item()
    from smddp.torch import groups

    report["plane"] = groups.current().engine.comms["cpu"].plane
    tdist.destroy_process_group()
print(f"RUNTIME {os.environ.get('RANK')} {json.dumps(report)}", flush=True)
