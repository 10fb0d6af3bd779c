"""smddp's DistributedDataParallel, checked on every rank of an ``mpirun``/``torchrun`` job.

Each check prints ``OK <rank> <name>``; a failed check raises, and the launcher ends the job.
Expected values come from a single-process replica trained here on the concatenated batch
(every rank builds every rank's seeded data), never from the code under test.
"""

from __future__ import annotations

import copy
import inspect
import os

import torch
import torch.distributed as tdist
from checklist import say
from torch import nn

torch.set_num_threads(1)

import smddp.torch.distributed as dist  # noqa: E402
import smddp.torch.parallel  # noqa: E402
from smddp.job.topology import discover  # noqa: E402
from smddp.torch import groups  # noqa: E402
from smddp.torch.parallel import _hook  # noqa: E402
from smddp.torch.parallel.distributed import DistributedDataParallel as DDP  # noqa: E402
from smddp.torch.parallel.distributed import _allreduce_hook as smddp_hook  # noqa: E402

RTOL, ATOL = 1e-4, 1e-6
LOCAL_BATCH = 4
STEPS = 5


def ok(name: str) -> None:
    say(f"OK {RANK} {name}")


def close(actual: torch.Tensor, expected: torch.Tensor, what: str, rtol: float = RTOL, atol: float = ATOL) -> None:
    if not torch.allclose(actual, expected, rtol=rtol, atol=atol):
        diff = (actual - expected).abs().max().item()
        raise AssertionError(f"rank {RANK}: {what} differs from the expected value (max abs diff {diff:g})")


def net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


def global_batch(step: int):
    """The whole job's batch of ``step``: rank r trains on rows r*B..(r+1)*B."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(SIZE * LOCAL_BATCH, 8, generator=g), torch.randn(SIZE * LOCAL_BATCH, 4, generator=g)


def shard(t: torch.Tensor, rank: int) -> torch.Tensor:
    return t[rank * LOCAL_BATCH:(rank + 1) * LOCAL_BATCH]


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(model(x), y)


def collectives() -> int:
    return groups.current().engine.seq


# --------------------------------------------------------------------------- checks
def check_before_init() -> None:
    try:
        DDP(nn.Linear(2, 2))
    except RuntimeError as exc:
        assert "init_process_group" in str(exc), exc
    else:
        raise AssertionError("DDP before init_process_group() did not raise")
    ok("before_init")


def check_api() -> None:
    assert smddp.torch.parallel.DistributedDataParallel is DDP
    assert issubclass(DDP, torch.nn.parallel.DistributedDataParallel)
    names = list(inspect.signature(DDP.__init__).parameters)[1:7]
    assert names == ["module", "device_ids", "output_device", "broadcast_buffers", "process_group",
                     "bucket_cap_mb"], names
    model = DDP(net(0))
    assert model.bucket_bytes_cap == 25 * 1024 * 1024, model.bucket_bytes_cap
    assert DDP(net(0), bucket_cap_mb=2).bucket_bytes_cap == 2 * 1024 * 1024
    assert DDP(net(0), process_group=dist.group.WORLD) is not None
    assert DDP(net(0), process_group=tdist.group.WORLD) is not None  # torch's default group is smddp's
    assert model.gradient_as_bucket_view, "smddp defaults to gradient_as_bucket_view=True"
    assert not DDP(net(0), gradient_as_bucket_view=False).gradient_as_bucket_view
    flags = DDP(net(0), gradient_as_bucket_view=True, find_unused_parameters=True)
    assert flags.gradient_as_bucket_view and flags.find_unused_parameters
    ok("api")


def check_errors(gloo) -> None:
    for bad in (gloo, "world", object()):
        try:
            DDP(net(0), process_group=bad)
        except ValueError as exc:
            assert "group.WORLD" in str(exc), exc
        else:
            raise AssertionError(f"process_group={bad!r} did not raise ValueError")
    ok("errors")


def check_exact(name: str, start_seed: int, bucket_cap_mb=None, buckets: str = "one", **kwargs) -> None:
    """STEPS of SGD with momentum on shards equal the same steps on the whole batch."""
    model = DDP(net(start_seed), bucket_cap_mb=bucket_cap_mb, **kwargs)
    reference = net(0)  # rank 0's start: DDP broadcasts it at construction
    for p, q in zip(model.module.parameters(), reference.parameters()):
        close(p.detach(), q.detach(), f"{name}: a parameter after construction", rtol=0, atol=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        x, y = global_batch(step)
        opt.zero_grad()
        before = collectives()
        loss_fn(model, shard(x, RANK), shard(y, RANK)).backward()
        reduced = collectives() - before
        opt.step()
        ref_opt.zero_grad()
        loss_fn(reference, x, y).backward()
        ref_opt.step()
    # the last step ran with the buckets DDP settled on after the first iteration
    if buckets == "one":
        assert reduced == 1, f"{name}: expected one bucket, {reduced} all-reduces"
    else:
        assert reduced >= 3, f"{name}: expected a bucket per layer at least, got {reduced} all-reduces"
    for (pname, p), q in zip(model.module.named_parameters(), reference.parameters()):
        close(p.detach(), q.detach(), f"{name}: parameter {pname} after {STEPS} steps")
    ok(name)


def check_no_sync() -> None:
    """Accumulating over two micro-batches, the first under no_sync(), sums the averaged gradients."""
    model = DDP(net(0), bucket_cap_mb=0.0001)
    reference = net(0)
    (x1, y1), (x2, y2) = global_batch(10), global_batch(11)
    before = collectives()
    with model.no_sync():
        loss_fn(model, shard(x1, RANK), shard(y1, RANK)).backward()
    assert collectives() == before, "no_sync() ran collectives"
    local = net(0)
    loss_fn(local, shard(x1, RANK), shard(y1, RANK)).backward()
    for p, q in zip(model.module.parameters(), local.parameters()):
        close(p.grad, q.grad, "a gradient under no_sync() (should be this rank's own)")
    loss_fn(model, shard(x2, RANK), shard(y2, RANK)).backward()
    loss_fn(reference, x1, y1).backward()
    loss_fn(reference, x2, y2).backward()
    for (pname, p), q in zip(model.module.named_parameters(), reference.parameters()):
        close(p.grad, q.grad, f"accumulated gradient of {pname}")
    ok("no_sync")


def gathered(t: torch.Tensor, gloo) -> list:
    """Every rank's ``t``, over torch's own gloo group (not the code under test)."""
    out = [torch.empty_like(t) for _ in range(SIZE)]
    tdist.all_gather(out, t.contiguous(), group=gloo)
    return out


def same_on_every_rank(model: nn.Module, gloo, what: str) -> None:
    """Every rank holds the same gradients, bit for bit."""
    for pname, p in model.named_parameters():
        for r, theirs in enumerate(gathered(p.grad, gloo)):
            assert torch.equal(theirs, p.grad), f"rank {RANK}: {what}: {pname}'s gradient differs from rank {r}'s"


def check_hook(gloo) -> None:
    """Where smddp's hook goes in (the shared-memory plane), what it gives, and how a caller replaces it."""
    engine = groups.current().engine
    plane = engine.comms["cpu"].plane
    model = DDP(net(0))
    assert not model._comm_hooks, "smddp's hook was registered before the first forward"
    loss_fn(model, *[shard(t, RANK) for t in global_batch(0)]).backward()
    hooks = [hook for hook, _ in model._comm_hooks]
    assert hooks == ([smddp_hook] if plane == "shm" else []), (plane, hooks)
    assert not _hook.completes_inline(engine, model.module, env={_hook.ENV: "0"})
    say(f"HOOK {RANK} {plane} {'on' if hooks else 'off'}")
    same_on_every_rank(model.module, gloo, "smddp's default path")
    try:
        model.register_comm_hook(None, lambda state, bucket: None)
    except ValueError as exc:
        assert hooks, f"registering a hook after the first forward raised without smddp's hook: {exc}"
        assert "before the first forward" in str(exc) and _hook.ENV in str(exc), exc
    else:
        assert not hooks, "a second hook after smddp's did not raise"

    def summed(state, bucket):
        return tdist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda f: f.value()[0])

    own = DDP(net(0))
    own.register_comm_hook(None, summed)  # before the first forward: replaces smddp's
    x, y = global_batch(1)
    loss_fn(own, shard(x, RANK), shard(y, RANK)).backward()
    reference = net(0)
    for r in range(SIZE):
        loss_fn(reference, shard(x, r), shard(y, r)).backward()  # the sum of every rank's gradient
    assert [hook for hook, _ in own._comm_hooks] == [summed]
    for (pname, p), q in zip(own.module.named_parameters(), reference.parameters()):
        close(p.grad, q.grad, f"{pname}'s gradient through the caller's own hook")
    ok("hook")


def check_order() -> None:
    """An all_reduce issued on the group before backward completes first, and both are right."""
    model = DDP(net(0))
    x, y = global_batch(3)
    for _ in range(2):  # the hook goes in at the first step, the buckets are rebuilt at the second
        loss_fn(model, shard(x, RANK), shard(y, RANK)).backward()
    model.zero_grad()
    size = 3 << 20  # 12 MB: not done as it starts
    stack = torch.stack([torch.randn(size, generator=torch.Generator().manual_seed(50 + r)) for r in range(SIZE)])
    mine = stack[RANK].clone()
    first = collectives()
    work = tdist.all_reduce(mine, async_op=True)
    loss_fn(model, shard(x, RANK), shard(y, RANK)).backward()
    assert work.is_completed(), "backward returned before the all_reduce issued ahead of it completed"
    work.wait()
    assert collectives() == first + 2, collectives() - first
    expected = stack[0].clone()
    for r in range(1, SIZE):
        expected += stack[r]
    close(mine, expected, "the all_reduce issued before backward", 1e-5, 1e-5)
    reference = net(0)
    for r in range(SIZE):
        loss_fn(reference, shard(x, r), shard(y, r)).backward()
    for (pname, p), q in zip(model.module.named_parameters(), reference.parameters()):
        close(p.grad, q.grad / SIZE, f"{pname}'s gradient behind an asynchronous all_reduce")
    ok("order")


def check_join(gloo, name: str, make) -> None:
    """Uneven inputs under ``model.join()``: joined ranks contribute zeros, and every rank divides
    by the initial world size (``divide_by_initial_world_size=True``) or by the number of ranks
    still training (``False``). One model through three epochs, the flag True, False, True (so
    smddp's hook, where it goes in, is in before the flag changes); in each, rank r trains on
    2 + (r + epoch) % SIZE batches. Each gradient on each rank still training is checked against
    the one computed here from every rank's batch, and the model every rank ends with against
    the same steps taken here; it is bit for bit the same on every rank.
    """
    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    reference = net(0)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)

    def reference_step(epoch: int, step: int, steps: list, divide_by_initial: bool):
        x, y = global_batch(30 + 10 * epoch + step)
        active = [r for r in range(SIZE) if step < steps[r]]
        ref_opt.zero_grad()
        for r in active:
            loss_fn(reference, shard(x, r), shard(y, r)).backward()
        for q in reference.parameters():
            q.grad /= SIZE if divide_by_initial else len(active)
        return x, y

    for epoch, divide_by_initial in enumerate((True, False, True)):
        steps = [2 + (r + epoch) % SIZE for r in range(SIZE)]
        what = f"{name}: epoch {epoch} (divide_by_initial_world_size={divide_by_initial})"
        with model.join(divide_by_initial_world_size=divide_by_initial):
            for step in range(steps[RANK]):
                x, y = reference_step(epoch, step, steps, divide_by_initial)
                opt.zero_grad()
                loss_fn(model, shard(x, RANK), shard(y, RANK)).backward()
                for (pname, p), q in zip(model.module.named_parameters(), reference.parameters()):
                    close(p.grad, q.grad, f"{what}, step {step}: {pname}'s gradient")
                opt.step()
                ref_opt.step()
        for step in range(steps[RANK], max(steps)):  # the steps taken while this rank had joined
            reference_step(epoch, step, steps, divide_by_initial)
            ref_opt.step()
        for (pname, p), q in zip(model.module.named_parameters(), reference.parameters()):
            close(p.detach(), q.detach(), f"{what}: parameter {pname} after the epoch")
            for r, theirs in enumerate(gathered(p.detach(), gloo)):
                assert torch.equal(theirs, p.detach()), f"{what}: {pname} differs between ranks {RANK} and {r}"
    ok(name)


def check_unused(gloo) -> None:
    """find_unused_parameters=True: a branch unused on every rank keeps no gradient, the rest are averaged."""
    torch.manual_seed(0)
    body, unused = nn.Linear(8, 4), nn.Linear(8, 4)

    class TwoBranches(nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.unused = copy.deepcopy(body), copy.deepcopy(unused)

        def forward(self, x):
            return self.body(x)

    model = DDP(TwoBranches(), find_unused_parameters=True)
    reference = copy.deepcopy(body)
    for step in range(2):
        x, y = global_batch(60 + step)
        model.zero_grad()
        reference.zero_grad()
        loss_fn(model, shard(x, RANK), shard(y, RANK)).backward()
        for r in range(SIZE):
            loss_fn(reference, shard(x, r), shard(y, r)).backward()
        assert model.module.unused.weight.grad is None, "an unused parameter got a gradient"
        for pname, q in reference.named_parameters():
            close(getattr(model.module.body, pname).grad, q.grad / SIZE, f"find_unused_parameters: {pname}")
    same_on_every_rank(model.module.body, gloo, "find_unused_parameters")
    ok("unused")


def check_bf16() -> None:
    """bfloat16 gradients: the average of every rank's, computed here in float32, rounded once."""
    model = DDP(net(0).to(torch.bfloat16), bucket_cap_mb=0.0001)
    x, y = global_batch(2)
    x, y = x.to(torch.bfloat16), y.to(torch.bfloat16)
    loss_fn(model, shard(x, RANK), shard(y, RANK)).backward()
    grads = []
    for r in range(SIZE):
        local = net(0).to(torch.bfloat16)
        loss_fn(local, shard(x, r), shard(y, r)).backward()
        grads.append([q.grad.float() for q in local.parameters()])
    for i, (pname, p) in enumerate(model.module.named_parameters()):
        assert p.grad.dtype == torch.bfloat16, p.grad.dtype
        want = (sum(g[i] for g in grads) / SIZE).to(torch.bfloat16)
        # torch's default path (gloo) divides in bfloat16 before it sums: within a rounding
        close(p.grad.float(), want.float(), f"bfloat16 gradient of {pname}", rtol=1e-2, atol=1e-3)
    ok("bfloat16")


def bn_net() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6))


def bn_input(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 4, generator=g) * (rank + 1) + rank


def check_buffers(broadcast: bool) -> None:
    name = f"buffers_{'broadcast' if broadcast else 'local'}"
    module = bn_net()
    module[1].running_mean.fill_(float(RANK))  # every rank starts different; rank 0's must win
    module[1].running_var.fill_(1.0 + RANK)
    model = DDP(module, broadcast_buffers=broadcast)
    replica = {r: bn_net() for r in range(SIZE)}  # what rank r's module should hold
    for r in replica:
        replica[r][1].running_mean.zero_()
        replica[r][1].running_var.fill_(1.0)
    expect = replica[RANK][1]
    got = model.module[1]
    close(got.running_mean, expect.running_mean, f"{name}: running_mean after construction", 0, 0)
    close(got.running_var, expect.running_var, f"{name}: running_var after construction", 0, 0)

    # torch's DDP syncs buffers in forwards that run with grad enabled (training steps)
    for step in range(2):
        model(bn_input(step, RANK)).sum().backward()
        with torch.no_grad():
            if broadcast:  # each forward starts from rank 0's statistics
                start = copy.deepcopy(replica[0].state_dict())
                for r in replica:
                    replica[r].load_state_dict(start)
            for r in replica:
                replica[r](bn_input(step, r))
        close(got.running_mean, expect.running_mean, f"{name}: running_mean after forward {step}", 1e-5, 1e-6)
        close(got.running_var, expect.running_var, f"{name}: running_var after forward {step}", 1e-5, 1e-6)
        assert int(got.num_batches_tracked) == step + 1
    model.eval()
    model(bn_input(5, RANK))
    final = replica[0][1] if broadcast else expect
    close(got.running_mean, final.running_mean, f"{name}: running_mean after an eval forward", 1e-5, 1e-6)
    close(got.running_var, final.running_var, f"{name}: running_var after an eval forward", 1e-5, 1e-6)
    ok(name)


def check_state_dict(gloo) -> None:
    model = DDP(net(0))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = global_batch(20)
    loss_fn(model, shard(x, RANK), shard(y, RANK)).backward()
    opt.step()
    state = model.state_dict()
    assert state and all(k.startswith("module.") for k in state), list(state)
    assert list(model.module.state_dict()) == [k[len("module."):] for k in state]

    plain = net(5)
    plain.load_state_dict(model.module.state_dict())
    stripped = net(6)
    torch.nn.modules.utils.consume_prefix_in_state_dict_if_present(state, "module.")
    stripped.load_state_dict(state)
    probe = torch.randn(3, 8, generator=torch.Generator().manual_seed(7))
    want = model.module(probe)
    close(plain(probe), want, "a plain module loaded from .module.state_dict()", 0, 0)
    close(stripped(probe), want, "a plain module loaded from state_dict() without the prefix", 0, 0)

    torch_ddp = torch.nn.parallel.DistributedDataParallel(net(8), process_group=gloo)
    torch_ddp.load_state_dict(model.state_dict())
    close(torch_ddp(probe), want, "torch's DDP loaded from smddp's state_dict()", 0, 0)
    back = DDP(net(9))
    back.load_state_dict(torch_ddp.state_dict())
    close(back(probe), want, "smddp's DDP loaded from torch's DDP state_dict()", 0, 0)
    ok("state_dict")


def main() -> None:
    global RANK, SIZE, BACKEND
    RANK = discover(os.environ).rank
    check_before_init()
    dist.init_process_group()
    RANK, SIZE = dist.get_rank(), dist.get_world_size()
    BACKEND = dist.get_backend()
    gloo = tdist.new_group(backend="gloo")
    check_api()
    check_errors(gloo)
    check_exact("exact", start_seed=0)
    check_exact("exact_small_buckets_different_start", start_seed=RANK, bucket_cap_mb=0.0001, buckets="many")
    check_exact("exact_passthrough", start_seed=RANK, gradient_as_bucket_view=True, static_graph=True)
    check_no_sync()
    check_hook(gloo)
    check_order()
    # smddp's DDP (its hook on the shared-memory plane), then torch's own on smddp's group (no hook)
    check_join(gloo, "join", lambda: DDP(net(0), bucket_cap_mb=0.0001))
    check_join(gloo, "join_torch_ddp", lambda: torch.nn.parallel.DistributedDataParallel(net(0), bucket_cap_mb=0.0001))
    check_unused(gloo)
    check_bf16()
    check_buffers(True)
    check_buffers(False)
    check_state_dict(gloo)
    tdist.barrier(gloo)
    say(f"DONE {RANK} {dist.get_backend()}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
