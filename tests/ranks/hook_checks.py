"""torch's algorithms on top of DDP (communication hooks, ZeRO), on smddp's group beside a gloo group.

Run by tests/torch/test_comm_hooks.py under torchrun, mpirun and smddprun, 2 and 3 ranks. One world
(``init_process_group("smddp")``) and, in it, ``new_group(backend="gloo")``; each check runs on
both and prints a digest per group, which the test compares. Most are futures whose callbacks
start collectives:

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
- ``fp16``: torch's ``fp16_compress_hook`` (gradients all-reduced in float16, decompressed in a
  ``then`` callback).
- ``localsgd``: torch's ``post_localSGD_hook`` (global all-reduces for two steps, then each rank's
  subgroup of one) with a ``PeriodicModelAverager`` averaging the parameters every two steps,
  subgroups made by ``new_subgroups`` on the group's backend.
- ``zero``: ``ZeroRedundancyOptimizer`` (Adam, each rank steps its shard and broadcasts it) under
  DDP, then ``consolidate_state_dict`` to rank 0.

torch's ``bf16_compress_hook``, its quantization hooks and FSDP1 (``FullyShardedDataParallel``)
need a GPU: torch refuses or fails them on CPU on gloo as well.

Each rank prints ``DIGEST <rank> <group> <check> <hex>`` and checklist lines.
"""

from __future__ import annotations

import hashlib
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from checklist import Checklist, say
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, post_localSGD_hook
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
from torch.distributed.algorithms.model_averaging import averagers
from torch.distributed.optim import ZeroRedundancyOptimizer

import smddp.torch.torch_smddp  # noqa: F401 - registers the "smddp" backend

TRAININGS = 10
STEPS = 4


def digest(module: nn.Module) -> str:
    data = b"".join(p.detach().contiguous().numpy().tobytes() for p in module.parameters())
    return hashlib.sha256(data).hexdigest()[:16]


def mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


def steps(ddp: nn.Module, optimizer, seed: int, count: int = STEPS, after=None) -> None:
    """``count`` steps on this rank's seeded batches; ``after()`` after each optimizer step."""
    data = torch.Generator().manual_seed(1000 * seed + dist.get_rank())
    for _ in range(count):
        optimizer.zero_grad()
        ddp(torch.randn(8, 16, generator=data)).sum().backward()
        optimizer.step()
        if after is not None:
            after()


def train(group, buckets: bool, wait_in_hook: bool, seed: int) -> str:
    model = mlp(seed)
    ddp = nn.parallel.DistributedDataParallel(model, process_group=group,
                                              bucket_cap_mb=0.002 if buckets else 25)
    state = powersgd.PowerSGDState(process_group=group, matrix_approximation_rank=1, start_powerSGD_iter=2)

    def waited(state, bucket):
        future = powersgd.powerSGD_hook(state, bucket)
        future.wait()
        return future

    ddp.register_comm_hook(state, waited if wait_in_hook else powersgd.powerSGD_hook)
    steps(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), seed)
    return digest(model)


def fp16(group) -> str:
    model = mlp(11)
    ddp = nn.parallel.DistributedDataParallel(model, process_group=group)
    ddp.register_comm_hook(group, default_hooks.fp16_compress_hook)
    steps(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), 11)
    return digest(model)


def local_sgd(group, subgroup) -> str:
    model = mlp(12)
    ddp = nn.parallel.DistributedDataParallel(model, process_group=group)
    state = post_localSGD_hook.PostLocalSGDState(process_group=group, subgroup=subgroup, start_localSGD_iter=2)
    ddp.register_comm_hook(state, post_localSGD_hook.post_localSGD_hook)
    averager = averagers.PeriodicModelAverager(period=2, warmup_steps=2, process_group=group)
    # five steps: the averager's last turn (its fifth call) averages, so every rank ends alike
    steps(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), 12, count=5,
          after=lambda: averager.average_parameters(ddp.parameters()))
    return digest(model)


def zero(group, checks: Checklist, name: str) -> str:
    model = mlp(13)
    ddp = nn.parallel.DistributedDataParallel(model, process_group=group)
    optimizer = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.Adam, lr=0.01,
                                        process_group=group)
    steps(ddp, optimizer, 13)
    optimizer.consolidate_state_dict(to=0)
    if dist.get_rank() == 0:
        state = optimizer.state_dict()["state"]
        checks.check(f"{name}: ZeRO's state consolidated on rank 0",
                     sorted(state) == list(range(6)) and all(s["step"] == STEPS for s in state.values()),
                     f"{sorted(state)}")
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
    # every rank makes every subgroup, in the same order: the group's backend, one rank each
    subgroups = {"smddp": dist.new_subgroups(group_size=1)[0],
                 "gloo": dist.new_subgroups(group_size=1, backend="gloo")[0]}
    for name, group in groups.items():
        for n in range(TRAININGS):
            say(f"DIGEST {rank} {name} powersgd/{n} {train(group, False, False, n)}")
        say(f"DIGEST {rank} {name} powersgd-buckets {train(group, True, name == 'gloo', 99)}")
        callbacks(group, checks, name)
        say(f"DIGEST {rank} {name} fp16 {fp16(group)}")
        say(f"DIGEST {rank} {name} localsgd {local_sgd(group, subgroups[name])}")
        say(f"DIGEST {rank} {name} zero {zero(group, checks, name)}")
    dist.barrier()
    status = checks.summary()
    dist.destroy_process_group()
    return status


if __name__ == "__main__":
    sys.exit(main())
