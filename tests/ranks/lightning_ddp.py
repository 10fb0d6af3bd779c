"""Lightning's ``DDPStrategy`` on smddp's world, for tests/integrations/test_integrations.py.

``--env aws`` is AWS's documented pattern for SageMaker: a ``LightningEnvironment`` whose
world size and global rank come from ``WORLD_SIZE``/``RANK``, with
``DDPStrategy(cluster_environment=env, process_group_backend="smddp")``. ``--env mpi`` uses
Lightning's own ``MPIEnvironment`` instead. ``--env launcher`` is a plain ``python
lightning_ddp.py``: Lightning's own launcher starts the second process (``--nodes 2``: on each of
two hosts, with ``NODE_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` set, as across real nodes).
Lightning then calls ``init_process_group("smddp", rank=..., world_size=...)`` (``env://``) itself. Each rank
prints its CPU plane and ``LIGHTNING <rank> <json>`` with digests of its parameters before and after training.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import LightningEnvironment, MPIEnvironment
from lightning.pytorch.strategies import DDPStrategy
from param_digest import digest

from smddp.torch import groups

try:
    import smdistributed.dataparallel.torch.torch_smddp  # noqa: F401 - smddprun's alias
except ImportError:  # --env launcher: Lightning re-runs this script as plain python
    import smddp.torch.torch_smddp  # noqa: F401

parser = argparse.ArgumentParser()
parser.add_argument("--env", choices=("aws", "mpi", "launcher"), required=True)
parser.add_argument("--nodes", type=int, default=1, help="hosts of Lightning's own launcher (--env launcher)")
args = parser.parse_args()
which = args.env


class Points(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 32

    def __getitem__(self, index: int):
        x = torch.randn(4, generator=torch.Generator().manual_seed(index))
        return x, x.sum(dim=0, keepdim=True) * 0.5


class Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))

    def training_step(self, batch, _index):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


if which == "aws":
    env = LightningEnvironment()
    env.world_size = lambda: int(os.environ.get("WORLD_SIZE", 0))
    env.global_rank = lambda: int(os.environ.get("RANK", 0))
elif which == "mpi":
    env = MPIEnvironment()
else:
    env = None  # Lightning's default environment and launcher: it starts rank 1 itself
local_size = 2 if env is None else int(os.environ["LOCAL_WORLD_SIZE"])
num_nodes = args.nodes if env is None else int(os.environ["WORLD_SIZE"]) // local_size
torch.manual_seed(0)
model = Regression()
initial = digest(model)
with tempfile.TemporaryDirectory() as root:
    trainer = pl.Trainer(
        accelerator="cpu", devices=local_size, num_nodes=num_nodes, max_steps=3, default_root_dir=root,
        strategy=DDPStrategy(cluster_environment=env, process_group_backend="smddp"),
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(model, torch.utils.data.DataLoader(Points(), batch_size=4))
report = {
    "world": dist.get_world_size(), "backend": dist.get_backend(), "global_rank": trainer.global_rank,
    "environment": type(trainer.strategy.cluster_environment).__name__, "initial": initial, "final": digest(model),
    "plane": groups.current().engine.comms["cpu"].plane,
}
# One write per line: processes that share the pipe cannot split it.
print(f"LIGHTNING {dist.get_rank()} {json.dumps(report)}\n", end="", flush=True)
dist.destroy_process_group()
