"""Futures whose callbacks start collectives, on smddp's group beside a gloo group of the same job.

Run by tests/torch/test_comm_hooks.py under torchrun, mpirun and smddprun, 2 and 3 ranks. One world
(``init_process_group("smddp")``) and, in it, ``new_group(backend="gloo")``; each check runs on
both and prints a digest per group, which the test compares:

- ``powersgd/<n>``: torch's PowerSGD hook (its ``then`` callbacks start all-reduces and wait on
  their futures), DDP with one bucket, 4 steps; ``TRAININGS`` trainings in a row, each with its
  own DDP and state (each is a new chance for the callbacks to race the backward).
- ``powersgd-buckets``: the same with a bucket per layer, where one bucket's callbacks race the
  next bucket's all-reduce from backward. On gloo the hook is made to wait for its future before
  returning (gloo orders them by thread timing and hangs or mixes them up); on smddp it is left
  as it is: smddp numbers a callback's collectives right after their parent's on every rank, as
  torch's NCCL group does by running them as it enqueues.
- ``then``: a ``then`` callback that starts a synchronous and an asynchronous all-reduce, and a
  callback of that callback's future that starts another: values checked against ones computed
  here from every rank's seeded input.

Each rank prints ``DIGEST <rank> <group> <check> <hex>`` and checklist lines.
"""

from __future__ import annotations

import hashlib
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from checklist import Checklist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

import smddp.torch.torch_smddp  # noqa: F401 - registers the "smddp" backend

TRAININGS = 10
STEPS = 4


def digest(module: nn.Module) -> str:
    data = b"".join(p.detach().contiguous().numpy().tobytes() for p in module.parameters())
    return hashlib.sha256(data).hexdigest()[:16]


def train(group, buckets: bool, wait_in_hook: bool, seed: int) -> str:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    ddp = nn.parallel.DistributedDataParallel(model, process_group=group,
                                              bucket_cap_mb=0.002 if buckets else 25)
    state = powersgd.PowerSGDState(process_group=group, matrix_approximation_rank=1, start_powerSGD_iter=2)

    def waited(state, bucket):
        future = powersgd.powerSGD_hook(state, bucket)
        future.wait()
        return future

    ddp.register_comm_hook(state, waited if wait_in_hook else powersgd.powerSGD_hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(1000 * seed + dist.get_rank())
    for _ in range(STEPS):
        optimizer.zero_grad()
        ddp(torch.randn(8, 16, generator=data)).sum().backward()
        optimizer.step()
    return digest(model)


def callbacks(group, checks: Checklist, name: str) -> None:
    """A then() callback that starts collectives (synchronous and not), and one on its future."""
    rank, size = dist.get_rank(), dist.get_world_size()
    x = torch.arange(6, dtype=torch.float64) + rank
    want_x = torch.arange(6, dtype=torch.float64) * size + sum(range(size))
    y, z = torch.full((3,), float(rank + 1)), torch.full((2,), 2.0 ** rank)

    def first(future):
        value = future.value()[0].clone()
        dist.all_reduce(y, group=group)  # synchronous, from inside the callback
        dist.all_reduce(z, op=dist.ReduceOp.MAX, group=group, async_op=True).wait()
        return value

    def second(future):
        w = future.value() * 2
        dist.all_reduce(w, group=group)
        return w

    result = dist.all_reduce(x, group=group, async_op=True).get_future().then(first).then(second).wait()
    checks.check(f"{name}: then() callbacks' collectives",
                 torch.equal(y, torch.full((3,), float(sum(range(1, size + 1)))))
                 and torch.equal(z, torch.full((2,), 2.0 ** (size - 1)))
                 and torch.equal(result, want_x * 2 * size), f"{y} {z} {result}")


def main() -> int:
    dist.init_process_group("smddp")
    rank = dist.get_rank()
    checks = Checklist(rank)
    groups = {"smddp": None, "gloo": dist.new_group(backend="gloo")}
    for name, group in groups.items():
        for n in range(TRAININGS):
            print(f"DIGEST {rank} {name} powersgd/{n} {train(group, False, False, n)}", flush=True)
        print(f"DIGEST {rank} {name} powersgd-buckets {train(group, True, name == 'gloo', 99)}", flush=True)
        callbacks(group, checks, name)
    dist.barrier()
    status = checks.summary()
    dist.destroy_process_group()
    return status


if __name__ == "__main__":
    sys.exit(main())
