"""``torch.compile`` over DDP on every rank, variant by variant: ``compile_checks.py BACKEND [KIND ...]``.

BACKEND is the ``torch.distributed`` backend to run on: ``smddp`` or ``gloo`` (the reference:
torch's DDP, with the arguments smddp's class passes for smddp's variants). KIND picks the DDP
classes: ``torch`` (torch's DDP, and compiled autograd over it) and ``smddp`` (smddp's own
class); both by default. Each
variant trains a fresh, seeded model ``STEPS`` steps as ``torch.compile(DDP(model))`` on per-rank
seeded data, in buckets small enough that ``optimize_ddp`` splits the graph at them: either DDP
class, ``torch._dynamo.config.optimize_ddp`` on and off, dynamo backends ``eager``, ``aot_eager``
and, where a C++ compiler is on PATH, ``inductor``; with ``eager``, a compiled training step
(``backward()`` inside it); and torch's DDP under compiled autograd (``backward()`` compiled too,
``optimize_ddp="python_reducer"``: DDP's reducer in Python, its all-reduces torch's functional
collectives on the group). Every rank prints ``COMPILE <rank> <variant> <compiled forwards>
<smddp's hook> <digest before> <digest after>`` (parameter digests); the test compares them with a
gloo job's, bit for bit. The bucket rebuild of the second step is where dynamo used to trace a
Python group's methods (and fail): STEPS is above 2.
"""

from __future__ import annotations

import shutil
import sys

import torch
import torch.distributed as tdist
from checklist import say
from param_digest import digest
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

torch.set_num_threads(1)

import smddp.torch.torch_smddp  # noqa: E402,F401 - registers the "smddp" backend

STEPS = 4
BUCKET_CAP_MB = 1  # the least optimize_ddp takes (its first bucket's); Net's 2.1 MB make 3 buckets
DYNAMO_BACKENDS = ("eager", "aot_eager") + (("inductor",) if shutil.which("g++") else ())

#: Forwards that ran through dynamo's compiled code (Net.forward adds one when traced).
COMPILED = [0]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(8, 256), nn.Tanh(), nn.Linear(256, 1024), nn.Tanh(),
                                    nn.Linear(1024, 256), nn.Tanh(), nn.Linear(256, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            COMPILED[0] += 1  # a side effect of the compiled code, replayed at every compiled call
        return self.layers(x)


def wrap(kind: str, model: nn.Module) -> nn.Module:
    if kind == "torch":
        return TorchDDP(model, bucket_cap_mb=BUCKET_CAP_MB)
    if tdist.get_backend() == "smddp":
        from smddp.torch.parallel import DistributedDataParallel

        return DistributedDataParallel(model, bucket_cap_mb=BUCKET_CAP_MB)
    return TorchDDP(model, bucket_cap_mb=BUCKET_CAP_MB, gradient_as_bucket_view=True)  # as smddp's class


def train(kind: str, optimize_ddp, dynamo_backend: str, whole_step: bool = False) -> str:
    """Train a fresh model; ``whole_step``: compile the step (forward and ``backward()``), not the model;
    ``optimize_ddp="python_reducer"``: ``backward()`` under compiled autograd."""
    torch.compiler.reset()  # every variant compiles afresh, far from dynamo's recompile limit
    torch.manual_seed(0)
    with torch._dynamo.config.patch(optimize_ddp=optimize_ddp):  # DDP reads "python_reducer" as it is made
        model = wrap(kind, Net())
    before = digest(model.module)
    compiled = torch.compile(model, backend=dynamo_backend)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        # backward() breaks the graph: DDP's reducer then calls the group (and its hook) under dynamo's hook
        nn.functional.mse_loss(model(x), y).backward()

    if whole_step:
        step = torch.compile(step, backend=dynamo_backend)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(100 + RANK)
    COMPILED[0] = 0
    with torch._dynamo.config.patch(optimize_ddp=optimize_ddp):
        for _ in range(STEPS):
            x, y = torch.randn(4, 8, generator=data), torch.randn(4, 4, generator=data)
            optimizer.zero_grad()
            if whole_step:
                step(x, y)
            elif optimize_ddp == "python_reducer":
                loss = nn.functional.mse_loss(compiled(x), y)
                with torch._dynamo.compiled_autograd._enable(torch.compile(backend=dynamo_backend)):
                    loss.backward()
            else:
                nn.functional.mse_loss(compiled(x), y).backward()
            optimizer.step()
    hook = getattr(model, "_smddp_hook", "-")  # smddp's class: its communication hook, "on" on the shm plane
    return f"{COMPILED[0]} {hook} {before} {digest(model.module)}"


tdist.init_process_group(sys.argv[1])
RANK = tdist.get_rank()
say(f"BACKEND {RANK} {tdist.get_backend()} {type(tdist.group.WORLD).__name__}")
KINDS = sys.argv[2:] or ["torch", "smddp"]
for kind in KINDS:
    for optimize_ddp in (True, False):
        for dynamo_backend in DYNAMO_BACKENDS:
            variant = f"{kind}-ddp/optimize_ddp={optimize_ddp}/{dynamo_backend}"
            say(f"COMPILE {RANK} {variant} {train(kind, optimize_ddp, dynamo_backend)}")
    say(f"COMPILE {RANK} {kind}-ddp/whole-step/eager {train(kind, True, 'eager', whole_step=True)}")
if "torch" in KINDS:
    say(f"COMPILE {RANK} torch-ddp/compiled-autograd/eager {train('torch', 'python_reducer', 'eager')}")
tdist.destroy_process_group()
