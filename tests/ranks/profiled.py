"""The same collectives and DDP steps under torch.profiler, on gloo or on smddp (torchrun -np 2).

``python profiled.py BACKEND OUTDIR``: each rank profiles, with shapes, a loop of
``torch.distributed`` collectives and two steps of torch's DDP (and, on smddp, two of smddp's
own DDP), checks that every result is right (expected values computed locally from seeded
per-rank inputs), and writes ``OUTDIR/<backend>-<rank>.json``: the communication events
that ``prof.events()`` holds (name, input shapes) and those of the chrome trace (name,
category, "Input Dims", duration). tests/torch/test_profiler.py compares gloo's with smddp's.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

backend, outdir = sys.argv[1], sys.argv[2]
if backend == "smddp":
    import smddp.torch.torch_smddp  # noqa: F401 - registers the backend

dist.init_process_group(backend)
rank, size = dist.get_rank(), dist.get_world_size()
PREFIXES = ("c10d::", f"{backend}:")
failures = []


def seeded(r: int, shape, salt: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * salt + r)
    return torch.randint(-8, 9, shape, generator=g).float()


def expect(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    if not torch.equal(got, want):
        failures.append(name)


def collectives() -> None:
    t = seeded(rank, (5, 3), 1)
    dist.all_reduce(t)
    expect("all_reduce", t, sum(seeded(r, (5, 3), 1) for r in range(size)))
    t = seeded(rank, (7,), 2)
    dist.all_reduce(t, async_op=True).wait()
    expect("all_reduce async", t, sum(seeded(r, (7,), 2) for r in range(size)))
    t = seeded(rank, (4, 2), 3)
    dist.broadcast(t, 0)
    expect("broadcast", t, seeded(0, (4, 2), 3))
    outs = [torch.empty(6) for _ in range(size)]
    dist.all_gather(outs, seeded(rank, (6,), 4))
    expect("all_gather", torch.stack(outs), torch.stack([seeded(r, (6,), 4) for r in range(size)]))
    out = torch.empty(size * 3)
    dist.all_gather_into_tensor(out, seeded(rank, (3,), 5))
    expect("all_gather_into_tensor", out, torch.cat([seeded(r, (3,), 5) for r in range(size)]))
    dist.barrier()


def ddp_steps(make_ddp, salt: int) -> int:
    torch.manual_seed(0)
    model = make_ddp(torch.nn.Linear(8, 4))
    for step in range(2):
        model(seeded(rank, (2, 8), salt + step)).sum().backward()
    numel = sum(p.numel() for p in model.parameters())
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    mine = torch.tensor(grads.tolist())
    gathered = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(gathered, mine)
    expect(f"DDP gradients agree ({salt})", gathered[0], gathered[-1])
    return numel


def events_of(prof) -> dict:
    found = [{"name": e.name, "shapes": e.input_shapes} for e in prof.events() if e.name.startswith(PREFIXES)]
    path = os.path.join(outdir, f"trace-{backend}-{rank}.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        trace = json.load(f)["traceEvents"]
    os.remove(path)
    traced = [{"name": e["name"], "cat": e.get("cat"), "dims": e.get("args", {}).get("Input Dims"),
               "dur": e.get("dur")}
              for e in trace if e.get("ph") == "X" and e.get("name", "").startswith(PREFIXES)]
    return {"events": found, "trace": traced}


with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
    collectives()
    numel = ddp_steps(torch.nn.parallel.DistributedDataParallel, 10)
report = {"backend": backend, "rank": rank, "ddp_numel": numel, "torch_ddp": events_of(prof)}
if backend == "smddp":
    from smddp.torch.parallel import DistributedDataParallel

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        ddp_steps(DistributedDataParallel, 20)
    report["smddp_ddp"] = events_of(prof)
report["failures"] = failures
with open(os.path.join(outdir, f"{backend}-{rank}.json"), "w") as f:
    json.dump(report, f)
dist.destroy_process_group()
print(f"DONE {rank} {len(failures)} failures")
