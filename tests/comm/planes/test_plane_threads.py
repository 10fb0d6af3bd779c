"""The shared-memory plane's collectives, with its ranks as threads of one process over one real segment.

Every collective the plane has, on the compiled core and on the Python path, exact against what
each rank computes locally from the same seeded per-rank inputs (Horovod's idiom: row ``rank`` of a
seeded stack is a rank's input, the expectation is the stack reduced here). Values are small
integers in every dtype, so every reduction is exact whatever the order; a separate test holds
the two paths to the same bits on random floats. A fingerprint mismatch raises on every rank and
leaves the plane in step; a wait on a rank that has not arrived reaches its deadline and the
operation still completes once the rank comes. In seconds: no job is started.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import List

import pytest
import torch
from plane_threads import on_threads, wait

from smddp.comm.backends.local import LocalCommunicator
from smddp.comm.base import Context
from smddp.comm.planes import shm
from smddp.comm.reduction import BITWISE, Op
from smddp.comm.waiting import poll
from smddp.errors import CollectiveMismatchError
from smddp.job.topology import Topology

pytestmark = pytest.mark.unit

PATHS = [pytest.param(True, id="compiled-core"), pytest.param(False, id="python-path")]
#: Element counts: one step, and more than a 64 KiB buffer holds (several steps, each rank reducing a part).
SIZES = (7, 40_000)
DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int8, torch.uint8, torch.int32,
          torch.int64, torch.bool)


@pytest.fixture(autouse=True)
def _core_or_skip(request):
    native = request.node.callspec.params.get("native") if hasattr(request.node, "callspec") else None
    if native and shm.native is None:
        pytest.skip("the compiled core is not built here (no C compiler at install)")


def stack(size: int, n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Every rank's input, row ``rank``: small integers (or bools), so that every reduction is exact."""
    gen = torch.Generator().manual_seed(seed)
    if dtype is torch.bool:
        return torch.randint(0, 2, (size, n), generator=gen).bool()
    low = 0 if dtype is torch.uint8 else -8
    return torch.randint(low, 9, (size, n), generator=gen).to(dtype)


def reduced(rows: torch.Tensor, op: Op) -> torch.Tensor:
    """The reduction of ``rows`` as smddp defines it, computed here row by row (half types in float32)."""
    dtype = rows.dtype
    work = rows.float() if dtype in (torch.float16, torch.bfloat16) else rows
    if dtype is torch.bool:
        folds = {Op.SUM: torch.logical_or, Op.PRODUCT: torch.logical_and, Op.MIN: torch.logical_and,
                 Op.MAX: torch.logical_or, Op.BAND: torch.logical_and, Op.BOR: torch.logical_or,
                 Op.BXOR: torch.logical_xor}
    else:
        folds = {Op.SUM: torch.add, Op.AVERAGE: torch.add, Op.PRODUCT: torch.mul, Op.MIN: torch.minimum,
                 Op.MAX: torch.maximum, Op.BAND: torch.bitwise_and, Op.BOR: torch.bitwise_or,
                 Op.BXOR: torch.bitwise_xor}
    acc = work[0].clone()
    for row in work[1:]:
        acc = folds[op](acc, row)
    if op is Op.AVERAGE:
        acc = acc / rows.shape[0] if acc.is_floating_point() else torch.div(acc, rows.shape[0], rounding_mode="trunc")
    return acc.to(dtype)


def dtypes_of(op: Op) -> List[torch.dtype]:
    """The dtypes that have ``op`` (gloo's rules: bitwise ops on integers and bool, no AVERAGE of bools)."""
    if op in BITWISE:
        return [d for d in DTYPES if not d.is_floating_point]
    if op is Op.AVERAGE:
        return [d for d in DTYPES if d is not torch.bool]
    return list(DTYPES)


@pytest.mark.parametrize("native", PATHS)
@pytest.mark.parametrize("op", list(Op), ids=lambda op: op.name)
def test_all_reduce_of_every_dtype_and_size_is_exact(native, op):
    cases = [(dtype, n) for dtype in dtypes_of(op) for n in SIZES]

    def body(plane):
        out = []
        for i, (dtype, n) in enumerate(cases):
            tensor = stack(plane.size, n, dtype, seed=i)[plane.rank].clone()
            wait(plane.all_reduce(tensor, op, tag=i))
            out.append(tensor)
        return out

    results = on_threads(body, native=native)
    for i, (dtype, n) in enumerate(cases):
        expected = reduced(stack(2, n, dtype, seed=i), op)
        for rank, got in enumerate(results):
            assert torch.equal(got[i], expected), f"rank {rank}: {op.name} of {n} {dtype} differs"


@pytest.mark.parametrize("native", PATHS)
def test_all_reduce_over_three_ranks_folds_in_rank_order(native):
    def body(plane):
        tensor = stack(3, 40_000, torch.int64, seed=3)[plane.rank].clone()
        wait(plane.all_reduce(tensor, Op.SUM, tag=1))
        return tensor

    expected = reduced(stack(3, 40_000, torch.int64, seed=3), Op.SUM)
    assert all(torch.equal(got, expected) for got in on_threads(body, size=3, native=native))


@pytest.mark.parametrize("native", PATHS)
@pytest.mark.parametrize("op", [Op.SUM, Op.AVERAGE, Op.MIN, Op.MAX, Op.BXOR], ids=lambda op: op.name)
def test_reduce_scatter_gives_each_rank_its_slice_of_the_reduction(native, op):
    cases = [(dtype, m) for dtype in (torch.float32, torch.int64, torch.bfloat16, torch.int8) for m in (5, 20_000)
             if not (op in BITWISE and dtype.is_floating_point)]

    def body(plane):
        out = []
        for i, (dtype, m) in enumerate(cases):
            output = torch.empty(m, dtype=dtype)
            wait(plane.reduce_scatter(output, stack(plane.size, plane.size * m, dtype, seed=i)[plane.rank], op, tag=i))
            out.append(output)
        return out

    results = on_threads(body, native=native)
    for i, (dtype, m) in enumerate(cases):
        whole = reduced(stack(2, 2 * m, dtype, seed=i), op)
        for rank, got in enumerate(results):
            assert torch.equal(got[i], whole[rank * m:(rank + 1) * m]), f"rank {rank}: {m} {dtype} differs"


@pytest.mark.parametrize("native", PATHS)
def test_all_gather_puts_every_rank_input_in_rank_order(native):
    cases = [(dtype, n) for dtype in (torch.float32, torch.bfloat16, torch.int8, torch.bool) for n in (0, 3, 40_000)]

    def body(plane):
        out = []
        for i, (dtype, n) in enumerate(cases):
            output = torch.empty(plane.size * n, dtype=dtype)
            wait(plane.all_gather(output, stack(plane.size, n, dtype, seed=i)[plane.rank], tag=i))
            out.append(output)
        return out

    results = on_threads(body, native=native)
    for i, (dtype, n) in enumerate(cases):
        expected = stack(2, n, dtype, seed=i).reshape(-1)
        assert all(torch.equal(got[i], expected) for got in results), f"{n} {dtype}"


@pytest.mark.parametrize("native", PATHS)
def test_broadcast_copies_the_root_tensor_from_either_root(native):
    cases = [(src, dtype, n) for src in (0, 1) for dtype in (torch.float64, torch.int32) for n in (1, 50_000)]

    def body(plane):
        out = []
        for i, (src, dtype, n) in enumerate(cases):
            tensor = stack(plane.size, n, dtype, seed=i)[plane.rank].clone()
            wait(plane.broadcast(tensor, src, tag=i))
            out.append(tensor)
        return out

    results = on_threads(body, native=native)
    for i, (src, dtype, n) in enumerate(cases):
        expected = stack(2, n, dtype, seed=i)[src]
        assert all(torch.equal(got[i], expected) for got in results), f"root {src}: {n} {dtype}"


@pytest.mark.parametrize("native", PATHS)
def test_barrier_completes_on_every_rank_only_once_all_entered(native):
    entered = []

    def body(plane):
        if plane.rank == 1:
            time.sleep(0.2)  # rank 0's barrier must not complete before this rank enters
        entered.append((plane.rank, time.monotonic()))
        wait(plane.barrier(tag=1))
        return time.monotonic()

    left = on_threads(body, native=native)
    last_in = max(at for _, at in entered)
    assert len(entered) == 2 and all(at >= last_in for at in left)


@pytest.mark.parametrize("count", [3, 30_000])
def test_all_to_all_sends_each_rank_its_uneven_part(count):
    if shm.native is None:
        pytest.skip("the compiled core is not built here (no C compiler at install)")
    size = 3

    def sent(src: int, dst: int) -> torch.Tensor:  # what src sends dst: it says who and where
        n = count + 2 * src + dst
        return torch.arange(n, dtype=torch.int64) * 100 + src * 10 + dst

    def body(plane):
        r = plane.rank
        input = torch.cat([sent(r, j) for j in range(size)])
        output_counts = [sent(j, r).numel() for j in range(size)]
        input_counts = [sent(r, j).numel() for j in range(size)]
        output = torch.empty(sum(output_counts), dtype=torch.int64)
        wait(plane.all_to_all(output, input, output_counts, input_counts, tag=1))
        return output

    for r, got in enumerate(on_threads(body, size=size, native=True)):
        assert torch.equal(got, torch.cat([sent(j, r) for j in range(size)])), f"rank {r}"


@pytest.mark.parametrize("native", PATHS)
def test_all_reduce_across_hosts_of_one_host_is_the_all_reduce(native):
    # A communicator between hosts of one host (``local``): the hierarchical steps within the host alone.
    across = LocalCommunicator(Context(Topology(), timedelta(seconds=30)))
    cases = [(op, dtype) for op in (Op.SUM, Op.AVERAGE, Op.MAX) for dtype in (torch.float32, torch.bfloat16)]

    def body(plane):
        out = []
        for i, (op, dtype) in enumerate(cases):
            tensor = stack(plane.size, 40_000, dtype, seed=i)[plane.rank].clone()
            wait(plane.all_reduce_across(tensor, op, across, plane.size, tag=i))
            out.append(tensor)
        return out

    results = on_threads(body, native=native)
    for i, (op, dtype) in enumerate(cases):
        expected = reduced(stack(2, 40_000, dtype, seed=i), op)
        assert all(torch.equal(got[i], expected) for got in results), f"{op.name} of {dtype}"


def test_the_compiled_core_and_the_python_path_give_the_same_bits():
    if shm.native is None:
        pytest.skip("the compiled core is not built here (no C compiler at install)")
    inputs = torch.randn(3, 50_000, generator=torch.Generator().manual_seed(7))

    def body(plane):
        out = []
        for i, (op, n) in enumerate([(Op.SUM, 100), (Op.SUM, 50_000), (Op.AVERAGE, 50_000), (Op.PRODUCT, 1000)]):
            tensor = inputs[plane.rank, :n].clone()
            wait(plane.all_reduce(tensor, op, tag=i))
            out.append(tensor)
        return out

    core, python = on_threads(body, size=3, native=True), on_threads(body, size=3, native=False)
    for rank in range(3):
        for a, b in zip(core[rank], python[rank]):
            assert torch.equal(a, b)
    assert all(torch.equal(a, b) for a, b in zip(core[0], core[2]))  # and every rank has the same bits


@pytest.mark.parametrize("native", PATHS)
def test_a_mismatch_raises_on_every_rank_and_the_plane_goes_on(native):
    def body(plane):
        tensor = torch.ones(10)
        try:
            wait(plane.all_reduce(tensor, Op.SUM if plane.rank == 0 else Op.MAX, tag=1))
        except CollectiveMismatchError as exc:
            error = str(exc)
        else:
            error = None
        after = torch.full((10,), float(plane.rank + 1))
        wait(plane.all_reduce(after, Op.SUM, tag=2))
        return error, tensor, after

    for error, tensor, after in on_threads(body, native=native):
        assert error is not None and "shared-memory plane" in error
        assert torch.equal(tensor, torch.ones(10))  # no result was written
        assert torch.equal(after, torch.full((10,), 3.0))


@pytest.mark.parametrize("native", PATHS)
def test_a_wait_for_a_rank_not_yet_there_reaches_its_deadline_and_the_operation_completes_later(native):
    import threading

    arrived = threading.Event()

    def body(plane):
        tensor = torch.full((100_000,), float(plane.rank + 1))
        if plane.rank == 1:
            arrived.wait(10)
            pending = plane.all_reduce(tensor, Op.SUM, tag=1)
            wait(pending)
            return None, tensor
        pending = plane.all_reduce(tensor, Op.SUM, tag=1)
        started = time.monotonic()
        timed_out = not poll(pending.test, started + 0.2)
        waited = time.monotonic() - started
        arrived.set()
        wait(pending)
        return (timed_out, waited), tensor

    (early, first), (_, second) = on_threads(body, native=native)
    timed_out, waited = early
    assert timed_out and 0.2 <= waited < 5
    assert torch.equal(first, torch.full((100_000,), 3.0)) and torch.equal(second, first)
