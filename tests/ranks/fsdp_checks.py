"""FSDP2 and every public ``torch.distributed`` collective on the smddp group, on every rank.

Run by tests/torch/test_fsdp.py under mpirun -np 2/3 and plain python, and by
tests/torch/test_delegated.py with ``SMDDP_BACKEND=torch-gloo`` (the delegated route: CPU tensors
handed to torch's own gloo group, as a GPU job's device tensors are to torch's NCCL group)::

    python tests/ranks/fsdp_checks.py collectives train CHECKPOINT_DIR [delegated]

On the delegated route the same collectives must give the same values, through torch's backend
object (none through smddp's engine), with torch's own refusals; ``delegated`` adds smddp's v1
API, smddp's DDP class and the absence of the engine's threads on that route.

Each rank builds the inputs of *all* ranks from seeds, so it knows the exact answer without
communicating; the FSDP runs are compared with single-process training on the whole batch,
computed locally. Prints ``CHECK <rank> <name>`` per passed check, ``FAILED <rank> <name>
<why>`` per failure, then ``PASSED <rank> <count>`` (exit 0) or ``FAILURES <rank> <count>``.
"""

from __future__ import annotations

import copy
import sys
import threading
import warnings
from pathlib import Path

import torch
import torch.distributed as tdist
import torch.distributed._functional_collectives as funcol
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from checklist import Checklist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.fsdp import fully_shard

import smddp
import smddp.torch.distributed as dist
from smddp.torch import groups

warnings.filterwarnings("ignore", category=FutureWarning)  # torch 2.13 renames; the old names are tested
dist.init_process_group()
rank, size = tdist.get_rank(), tdist.get_world_size()
if torch.cuda.is_available():
    torch.cuda.set_device(dist.get_local_rank() % torch.cuda.device_count())
pg = tdist.distributed_c10d._get_default_group()
engine = groups.current().engine
#: The delegated route (SMDDP_BACKEND=torch-gloo): CPU tensors go to torch's own gloo object.
DELEGATED = groups.current().delegate is not None
#: Where smddp refuses an argument with its own error, torch's backend refuses with torch's.
TORCHS_REFUSAL = (RuntimeError, ValueError)
R = tdist.ReduceOp
checklist = Checklist(rank)
check = checklist.check


def same(name: str, got: torch.Tensor, want: torch.Tensor, rtol: float = 1e-6, atol: float = 1e-6) -> None:
    ok = got.shape == want.shape and got.dtype == want.dtype and torch.allclose(
        got.double(), want.double(), rtol=rtol, atol=atol)
    check(name, ok, f"got {got.flatten()[:6].tolist()} {tuple(got.shape)} {got.dtype}, "
                    f"want {want.flatten()[:6].tolist()} {tuple(want.shape)} {want.dtype}")


def raises(name: str, error, call) -> None:
    """``call()`` raises ``error`` (a type, or a tuple of them); on the delegated route, torch's refusal."""
    error = TORCHS_REFUSAL if DELEGATED else error
    what = " or ".join(e.__name__ for e in (error if isinstance(error, tuple) else (error,)))
    try:
        call()
    except error as exc:
        check(name, isinstance(exc, smddp.SMDDPError) or error is not smddp.SMDDPError, repr(exc))
        return
    except Exception as exc:  # noqa: BLE001 - reported as a failed check
        check(name, False, f"raised {exc!r}, not {what}")
        return
    check(name, False, f"did not raise {what}")


def stack(shape, dtype=torch.float32, salt: int = 0) -> torch.Tensor:
    """Every rank's input, row r for rank r (the same on every rank)."""
    g = torch.Generator().manual_seed(7919 * salt + 17)
    if dtype.is_floating_point:
        return torch.randn((size, *shape), generator=g, dtype=torch.float64).to(dtype)
    return torch.randint(-9, 10, (size, *shape), generator=g, dtype=torch.int64).to(dtype)


def reduced(rows: torch.Tensor, op) -> torch.Tensor:
    wide = rows.double() if rows.is_floating_point() else rows.long()
    if op == R.SUM:
        out = wide.sum(0)
    elif op == R.AVG:
        out = wide.sum(0) / size if rows.is_floating_point() else torch.div(wide.sum(0), size, rounding_mode="trunc")
    elif op == R.MIN:
        out = wide.min(0).values
    elif op == R.MAX:
        out = wide.max(0).values
    else:
        out = wide.prod(0)
    return out.to(rows.dtype)


OPS = {"sum": R.SUM, "avg": R.AVG, "min": R.MIN, "max": R.MAX, "product": R.PRODUCT}

def collectives() -> None:
    """Every public collective, direct and functional, against local expectations."""
    # ---------------------------------------------------------------------------- path checks
    seq = engine.seq
    work = tdist.all_reduce(torch.ones(3), async_op=True)
    work.wait()
    native = pg._get_backend(torch.device("cpu"))
    if DELEGATED:
        check("direct all_reduce takes torch's backend object, not smddp's engine",
              engine.seq == seq and type(work).__module__.startswith("torch."), f"seq {seq} -> {engine.seq}, {work!r}")
        check("the group's delegate is the gloo backend torch's C++ dispatch finds",
              native is groups.current().delegate.backend, repr(native))
    else:
        check("direct all_reduce takes smddp's communicator", engine.seq == seq + 1, f"seq {seq} -> {engine.seq}")
    check("a torch-native gloo backend serves cpu", isinstance(native, tdist.ProcessGroupGloo), repr(native))
    check("group name", pg.group_name == tdist.distributed_c10d._get_process_group_name(pg), pg.group_name)
    check("backend name", tdist.get_backend(pg) == "smddp", tdist.get_backend(pg))

    ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
    seq = engine.seq
    ddp(torch.randn(3, 4)).sum().backward()
    if DELEGATED:
        check("DDP's reducer hands its buckets to torch's backend", engine.seq == seq, f"seq {seq} -> {engine.seq}")
    else:
        check("DDP's reducer takes smddp's communicator", engine.seq > seq, f"seq {seq} -> {engine.seq}")

    # ---------------------------------------------------------------------------- all_reduce
    for name, op in OPS.items():
        for dtype in (torch.float32, torch.int64):
            if op == R.AVG and dtype == torch.int64:
                continue
            rows = stack((5,), dtype, salt=len(name))
            t = rows[rank].clone()
            tdist.all_reduce(t, op=op)
            same(f"all_reduce {name} {dtype}", t, reduced(rows, op), rtol=1e-5)
    raises("all_reduce PREMUL_SUM is refused", smddp.InvalidArgumentError,
           lambda: tdist.all_reduce(torch.ones(2), op=tdist._make_nccl_premul_sum(2.0)))
    raises("all_reduce BAND of floats is refused", smddp.InvalidTypeError,
           lambda: tdist.all_reduce(torch.ones(2), op=R.BAND))
    rows = stack((5,), torch.int64, salt=12)
    t, want = rows[rank].clone(), rows[0].clone()
    for row in rows[1:]:
        want &= row
    tdist.all_reduce(t, op=R.BAND)
    same("all_reduce BAND int64", t, want)

    rows = stack((2, 3), salt=11)
    t = rows[rank].clone().t()  # not contiguous
    work = tdist.all_reduce(t, async_op=True)
    work.wait()
    same("all_reduce async, non-contiguous", t, reduced(rows, R.SUM).t(), rtol=1e-5)
    same("all_reduce future value", work.get_future().wait()[0], reduced(rows, R.SUM).t(), rtol=1e-5)

    # ---------------------------------------------------------------------------- broadcast, gathers
    for root in range(size):
        rows = stack((4,), salt=20 + root)
        t = rows[rank].clone()
        tdist.broadcast(t, src=root)
        same(f"broadcast from {root}", t, rows[root])

    rows = stack((2, 3), salt=30)
    outs = [torch.empty(2, 3) for _ in range(size)]
    tdist.all_gather(outs, rows[rank])
    same("all_gather", torch.stack(outs), rows)
    out = torch.empty(size * 2, 3)
    tdist.all_gather_into_tensor(out, rows[rank])
    same("all_gather_into_tensor", out, rows.reshape(size * 2, 3))
    out = torch.empty(size * 2, 3, dtype=torch.bfloat16)
    tdist.all_gather_single(out, rows[rank].bfloat16())
    same("all_gather_single bfloat16", out, rows.reshape(size * 2, 3).bfloat16())

    for root in range(size):
        rows = stack((3,), salt=40 + root)
        gathered = [torch.empty(3) for _ in range(size)] if rank == root else None
        tdist.gather(rows[rank].clone(), gathered, dst=root)
        if rank == root:
            same(f"gather to {root}", torch.stack(gathered), rows)
        scattered = torch.empty(3)
        tdist.scatter(scattered, list(rows.unbind(0)) if rank == root else None, src=root)
        same(f"scatter from {root}", scattered, rows[rank])

    # ---------------------------------------------------------------------------- reductions to a slice / a root
    for name, op in OPS.items():
        rows = stack((size * 4,), salt=50 + len(name))
        out = torch.empty(4)
        tdist.reduce_scatter_tensor(out, rows[rank].clone(), op=op)
        same(f"reduce_scatter_tensor {name}", out, reduced(rows, op)[rank * 4:(rank + 1) * 4], rtol=1e-5)
        lists = stack((size, 2, 2), salt=60 + len(name))
        out = torch.empty(2, 2)
        tdist.reduce_scatter(out, list(lists[rank].unbind(0)), op=op)
        same(f"reduce_scatter {name}", out, reduced(lists, op)[rank], rtol=1e-5)
        for root in range(size):
            rows = stack((3,), salt=70 + root + len(name))
            t = rows[rank].clone()
            tdist.reduce(t, dst=root, op=op)
            if rank == root:
                same(f"reduce {name} to {root}", t, reduced(rows, op), rtol=1e-5)
    rows = stack((size * 8,), salt=80)
    out = torch.empty(8, dtype=torch.bfloat16)
    tdist.reduce_scatter_single(out, rows[rank].bfloat16(), op=R.SUM)
    want = reduced(rows.bfloat16().float(), R.SUM)[rank * 8:(rank + 1) * 8].bfloat16()
    same("reduce_scatter_single bfloat16", out, want, rtol=1e-2, atol=1e-2)
    raises("reduce_scatter_tensor with a wrong size is refused", smddp.InvalidArgumentError,
           lambda: tdist.reduce_scatter_tensor(torch.empty(3), torch.empty(size * 3 + 1)))

    # ---------------------------------------------------------------------------- all-to-all
    # rank i sends (i + j + 1) rows of 2 to rank j
    send_rows = [rank + j + 1 for j in range(size)]
    recv_rows = [j + rank + 1 for j in range(size)]
    blocks = {(i, j): stack((i + j + 1, 2), salt=100 + i * size + j)[0] for i in range(size) for j in range(size)}
    inp = torch.cat([blocks[(rank, j)] for j in range(size)])
    out = torch.empty(sum(recv_rows), 2)
    tdist.all_to_all_single(out, inp, recv_rows, send_rows)
    same("all_to_all_single uneven splits", out, torch.cat([blocks[(j, rank)] for j in range(size)]))
    if DELEGATED:  # torch's gloo takes lists of equal tensors only (its own refusal otherwise)
        blocks = {(i, j): stack((2, 2), salt=110 + i * size + j)[0] for i in range(size) for j in range(size)}
    outs = [torch.empty_like(blocks[(j, rank)]) for j in range(size)]
    tdist.all_to_all(outs, [blocks[(rank, j)].clone() for j in range(size)])
    same("all_to_all lists", torch.cat(outs), torch.cat([blocks[(j, rank)] for j in range(size)]))

    # ---------------------------------------------------------------------------- coalesced
    rows = [stack((3,), salt=120 + k) for k in range(3)]
    ts = [r[rank].clone() for r in rows]
    with tdist._coalescing_manager(async_ops=True) as cm:
        for t in ts:
            tdist.all_reduce(t)
    cm.wait()
    same("coalesced all_reduce", torch.stack(ts), torch.stack([reduced(r, R.SUM) for r in rows]), rtol=1e-5)
    outs = [torch.empty(size * 3) for _ in rows]
    with tdist._coalescing_manager():
        for o, r in zip(outs, rows):
            tdist.all_gather_single(o, r[rank])
    same("coalesced all_gather_single", torch.stack(outs), torch.stack([r.reshape(-1) for r in rows]))
    big = [stack((size * 2,), salt=130 + k) for k in range(2)]
    outs = [torch.empty(2) for _ in big]
    with tdist._coalescing_manager():
        for o, r in zip(outs, big):
            tdist.reduce_scatter_single(o, r[rank].clone(), op=R.AVG)
    same("coalesced reduce_scatter_single", torch.stack(outs),
         torch.stack([reduced(r, R.AVG)[rank * 2:(rank + 1) * 2] for r in big]), rtol=1e-5)

    # ---------------------------------------------------------------------------- point-to-point
    if size > 1:
        right, left = (rank + 1) % size, (rank - 1) % size
        msgs = stack((4,), salt=140)
        got = torch.empty(4)
        reqs = [tdist.isend(msgs[rank].clone(), right, tag=3), tdist.irecv(got, left, tag=3)]
        for req in reqs:
            req.wait()
        same("isend/irecv ring", got, msgs[left])
        got = torch.empty(4, dtype=torch.float64)
        if rank == 0:
            sources = set()
            for _ in range(size - 1):
                sources.add(tdist.recv(got, tag=5))
            check("recv from any source", sources == set(range(1, size)), str(sources))
        else:
            tdist.send(torch.full((4,), float(rank), dtype=torch.float64), 0, tag=5)
        got = torch.empty(4)
        ops = [tdist.P2POp(tdist.isend, msgs[rank].clone() * 2, right), tdist.P2POp(tdist.irecv, got, left)]
        for req in tdist.batch_isend_irecv(ops):
            req.wait()
        same("batch_isend_irecv", got, msgs[left] * 2)

    # ---------------------------------------------------------------------------- objects, barrier
    objs = [None] * size
    tdist.all_gather_object(objs, {"rank": rank, "word": "x" * rank})
    check("all_gather_object", objs == [{"rank": r, "word": "x" * r} for r in range(size)], str(objs))
    items = [f"from {rank}", rank] if rank == 0 else [None, None]
    tdist.broadcast_object_list(items, src=0)
    check("broadcast_object_list", items == ["from 0", 0], str(items))
    gathered = [None] * size if rank == 0 else None
    tdist.gather_object(("r", rank), gathered, dst=0)
    check("gather_object", rank != 0 or gathered == [("r", r) for r in range(size)], str(gathered))
    got = [None]
    tdist.scatter_object_list(got, [{"to": r} for r in range(size)] if rank == 0 else None, src=0)
    check("scatter_object_list", got == [{"to": rank}], str(got))
    tdist.barrier()
    check("barrier", True)

    # ---------------------------------------------------------------------------- functional collectives
    rows = stack((2,), salt=150)
    got = funcol.all_gather_tensor(rows[rank].clone(), 0, pg).wait()
    same("functional all_gather_tensor", got, rows.reshape(-1))
    got = funcol.all_reduce(rows[rank].clone(), "sum", pg).wait()
    same("functional all_reduce", got, reduced(rows, R.SUM), rtol=1e-5)
    rows = stack((size * 2,), salt=160)
    got = funcol.reduce_scatter_tensor(rows[rank].clone(), "sum", 0, pg).wait()
    same("functional reduce_scatter_tensor", got, reduced(rows, R.SUM)[rank * 2:(rank + 1) * 2], rtol=1e-5)



class Net(nn.Module):
    """Seed 004's CNN, smaller: two convolutions, max-pool, two linear layers."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3)
        self.conv2 = nn.Conv2d(4, 8, 3)
        self.fc1 = nn.Linear(8 * 4 * 4, 16)
        self.fc2 = nn.Linear(16, 10)  # 10 rows: uneven shards on 3 ranks

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2)
        return F.log_softmax(self.fc2(F.relu(self.fc1(torch.flatten(x, 1)))), dim=1)


STEPS, PER_RANK = 3, 4


def batches():
    """The whole batch of every step (the same on every rank)."""
    g = torch.Generator().manual_seed(2024)
    n = PER_RANK * size
    return [(torch.randn(n, 1, 12, 12, generator=g), torch.randint(0, 10, (n,), generator=g)) for _ in range(STEPS)]


def train(model: nn.Module, data, shard: bool) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in data:
        if shard:
            x, y = x[rank * PER_RANK:(rank + 1) * PER_RANK], y[rank * PER_RANK:(rank + 1) * PER_RANK]
        optimizer.zero_grad()
        F.nll_loss(model(x), y).backward()
        optimizer.step()


def sharded(model: nn.Module, per_layer: bool) -> nn.Module:
    if per_layer:
        for layer in (model.conv1, model.conv2, model.fc1, model.fc2):
            fully_shard(layer)
    fully_shard(model)
    return model


def full_state(model: nn.Module) -> dict:
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


def same_state(name: str, got: dict, want: dict) -> None:
    bad = [k for k in want if k not in got or not torch.allclose(got[k], want[k], rtol=1e-4, atol=1e-6)]
    check(name, sorted(got) == sorted(want) and not bad,
          f"keys {sorted(got)} vs {sorted(want)}; differ: {bad[:3]} "
          + (f"max diff {(got[bad[0]] - want[bad[0]]).abs().max().item():.3g}" if bad and bad[0] in got else ""))


def training(directory: Path) -> None:
    """fully_shard on each rank's shard equals one process on the whole batch; checkpoints load."""
    torch.manual_seed(0)
    initial = Net()
    data = batches()
    reference = copy.deepcopy(initial)
    train(reference, data, shard=False)
    want = {k: v.detach() for k, v in reference.state_dict().items()}
    seq = engine.seq
    for per_layer in (True, False):
        model = sharded(copy.deepcopy(initial), per_layer)
        train(model, data, shard=True)
        same_state(f"fully_shard {'per layer and root' if per_layer else 'root only'} equals whole-batch training",
                   full_state(model), want)
    if DELEGATED:
        check("FSDP2's all-gathers and reduce-scatters take torch's backend", engine.seq == seq,
              f"seq {seq} -> {engine.seq}")
    else:
        check("FSDP2's all-gathers and reduce-scatters take smddp's communicator",
              size == 1 or engine.seq > seq + 2 * STEPS, f"seq {seq} -> {engine.seq}")
    # torch.compile over fully_shard (torchtitan's way): dynamo traces FSDP2's hooks and the
    # collectives they start; smddp's group methods run unseen, as C++ would
    torch.compiler.reset()
    compiled = sharded(copy.deepcopy(initial), per_layer=True)
    train(torch.compile(compiled, backend="aot_eager"), data, shard=True)
    same_state("torch.compile over fully_shard equals whole-batch training", full_state(compiled), want)

    # sharded checkpoint: torch.distributed.checkpoint, then load into differently initialised shards
    path = directory / f"sharded-{size}"
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=str(path))
    torch.manual_seed(1)
    loaded = sharded(Net(), per_layer=False)
    state = {"model": get_model_state_dict(loaded)}
    dcp.load(state, checkpoint_id=str(path))
    set_model_state_dict(loaded, state["model"])
    same_state("sharded checkpoint saves and loads (torch.distributed.checkpoint)", full_state(loaded), want)

    # full checkpoint: rank 0 saves after a barrier; loads broadcast from rank 0
    full = full_state(model)
    tdist.barrier()
    file = directory / f"full-{size}.pt"
    if rank == 0:
        torch.save(full, file)
    tdist.barrier()
    torch.manual_seed(2)
    loaded = sharded(Net(), per_layer=True)
    state = torch.load(file, weights_only=True) if rank == 0 else {}
    set_model_state_dict(loaded, state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    same_state("full checkpoint saves on rank 0 and loads by broadcast", full_state(loaded), want)


def cuda_training() -> None:
    """FSDP1 (``FullyShardedDataParallel``, GPU only) and FSDP2 on CUDA equal whole-batch training."""
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    initial = Net().to(device)
    data = [(x.to(device), y.to(device)) for x, y in batches()]
    reference = copy.deepcopy(initial)
    train(reference, data, shard=False)
    want = {k: v.detach().cpu() for k, v in reference.state_dict().items()}

    model = FSDP(copy.deepcopy(initial), device_id=device, auto_wrap_policy=ModuleWrapPolicy({nn.Conv2d, nn.Linear}))
    train(model, data, shard=True)
    config = FullStateDictConfig(offload_to_cpu=True, rank0_only=False)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, config):
        got = {k: v.cpu() for k, v in model.state_dict().items()}
    same_state("FSDP1 on CUDA equals whole-batch training", got, want)

    model = sharded(copy.deepcopy(initial), per_layer=True)
    train(model, data, shard=True)
    same_state("fully_shard on CUDA equals whole-batch training",
               {k: v.cpu() for k, v in full_state(model).items()}, want)


def delegated() -> None:
    """On the delegated route: smddp's v1 API and DDP class through torch's backend, and no engine thread."""
    from smddp.comm.engine import Handle
    from smddp.torch.parallel.distributed import DistributedDataParallel

    seq = engine.seq
    rows = stack((5,), salt=200)
    t = rows[rank].clone()
    dist.all_reduce(t, op=dist.ReduceOp.AVERAGE)
    same("v1 all_reduce AVERAGE", t, reduced(rows, R.AVG), rtol=1e-5)
    t = rows[rank].clone()
    work = dist.all_reduce(t, op=dist.ReduceOp.MAX, async_op=True)
    check("v1 asynchronous all_reduce returns torch's Work", not isinstance(work, Handle) and work.wait() is True,
          repr(work))
    same("v1 all_reduce MAX", t, reduced(rows, R.MAX))
    t = rows[rank].clone()
    dist.broadcast(t, src=size - 1)
    same("v1 broadcast", t, rows[size - 1])
    outs = [torch.empty(5) for _ in range(size)]
    dist.all_gather(outs, rows[rank])
    same("v1 all_gather", torch.stack(outs), rows)
    send_rows = [rank + j + 1 for j in range(size)]
    recv_rows = [j + rank + 1 for j in range(size)]
    blocks = {(i, j): stack((i + j + 1, 2), salt=210 + i * size + j)[0] for i in range(size) for j in range(size)}
    out = torch.empty(sum(recv_rows), 2)
    dist.all_to_all_single(out, torch.cat([blocks[(rank, j)] for j in range(size)]), recv_rows, send_rows)
    same("v1 all_to_all_single uneven splits", out, torch.cat([blocks[(j, rank)] for j in range(size)]))
    dist.barrier()
    raises("v1 broadcast from a rank out of range is refused before anything is sent", smddp.InvalidArgumentError,
           lambda: dist.broadcast(torch.ones(2), src=size))
    check("the v1 API reaches torch's backend, not smddp's engine", engine.seq == seq, f"seq {seq} -> {engine.seq}")
    check("get_backend() names the delegated route", dist.get_backend() == "torch-gloo", dist.get_backend())

    # smddp's DDP class: each rank's shard, gradients averaged by torch's gloo, equals one process on the batch
    torch.manual_seed(0)
    initial = Net()
    data = batches()
    reference = copy.deepcopy(initial)
    train(reference, data, shard=False)
    model = DistributedDataParallel(copy.deepcopy(initial))
    train(model, data, shard=True)
    same_state("smddp's DDP class on torch's backend equals whole-batch training",
               {k: v.detach() for k, v in model.module.state_dict().items()},
               {k: v.detach() for k, v in reference.state_dict().items()})
    check("smddp's DDP class takes torch's backend", engine.seq == seq, f"seq {seq} -> {engine.seq}")
    # a subgroup: its own torch backend object, over the subgroup's store
    from smddp.torch.delegating_group import DelegatingProcessGroup

    members = [r for r in range(size) if r % 2 == 0]
    evens = tdist.new_group(members, backend="smddp")
    if rank in members:
        sub_rows = stack((3,), salt=220)[members]
        t = sub_rows[members.index(rank)].clone()
        tdist.all_reduce(t, group=evens)
        same("a subgroup's all_reduce", t, sub_rows.sum(0), rtol=1e-5)
        check("a subgroup delegates through a torch backend of its own",
              isinstance(evens, DelegatingProcessGroup)
              and evens.delegate.backend is not groups.current().delegate.backend
              and evens.delegate.backend.size() == len(members), repr(evens))
        tdist.destroy_process_group(evens)
    started = sorted(t.name for t in threading.enumerate() if t.name.startswith(("smddp-progress", "smddp-completion")))
    check("no progress or completion thread of smddp's engine ran on the delegated route", not started, str(started))


parts = sys.argv[1:] or ["collectives"]
if "collectives" in parts:
    collectives()
if "train" in parts:
    training(Path(parts[parts.index("train") + 1]))
if "delegated" in parts:
    delegated()
if "cuda" in parts:
    cuda_training()

status = checklist.summary()
dist.destroy_process_group()
# ``pg`` and ``engine`` stay referenced to the end on purpose: a group object alive while the
# interpreter finalizes must not abort the process.
sys.exit(status)
