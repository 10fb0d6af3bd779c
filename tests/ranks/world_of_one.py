"""A plain `python train.py`: rank 0 of 1, no MPI started, no port opened."""

import sys

import torch
import torch.distributed as tdist

import smddp.torch.distributed as dist

assert not dist.is_available()
dist.init_process_group()
assert (dist.get_rank(), dist.get_world_size(), dist.get_local_rank(), dist.get_local_size()) == (0, 1, 0, 1)
assert dist.get_backend() == "local"
assert tdist.is_initialized() and tdist.get_world_size() == 1
assert "mpi4py.MPI" not in sys.modules, "MPI was started for a world of one"
store = tdist.distributed_c10d._get_default_store()
assert type(store).__name__ in ("HashStore", "PrefixStore") and "TCP" not in type(store).__name__
t = torch.arange(6.0)
dist.all_reduce(t, op=dist.ReduceOp.AVERAGE)
assert torch.equal(t, torch.arange(6.0))
model = torch.nn.Linear(2, 1)
from smddp.torch.parallel import DistributedDataParallel as DDP  # noqa: E402

DDP(model)(torch.ones(1, 2)).sum().backward()
assert model.weight.grad is not None
print("WORLD_OF_ONE_OK")
