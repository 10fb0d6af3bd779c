"""DeepSpeed's ``deepspeed.comm`` on smddp's world, for tests/integrations/test_integrations.py.

As AWS documents for SageMaker: ``deepspeed.init_distributed(dist_backend="smddp")``, then
DeepSpeed's collectives. Each rank prints ``DEEPSPEED <rank> <json>``.
"""

from __future__ import annotations

import json

import deepspeed
import deepspeed.comm as ds_dist
import smdistributed.dataparallel.torch.torch_smddp  # noqa: F401
import torch
import torch.distributed as dist

deepspeed.init_distributed(dist_backend="smddp")
rank, world = ds_dist.get_rank(), ds_dist.get_world_size()
t = torch.tensor([float(rank + 1), 10.0 * (rank + 1)])
ds_dist.all_reduce(t)
gathered = [torch.zeros(2) for _ in range(world)]
ds_dist.all_gather(gathered, torch.tensor([float(rank), float(rank * rank)]))
b = torch.tensor([float(rank + 7)])
ds_dist.broadcast(b, src=1)
ds_dist.barrier()
report = {"world": world, "backend": dist.get_backend(), "sum": t.tolist(),
          "gathered": [g.tolist() for g in gathered], "broadcast": b.item()}
print(f"DEEPSPEED {rank} {json.dumps(report)}", flush=True)
dist.destroy_process_group()
