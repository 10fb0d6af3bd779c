"""smdistributed v2 style: register the backend by import, then torch's own API and DDP."""

import os

import torch
import torch.distributed as tdist

import smddp.torch.torch_smddp  # noqa: F401

assert "MASTER_ADDR" not in os.environ and "MASTER_PORT" not in os.environ
tdist.init_process_group(backend="smddp")
rank, size = tdist.get_rank(), tdist.get_world_size()
torch.manual_seed(rank)
model = torch.nn.Linear(3, 2)
ddp = torch.nn.parallel.DistributedDataParallel(model)
xs = [torch.randn(4, 3, generator=torch.Generator().manual_seed(r)) for r in range(size)]
ddp(xs[rank]).pow(2).sum().backward()
torch.manual_seed(0)
ref = torch.nn.Linear(3, 2)
for x in xs:
    ref(x).pow(2).sum().backward()
torch.testing.assert_close(model.weight.grad, ref.weight.grad / size)
torch.testing.assert_close(model.bias.grad, ref.bias.grad / size)
t = torch.tensor([float(rank)])
tdist.all_reduce(t, op=tdist.ReduceOp.AVG)
assert t.item() == sum(range(size)) / size
tdist.destroy_process_group()
print(f"V2_OK {rank} {size}")
