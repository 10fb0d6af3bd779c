"""A SageMaker training script in a local-mode job, for tests/integrations/test_integrations.py.

AWS's toolkit: ``sagemaker_training.environment.Environment()`` reads the container under
``SAGEMAKER_BASE_DIR`` as it does on SageMaker. Then AWS's examples' pattern (MNIST,
MaskRCNN): ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` from the environment,
``init_process_group(backend="smddp", init_method="env://")`` and one DDP step on seeded
per-rank data, whose averaged gradient is checked against one computed here from every rank's
data. The script writes what it saw, plus every ``SM_*`` variable of ``to_env_vars()`` that
differs from this process's environment, to ``SM_OUTPUT_DATA_DIR/toolkit-<rank>.json`` (local
mode packs it into output.tar.gz).
"""

from __future__ import annotations

import json
import os
import sys

import smdistributed.dataparallel.torch.torch_smddp  # noqa: F401
import torch
import torch.distributed as dist
from sagemaker_training.environment import Environment
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers.utils import is_sagemaker_dp_enabled

rank, world, local_rank = (int(os.environ[name]) for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
dist.init_process_group(backend="smddp", init_method="env://")
xs = [torch.randn(5, 3, generator=torch.Generator().manual_seed(100 + r)) for r in range(world)]
torch.manual_seed(0)
model = DDP(torch.nn.Linear(3, 1))
model(xs[rank]).pow(2).mean().backward()
torch.manual_seed(0)
ref = torch.nn.Linear(3, 1)
for x in xs:
    ref(x).pow(2).mean().backward()
env = Environment()
exported = env.to_env_vars()
record = {
    "hosts": env.hosts, "current_host": env.current_host, "hyperparameters": env.hyperparameters,
    "channels": {name: sorted(os.listdir(path)) for name, path in env.channel_input_dirs.items()},
    "channel_dirs": env.channel_input_dirs, "model_dir": env.model_dir, "num_gpus": env.num_gpus,
    "num_cpus": env.num_cpus, "job_name": env.job_name, "framework_params": env.additional_framework_parameters,
    "user_entry_point": env.user_entry_point, "current_instance_type": env.current_instance_type,
    "is_master": env.is_master, "argv": sys.argv[1:], "user_args": env.to_cmd_args(),
    "differs": {k: [v, os.environ.get(k)] for k, v in exported.items() if os.environ.get(k) != v},
    "compared": len(exported), "sm_model_dir": os.environ["SM_MODEL_DIR"],
    "sagemaker_dp": is_sagemaker_dp_enabled(), "mark": os.environ.get("SMDDP_TEST_MARK"),
    "torch_rank": dist.get_rank(), "world": dist.get_world_size(), "local_rank": local_rank,
    "backend": dist.get_backend(), "grad_ok": torch.allclose(model.module.weight.grad, ref.weight.grad / world),
}
dist.destroy_process_group()
with open(os.path.join(os.environ["SM_OUTPUT_DATA_DIR"], f"toolkit-{rank}.json"), "w") as f:
    json.dump(record, f)
