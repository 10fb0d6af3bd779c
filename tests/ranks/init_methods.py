"""Every way a script starts ``torch.distributed`` with the smddp backend, one after another.

``python init_methods.py PORT STORE_PORT DIR [MODE]`` runs each mode of :data:`MODES` (or only
``MODE``) in this process: initialize,
check rank, size and an all_reduce (and smddp's v1 functions on the same world), destroy.
``PORT`` and ``STORE_PORT`` are free ports chosen by the test (tcp://, the explicit store), ``DIR``
a directory every rank sees (file://). Prints ``INIT <rank> <mode> <json>`` per mode; rank and
size are those of the launcher, read from its own variables by the test.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as tdist

import smddp.alias  # noqa: F401 - as smddprun does: the smdistributed names are smddp's

# Imported after the alias is on, as NeMo's initialize_sagemaker imports both.
sm_dist = importlib.import_module("smdistributed.dataparallel.torch.distributed")
importlib.import_module("smdistributed.dataparallel.torch.torch_smddp")

PORT, STORE_PORT, DIR = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
# Under torchrun every rank's tcp:// store is a client of torchrun's own (TORCHELASTIC_USE_AGENT_STORE):
# the URL must name it, as scripts written for torchrun do.
TCP = f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}" if "MASTER_PORT" in os.environ else (
    f"tcp://127.0.0.1:{PORT}")


def launcher_rank():
    """What the launcher says, from its own variables (the rank is not known otherwise)."""
    for rank, size in (("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"), ("RANK", "WORLD_SIZE"),
                       ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS")):
        if rank in os.environ:
            return int(os.environ[rank]), int(os.environ[size])
    raise SystemExit("no launcher")


RANK, SIZE = launcher_rank()


def v2(**kwargs):
    tdist.init_process_group(backend="smddp", timeout=timedelta(seconds=60), **kwargs)


MODES = {
    "default": lambda: v2(),
    "env": lambda: v2(init_method="env://"),
    "tcp": lambda: v2(init_method=TCP),
    "tcp-explicit": lambda: v2(init_method=TCP, rank=RANK, world_size=SIZE),
    "file": lambda: v2(init_method=f"file://{DIR}/file-store"),
    "store": lambda: v2(store=tdist.TCPStore("127.0.0.1", STORE_PORT, SIZE, RANK == 0, timedelta(seconds=60)),
                        rank=RANK, world_size=SIZE),
    # NeMo's initialize_sagemaker: smdistributed's init, then torch.distributed calls.
    "v1-then-torch": lambda: sm_dist.init_process_group(),
    # The reverse: torch's init, then smdistributed's (which finds the group initialized).
    "torch-then-v1": lambda: (v2(), sm_dist.init_process_group()),
}

# Under torchrun a second init in one process meets stale keys in torchrun's store (torch's own
# gloo cannot init twice there either): the test starts one job per mode.
chosen = sys.argv[4:] or list(MODES)
for mode in chosen:
    MODES[mode]()
    t = torch.tensor([float(RANK + 1)])
    tdist.all_reduce(t)
    u = torch.tensor([float(RANK + 1)])
    sm_dist.all_reduce(u)
    b = torch.tensor([float(RANK)])
    tdist.broadcast(b, src=SIZE - 1)
    sm_dist.barrier()
    tdist.barrier()
    report = {
        "torch": [tdist.get_rank(), tdist.get_world_size()], "v1": [sm_dist.get_rank(), sm_dist.get_world_size()],
        "initialized": [tdist.is_initialized(), sm_dist.is_initialized()], "backend": tdist.get_backend(),
        "torch_sum": t.item(), "v1_sum": u.item(), "bcast": b.item(),
    }
    print(f"INIT {RANK} {mode} {json.dumps(report)}", flush=True)
    sm_dist.destroy_process_group()
    assert not tdist.is_initialized()
