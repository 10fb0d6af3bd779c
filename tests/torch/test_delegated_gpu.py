"""Ordering and lifetime of device collectives at world size 1: smddp's two CUDA routes beside torch's NCCL group.

At world size 1 NCCL moves nothing between devices, but it still copies (an out-of-place
all-gather or reduce-scatter copies its input to its output) on the group's stream, and torch's
group holds an asynchronous call's tensors until ``wait()``: order and lifetime stay visible. Each
test runs on the delegated route (``torch-nccl``, smddp's default on CUDA: device tensors handed to
torch's ``ProcessGroupNCCL``) and on CuPy's route (``nccl``, as ``SMDDP_BACKEND=nccl`` chooses it),
and runs the same check on torch's own NCCL group first (``new_group(backend="nccl")`` in the same
process): a check that torch's own group fails is this test's error, and says so.

- An out-of-place all-gather and reduce-scatter (tensor and list forms) whose input is filled on a
  side stream after a ``torch.cuda._sleep`` there: the output holds the fill, read on that stream
  after a synchronous call, or on a third stream after an asynchronous call's ``wait()`` there.
- An asynchronous all-gather and reduce-scatter whose input is deleted while the collective waits
  behind a sleep, its memory then asked for by a sentinel tensor filled at once: the output holds
  the input's values, not the sentinel's.
- A DDP backward on a non-default stream behind a 1 s sleep there: the default stream and the host
  are not made to wait for it, and the gradients read on that stream are the plain module's.
- Peak memory of 100 asynchronous all-gathers, each waited and dropped, and of 100 in flight at
  once: at most torch's own group's, plus one tensor.

Every test carries the ``gpu`` marker (conftest skips it without CUDA, saying why); CuPy's route
skips without CuPy. The world is this process's: smddp's ``init_process_group`` with a ``HashStore``,
rank 0, world size 1, destroyed after each route's tests. ``tools/gpu_checks.py`` runs this file
before the rest of ``pytest -m gpu``.
"""

from __future__ import annotations

import copy
import functools
from datetime import timedelta
from typing import Callable, NamedTuple

import pytest
import torch
import torch.distributed as tdist

pytestmark = pytest.mark.gpu

ROUTES = {"delegated": "torch-nccl", "cupy": "nccl"}
N = 1 << 20  # elements of each tensor: 4 MiB of float32
SENTINEL = -7.0


class World(NamedTuple):
    route: str
    mine: object  # smddp's world group
    theirs: object  # torch's own NCCL group over the same process


@pytest.fixture(scope="module", params=list(ROUTES))
def world(request):
    backend = ROUTES[request.param]
    if backend == "nccl":
        try:
            import cupy  # noqa: F401
        except Exception as exc:  # noqa: BLE001 - any import failure means the route cannot run
            pytest.skip(f"CuPy is not importable ({exc}): pip install 'smddp[cuda12]' ('smddp[cuda13]' on CUDA 13)")
    import smddp.torch.distributed as dist
    from smddp.torch.delegating_group import DelegatingProcessGroup

    torch.cuda.set_device(0)
    dist.init_process_group(backend=backend, store=tdist.HashStore(), rank=0, world_size=1,
                            timeout=timedelta(seconds=120))
    theirs = None
    try:
        mine = tdist.group.WORLD
        assert dist.get_backend() == backend, (dist.get_backend(), backend)
        assert isinstance(mine, DelegatingProcessGroup) == (backend == "torch-nccl"), type(mine)
        theirs = tdist.new_group(backend="nccl")
        yield World(request.param, mine, theirs)
    finally:
        torch.cuda.synchronize()
        if theirs is not None:
            tdist.destroy_process_group(theirs)
        dist.destroy_process_group()
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------- helpers
def _device() -> torch.device:
    return torch.device("cuda", 0)


@functools.cache
def cycles_for(seconds: float) -> int:
    """``torch.cuda._sleep`` cycles that keep this GPU's stream busy for about ``seconds``."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    probe = 50_000_000
    start.record()
    torch.cuda._sleep(probe)
    end.record()
    end.synchronize()
    return int(probe * seconds * 1000 / max(start.elapsed_time(end), 1e-3))


def _gather_single(out, inp, group, async_op):
    # torch >= 2.13 names it all_gather_single (all_gather_into_tensor is deprecated there)
    call = getattr(tdist, "all_gather_single", None) or tdist.all_gather_into_tensor
    return call(out, inp, group=group, async_op=async_op)


def _scatter_single(out, inp, group, async_op):
    call = getattr(tdist, "reduce_scatter_single", None) or tdist.reduce_scatter_tensor
    return call(out, inp, group=group, async_op=async_op)


#: Out-of-place collectives, tensor and list forms, ``(out, inp, group, async_op) -> Work or None``: at world
#: size 1, a copy.
FORMS: dict = {
    "all_gather_single": _gather_single,
    "all_gather": lambda out, inp, group, async_op: tdist.all_gather([out], inp, group=group,
                                                                          async_op=async_op),
    "reduce_scatter_single": _scatter_single,
    "reduce_scatter": lambda out, inp, group, async_op: tdist.reduce_scatter(out, [inp], group=group,
                                                                                  async_op=async_op),
}


def expect(t: torch.Tensor, value: float, what: str) -> None:
    got = t.cpu()
    if not bool((got == value).all()):
        found = sorted(set(got.unique().tolist()))[:4]
        raise AssertionError(f"{what}: expected every element {value}, found {found}")


def on_each(world: World, check: Callable[..., None], *args) -> None:
    """``check(group, *args)`` on torch's own group, then on smddp's."""
    try:
        check(world.theirs, *args)
    except AssertionError as exc:
        raise AssertionError(f"torch's own NCCL group fails this check too, so the check is wrong: {exc}") from exc
    try:
        check(world.mine, *args)
    except AssertionError as exc:
        raise AssertionError(f"smddp's {world.route} route ({ROUTES[world.route]}), where torch's own group "
                             f"passes: {exc}") from exc


# ---------------------------------------------------------------------------- ordering
def _copies_what_its_stream_filled(group, form: str) -> None:
    call = FORMS[form]
    device = _device()
    inp = torch.zeros(N, device=device)
    out = torch.full((N,), -1.0, device=device)
    call(out, inp, group, False)  # the communicator first: its set-up synchronizes the device
    torch.cuda.synchronize()
    producer, reader = torch.cuda.Stream(device), torch.cuda.Stream(device)
    for async_op, value in ((False, 3.0), (True, 5.0)):
        out.fill_(-1.0)
        inp.zero_()
        torch.cuda.synchronize()
        with torch.cuda.stream(producer):
            torch.cuda._sleep(cycles_for(0.2))
            inp.fill_(value)  # queued behind the sleep: the collective must wait for it
            work = call(out, inp, group, async_op)
            if not async_op:
                seen = out.clone()  # the caller's stream is ordered after a synchronous call
        if async_op:
            with torch.cuda.stream(reader):
                work.wait()  # orders the stream that waits, not only the one that called
                seen = out.clone()
        torch.cuda.synchronize()
        how = "async_op=True, wait() and read on a third stream" if async_op else "synchronous, read on its stream"
        expect(seen, value, f"{form}, input filled after a sleep on the calling stream ({how})")


@pytest.mark.parametrize("form", list(FORMS))
def test_an_out_of_place_copy_waits_for_its_input_and_is_seen_by_its_readers(world, form):
    on_each(world, _copies_what_its_stream_filled, form)


# ---------------------------------------------------------------------------- lifetime
def _holds_a_deleted_input(group, form: str) -> None:
    call = FORMS[form]
    device = _device()
    call(torch.empty(N, device=device), torch.zeros(N, device=device), group, False)  # the communicator
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # no cached block of this size left but those made below
    out = torch.full((N,), -1.0, device=device)
    # This check sees a reuse: the allocator hands a freed block to the next tensor of its size on its stream.
    probe = torch.empty(N, device=device)
    where = probe.data_ptr()
    del probe
    assert torch.empty(N, device=device).data_ptr() == where, "the allocator did not reuse a freed block: " \
        "this check could not see an input's memory reused"
    inp = torch.full((N,), 7.0, device=device)
    torch.cuda.synchronize()
    side = torch.cuda.Stream(device)
    with torch.cuda.stream(side):
        torch.cuda._sleep(cycles_for(0.3))
        work = call(out, inp, group, True)  # the group's stream waits for the sleep before it reads inp
    where = inp.data_ptr()
    del inp
    sentinel = torch.full((N,), SENTINEL, device=device)  # on the default stream, at once
    reused = sentinel.data_ptr() == where
    work.wait()
    seen = out.clone()
    torch.cuda.synchronize()
    held = "its memory went to the sentinel" if reused else "its memory was not handed out"
    expect(seen, 7.0, f"{form}, async_op=True, its input deleted and a sentinel allocated during the call ({held})")
    del sentinel


@pytest.mark.parametrize("form", ["all_gather_single", "reduce_scatter_single"])
def test_an_async_calls_deleted_input_is_not_reused_under_the_running_collective(world, form):
    on_each(world, _holds_a_deleted_input, form)


# ---------------------------------------------------------------------------- DDP
def _ddp_backward_on_a_side_stream(group) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    device = _device()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256)).to(device)
    plain = copy.deepcopy(net)
    model = DDP(net, device_ids=[0], process_group=group, bucket_cap_mb=1)
    x, y = torch.randn(64, 256, device=device), torch.randn(64, 256, device=device)
    for _ in range(3):  # buckets made, rebuilt after the first backward, the communicator set up
        model.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(model(x), y).backward()
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    side = torch.cuda.Stream(device)
    side_done = torch.cuda.Event()
    with torch.cuda.stream(side):
        torch.cuda._sleep(cycles_for(1.0))
        torch.nn.functional.mse_loss(model(x), y).backward()
        grads = [p.grad.clone() for p in model.parameters()]
        side_done.record()
    default_done = torch.cuda.Event()
    default_done.record()  # on the default stream, which the backward never used
    default_done.synchronize()
    # The side stream sleeps 1 s, far longer than the host takes to queue a step: had the default
    # stream (or the host) been made to wait for the backward's collectives, the sleep would be over.
    assert not side_done.query(), "the default stream or the host waited for a backward queued behind a 1 s " \
        "sleep on another stream"
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        torch.nn.functional.mse_loss(plain(x), y).backward()
        expected = [p.grad.clone() for p in plain.parameters()]
    torch.cuda.synchronize()
    for (name, _), got, want in zip(plain.named_parameters(), grads, expected):
        torch.testing.assert_close(got, want, msg=lambda m, name=name: f"DDP's gradient of {name} on the side "
                                   f"stream is not the plain module's: {m}")


def test_a_ddp_backward_on_a_non_default_stream_waits_there_only(world):
    on_each(world, _ddp_backward_on_a_side_stream)


# ---------------------------------------------------------------------------- peak memory
def _peak_of_100_async_all_gathers(group, in_flight: bool) -> int:
    """Bytes allocated at the peak above those allocated before, checking every output's value."""
    device = _device()
    count = 100
    _gather_single(torch.empty(N, device=device), torch.zeros(N, device=device), group, False)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    checks, pending = [], []
    for i in range(count):
        inp = torch.full((N,), float(i), device=device)
        out = torch.empty(N, device=device)
        work = _gather_single(out, inp, group, True)
        del inp  # the call's own to hold
        if in_flight:
            pending.append((work, out))
        else:
            work.wait()
            checks.append(torch.stack(torch.aminmax(out)))
            del work, out
    for work, out in pending:
        work.wait()
        checks.append(torch.stack(torch.aminmax(out)))
    del pending
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    seen = torch.stack(checks).cpu()
    expected = torch.arange(count, dtype=torch.float32).repeat_interleave(2).view(count, 2)
    assert torch.equal(seen, expected), "an all-gather's output is not its input"
    return peak


@pytest.mark.parametrize("in_flight", [False, True], ids=["each-waited", "all-in-flight"])
def test_the_peak_memory_of_100_async_all_gathers_is_torchs(world, in_flight):
    theirs = _peak_of_100_async_all_gathers(world.theirs, in_flight)
    mine = _peak_of_100_async_all_gathers(world.mine, in_flight)
    nbytes = N * 4
    assert mine <= theirs + nbytes, (
        f"smddp's {world.route} route peaked {mine / 2**20:.0f} MiB above what was allocated before, torch's own "
        f"group {theirs / 2**20:.0f} MiB (one tensor: {nbytes / 2**20:.0f} MiB)")
