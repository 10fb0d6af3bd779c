"""Subgroups of the smddp backend, on every rank: new_group, new_subgroups, DeviceMesh, HSDP.

Run by tests/torch/test_groups.py under mpirun (the ``mpi`` backend) and torchrun (``gloo``)::

    python tests/ranks/group_checks.py groups      # any world size >= 2
    python tests/ranks/group_checks.py hsdp        # 4 ranks: 2 x 2 DeviceMesh, FSDP2 HSDP
    python tests/ranks/group_checks.py debug       # 3 ranks, SMDDP_DEBUG=1: errors name global ranks
    python tests/ranks/group_checks.py stall       # 3 ranks, SMDDP_TIMEOUT=3: the timeout names them too

Each rank builds every rank's inputs from seeds, so it knows each answer without
communicating; HSDP is compared with single-process training on the whole batch. Prints
``CHECK <rank> <name>`` per passed check, ``FAILED <rank> <name> <why>`` per failure, then
``PASSED <rank> <count>`` (exit 0) or ``FAILURES <rank> <count>`` (exit 1).
"""

from __future__ import annotations

import copy
import os
import sys
import time
import warnings

import torch
import torch.distributed as tdist
import torch.nn.functional as F
from checklist import Checklist
from torch import nn

import smddp
import smddp.torch.distributed as dist
from smddp.torch import groups as smddp_groups

warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", category=UserWarning)
dist.init_process_group()
rank, size = tdist.get_rank(), tdist.get_world_size()
R = tdist.ReduceOp
checklist = Checklist(rank)
check = checklist.check


def same(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    ok = got.shape == want.shape and got.dtype == want.dtype and torch.equal(got, want)
    check(name, ok, f"got {got.flatten()[:6].tolist()} {tuple(got.shape)}, want {want.flatten()[:6].tolist()}")


def raises(name: str, call) -> None:
    try:
        call()
    except smddp.SMDDPError as exc:
        check(name, isinstance(exc, ValueError), repr(exc))
        return
    except Exception as exc:  # noqa: BLE001 - reported as a failed check
        check(name, False, f"raised {exc!r}, not an smddp ValueError")
        return
    check(name, False, "did not raise")


def rows(shape, salt: int) -> torch.Tensor:
    """Every global rank's input, row r for rank r (integers: sums are exact in any order)."""
    g = torch.Generator().manual_seed(7919 * salt + 17)
    return torch.randint(-9, 10, (size, *shape), generator=g, dtype=torch.int64).to(torch.float32)


def partitions():
    """Disjoint groups covering the world: even ranks and odd ranks."""
    return [list(range(0, size, 2)), list(range(1, size, 2))]


# ============================================================================ groups
def group_collectives(group, members, label: str) -> None:
    """Every collective on ``group`` (members: its global ranks, in group-rank order)."""
    me = members.index(rank)
    n = len(members)
    check(f"{label}: rank and size", (tdist.get_rank(group), tdist.get_world_size(group)) == (me, n),
          f"{tdist.get_rank(group)}/{tdist.get_world_size(group)}")
    check(f"{label}: backend name", tdist.get_backend(group) == "smddp", tdist.get_backend(group))
    x = rows((5,), 1)
    mine = x[members]
    for name, op, want in (("sum", R.SUM, mine.sum(0)), ("max", R.MAX, mine.max(0).values),
                           ("min", R.MIN, mine.min(0).values)):
        t = x[rank].clone()
        tdist.all_reduce(t, op=op, group=group)
        same(f"{label}: all_reduce {name}", t, want)
    t = x[rank].clone()
    tdist.broadcast(t, group=group, group_src=n - 1)
    same(f"{label}: broadcast from the last member", t, x[members[-1]])
    outs = [torch.empty(5) for _ in range(n)]
    tdist.all_gather(outs, x[rank].clone(), group=group)
    same(f"{label}: all_gather", torch.stack(outs), mine)
    out = torch.empty(n * 5)
    tdist.all_gather_into_tensor(out, x[rank].clone(), group=group)
    same(f"{label}: all_gather_into_tensor", out, mine.flatten())
    big = rows((n * 3,), 2)
    out = torch.empty(3)
    tdist.reduce_scatter_tensor(out, big[rank].clone(), group=group)
    same(f"{label}: reduce_scatter_tensor", out, big[members].sum(0)[me * 3:(me + 1) * 3])
    out = torch.empty(3)
    tdist.reduce_scatter(out, [c.clone() for c in big[rank].chunk(n)], group=group)
    same(f"{label}: reduce_scatter (list form)", out, big[members].sum(0)[me * 3:(me + 1) * 3])
    # argument errors raise on every rank before anything is sent: the next collective is in step
    raises(f"{label}: reduce_scatter refuses a wrong number of inputs",
           lambda: tdist.reduce_scatter(torch.empty(3), [torch.zeros(3)] * (n + 1), group=group))
    raises(f"{label}: all_gather_coalesced refuses a wrong number of output lists",
           lambda: tdist.all_gather_coalesced([[torch.empty(5)]] * (n + 1), [x[rank].clone()], group=group))
    t = x[rank].clone()
    tdist.reduce(t, group=group, group_dst=0)
    if me == 0:
        same(f"{label}: reduce to the first member", t, mine.sum(0))
    gathered = [torch.empty(5) for _ in range(n)] if me == 0 else None
    tdist.gather(x[rank].clone(), gathered, group=group, group_dst=0)
    if me == 0:
        same(f"{label}: gather", torch.stack(gathered), mine)
    pieces = rows((n, 4), 3)
    out = torch.empty(4)
    tdist.scatter(out, list(pieces[members[-1]]) if me == n - 1 else None, group=group, group_src=n - 1)
    same(f"{label}: scatter from the last member", out, pieces[members[-1]][me])
    a2a = rows((n, 2), 4)
    outs = [torch.empty(2) for _ in range(n)]
    tdist.all_to_all(outs, [c.clone() for c in a2a[rank]], group=group)
    same(f"{label}: all_to_all (list form)", torch.stack(outs), a2a[members][:, me])
    out = torch.empty(n * 2)
    tdist.all_to_all_single(out, a2a[rank].flatten().clone(), group=group)
    same(f"{label}: all_to_all_single", out, a2a[members][:, me].flatten())
    # coalesced: two tensors of different shapes in one call
    y = rows((2, 3), 5)
    ts = [x[rank].clone(), y[rank].clone()]
    tdist.all_reduce_coalesced(ts, group=group)
    same(f"{label}: all_reduce_coalesced", torch.cat([ts[0], ts[1].flatten()]),
         torch.cat([mine.sum(0), y[members].sum(0).flatten()]))
    outs = [[torch.empty(5), torch.empty(2, 3)] for _ in range(n)]
    tdist.all_gather_coalesced(outs, [x[rank].clone(), y[rank].clone()], group=group)
    same(f"{label}: all_gather_coalesced", torch.stack([o[1] for o in outs]), y[members])
    # objects
    objs = [None] * n
    tdist.all_gather_object(objs, {"rank": rank, "word": "x" * rank}, group=group)
    check(f"{label}: all_gather_object", objs == [{"rank": r, "word": "x" * r} for r in members], str(objs))
    box = [("from", members[0])] if me == 0 else [None]
    tdist.broadcast_object_list(box, group=group, group_src=0)
    check(f"{label}: broadcast_object_list", box == [("from", members[0])], str(box))
    got = [None]
    tdist.scatter_object_list(got, [f"to {r}" for r in members] if me == 0 else None, group=group, group_src=0)
    check(f"{label}: scatter_object_list", got == [f"to {rank}"], str(got))
    # point-to-point in the group: a ring by group rank
    right, left = members[(me + 1) % n], members[(me - 1) % n]
    if n > 1:
        inbox = torch.empty(5)
        works = tdist.batch_isend_irecv([tdist.P2POp(tdist.isend, x[rank].clone(), right, group),
                                         tdist.P2POp(tdist.irecv, inbox, left, group)])
        for w in works:
            w.wait()
        same(f"{label}: batch_isend_irecv ring", inbox, x[left])
    tdist.barrier(group=group)
    check(f"{label}: barrier", True)


def interleaved(group, members, label: str) -> None:
    """Asynchronous operations on the world and a subgroup, waited in reverse order."""
    x = rows((4,), 6)
    w_t, g_t = x[rank].clone(), x[rank].clone()
    works = [tdist.all_reduce(w_t, async_op=True), tdist.all_reduce(g_t, group=group, async_op=True)]
    for w in reversed(works):
        w.wait()
    same(f"{label}: world all_reduce beside it", w_t, x.sum(0))
    same(f"{label}: its all_reduce beside the world's", g_t, x[members].sum(0))


def groups() -> None:
    engine = smddp_groups.current().engine
    full = tdist.new_group(list(range(size)))
    group_collectives(full, list(range(size)), "new_group(all ranks)")
    check("the full group has its own engine", full.engine is not engine and full.engine.seq > 0
          and full.engine.global_ranks == list(range(size)), "")
    mine, subgroups = tdist.new_subgroups_by_enumeration(partitions())
    members = [p for p in partitions() if rank in p][0]
    interleaved(mine, members, f"new_subgroups {members}")
    if len(members) > 1:
        group_collectives(mine, members, f"new_subgroups {members}")
    else:
        t = torch.tensor([float(rank)])
        tdist.all_reduce(t, group=mine)
        same("a group of one: all_reduce is the identity", t, torch.tensor([float(rank)]))
    # new_group's non-members: torch hands them NON_GROUP_MEMBER and nothing is created
    first_two = tdist.new_group([0, 1])
    if rank in (0, 1):
        group_collectives(first_two, [0, 1], "new_group([0, 1])")
        group_engine = first_two.engine
        tdist.destroy_process_group(first_two)
        check("destroy_process_group(group) closes the group's engine", group_engine._closed, "still open")
    else:
        check("new_group: a non-member gets NON_GROUP_MEMBER",
              first_two == tdist.GroupMember.NON_GROUP_MEMBER, repr(first_two))
    t = torch.ones(1)
    tdist.all_reduce(t, group=full)
    same("the other groups work on after one is destroyed", t, torch.full((1,), float(size)))
    # smddp's own functions keep the reference's rule
    try:
        dist.all_reduce(torch.zeros(1), group=full)
        check("smddp's v1 all_reduce refuses a subgroup", False, "no error")
    except smddp.SMDDPError as exc:
        check("smddp's v1 all_reduce refuses a subgroup", "group.WORLD" in str(exc), str(exc))
    # DeviceMesh over smddp, sliced
    if size % 2 == 0:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, size // 2), mesh_dim_names=("replicate", "shard"))
        shard = mesh["shard"].get_group()
        replicate = mesh["replicate"].get_group()
        width = size // 2
        shard_members = [r for r in range(size) if r // width == rank // width]
        replicate_members = [r for r in range(size) if r % width == rank % width]
        check("DeviceMesh: its groups are smddp's",
              tdist.get_backend(shard) == "smddp" and tdist.get_backend(replicate) == "smddp",
              f"{tdist.get_backend(shard)} {tdist.get_backend(replicate)}")
        x = rows((3,), 7)
        t, u = x[rank].clone(), x[rank].clone()
        tdist.all_reduce(t, group=shard)
        tdist.all_reduce(u, group=replicate)
        same("DeviceMesh['shard']: all_reduce over its row", t, x[shard_members].sum(0))
        same("DeviceMesh['replicate']: all_reduce over its column", u, x[replicate_members].sum(0))
    tdist.barrier()


# ============================================================================ HSDP
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


STEPS, PER_RANK = 3, 2


def hsdp() -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    torch.manual_seed(0)
    initial = Net()
    g = torch.Generator().manual_seed(2024)
    data = [(torch.randn(PER_RANK * size, 6, generator=g), torch.randn(PER_RANK * size, 3, generator=g))
            for _ in range(STEPS)]

    def train(model, shard: bool):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for x, y in data:
            if shard:
                x, y = x[rank * PER_RANK:(rank + 1) * PER_RANK], y[rank * PER_RANK:(rank + 1) * PER_RANK]
            optimizer.zero_grad()
            F.mse_loss(model(x), y).backward()
            optimizer.step()

    reference = copy.deepcopy(initial)
    train(reference, shard=False)
    mesh = init_device_mesh("cpu", (2, size // 2), mesh_dim_names=("replicate", "shard"))
    model = copy.deepcopy(initial)
    fully_shard(model.fc1, mesh=mesh)
    fully_shard(model.fc2, mesh=mesh)
    fully_shard(model, mesh=mesh)
    engines = [mesh[d].get_group().engine for d in ("replicate", "shard")]
    before = [e.seq for e in engines]
    train(model, shard=True)
    check("HSDP: both mesh dimensions' groups ran collectives",
          all(e.seq > b for e, b in zip(engines, before)), f"{before} -> {[e.seq for e in engines]}")
    for name, p in model.named_parameters():
        full = p.full_tensor() if isinstance(p, DTensor) else p
        want = dict(reference.named_parameters())[name].detach()
        ok = torch.allclose(full.detach(), want, rtol=1e-5, atol=1e-6)
        check(f"HSDP (replicate x shard) equals whole-batch training: {name}", ok,
              f"max diff {(full.detach() - want).abs().max().item():.3g}")
    tdist.barrier()


# ============================================================================ debug
def debug() -> None:
    """SMDDP_DEBUG=1 in the group of global ranks 1 and 2: the mismatch names global ranks."""
    group = tdist.new_group([1, 2])
    if rank in (1, 2):
        try:
            tdist.all_reduce(torch.zeros(2 + rank), group=group)
            check("SMDDP_DEBUG: a mismatch in a subgroup raises", False, "no error")
        except smddp.SMDDPError as exc:
            text = str(exc)
            check("SMDDP_DEBUG: the mismatch names the group and its global ranks",
                  "global ranks 1-2" in text and "rank 1:" in text and "rank 2:" in text, text)


def stall() -> None:
    """In the group of global ranks 1 and 2, rank 2 never calls: rank 1's timeout names global ranks.

    Rank 1 made one group more than rank 2 before it (ranks 0 and 1): the ranks' counts of
    groups differ, and rank 2 must still be found alive and not started, not "not answering".
    """
    tdist.new_group([0, 1])
    group = tdist.new_group([1, 2])
    if rank == 1:
        try:
            tdist.all_reduce(torch.zeros(2), group=group)
            check("a stalled subgroup collective times out", False, "no error")
        except smddp.CollectiveTimeout as exc:
            text = str(exc)
            check("the timeout names the group, global ranks, and the rank that never arrived",
                  "on rank 1 (rank 0 of the 2 in process group" in text and "global ranks 1-2" in text
                  and "never arrived: 2" in text and "Rank 2 has not started any collective yet" in text
                  and "did not answer" not in text, text)
    elif rank == 2:
        time.sleep(float(os.environ["SMDDP_TIMEOUT"]) + 5)  # answers rank 1's question meanwhile


if __name__ == "__main__":
    for mode in sys.argv[1:]:
        {"groups": groups, "hsdp": hsdp, "debug": debug, "stall": stall}[mode]()
    if checklist.summary():
        sys.exit(1)
    if not {"debug", "stall"} & set(sys.argv[1:]):
        dist.destroy_process_group()
