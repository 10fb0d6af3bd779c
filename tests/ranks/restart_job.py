"""A torchrun job that fails in its first attempt and must run right in the restarted one.

``torchrun --max-restarts 1 restart_job.py raise|kill``: torchrun's agent keeps one store for
every attempt (its default), so the restarted attempt finds the keys the failed one left.
Every attempt initializes on the shared-memory plane, all-reduces seeded tensors (small and
large: both of the plane's paths), makes a subgroup and runs a collective in it. In attempt 0,
rank 1 then raises (``raise``) or kills itself with SIGKILL (``kill``). In the next attempt
every rank trains a small model with DDP and checks it against a single-process replica
trained here on the whole batch. Prints ``ATTEMPT <rank> <attempt> <plane>``, ``EXACT <rank>
<attempt>`` and ``TRAINED <rank> <attempt> <weights' sum>``.
"""

from __future__ import annotations

import os
import signal
import sys

import torch
import torch.distributed as tdist
from torch import nn

torch.set_num_threads(1)

import smddp.torch.torch_smddp  # noqa: E402, F401
from smddp.torch import groups  # noqa: E402

MODE = sys.argv[1]
ATTEMPT = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
STEPS, BATCH = 4, 4


def say(*words) -> None:
    sys.stdout.write(" ".join(map(str, words)) + "\n")
    sys.stdout.flush()


def rows(r: int, numel: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * ATTEMPT + r + numel)
    return torch.randn(numel, generator=g)


def collectives(rank: int, size: int) -> None:
    for numel in (1000, 1 << 20):  # 4 KB in one step, 4 MB in slices
        t = rows(rank, numel)
        tdist.all_reduce(t)
        want = rows(0, numel)
        for r in range(1, size):
            want = want + rows(r, numel)  # the plane's order: rank 0's, then each rank's in turn
        assert torch.equal(t, want), f"rank {rank}: all_reduce of {numel} differs"
    pair = tdist.new_group([0, 1])
    if rank in (0, 1):
        t = torch.full((8,), float(rank + 1))
        tdist.all_reduce(t, group=pair)
        assert torch.equal(t, torch.full((8,), 3.0)), t
    tdist.barrier()
    say("EXACT", rank, ATTEMPT)


def train(rank: int, size: int) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(STEPS):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(size * BATCH, 8, generator=g), torch.randn(size * BATCH, 4, generator=g)
        mine = slice(rank * BATCH, (rank + 1) * BATCH)
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x[mine]), y[mine]).backward()
        opt.step()
        ref_opt.zero_grad()
        nn.functional.mse_loss(reference(x), y).backward()
        ref_opt.step()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.allclose(p, q, rtol=1e-4, atol=1e-6), f"rank {rank}: DDP differs from the replica"
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    every = [torch.empty_like(weights) for _ in range(size)]
    tdist.all_gather(every, weights)
    assert all(torch.equal(w, weights) for w in every), f"rank {rank}: the ranks' weights differ"
    say("TRAINED", rank, ATTEMPT, f"{float(weights.sum()):.6f}")


tdist.init_process_group(backend="smddp")
RANK, SIZE = tdist.get_rank(), tdist.get_world_size()
say("ATTEMPT", RANK, ATTEMPT, groups.current().engine.comms["cpu"].plane)
collectives(RANK, SIZE)
if ATTEMPT == 0:
    if RANK == 1:
        if MODE == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError("rank 1 fails on purpose in attempt 0")
    tdist.all_reduce(torch.ones(4))  # waits for rank 1 until torchrun ends this attempt
    say("UNREACHABLE", RANK)
train(RANK, SIZE)
tdist.destroy_process_group()
