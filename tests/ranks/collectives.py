"""Every collective of smddp.torch.distributed, checked on every rank.

Run by tests/comm/test_collectives.py under mpirun -np 2/3 and torchrun. Each rank builds the
inputs of *all* ranks from seeds, so it knows the exact answer without communicating.
Prints ``CHECK <rank> <name>`` per passed check, ``DIGEST <rank> <sha256>`` of every
result (ranks must agree bit for bit), then ``PASSED <rank> <count>``.
"""

from __future__ import annotations

import hashlib
import os
import sys
from datetime import timedelta

import torch

import smddp
import smddp.torch.distributed as dist
from smddp.torch import groups

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64,
          torch.uint8, torch.int8, torch.int32, torch.int64]
OPS = [dist.ReduceOp.SUM, dist.ReduceOp.AVERAGE, dist.ReduceOp.MIN, dist.ReduceOp.MAX]
# 17 elements take MPI_Iallreduce; 300,000 take the ring (>= 256 KB for every dtype).
SIZES = [17, 300_000]

digest = hashlib.sha256()
checks = 0


def passed(name: str) -> None:
    global checks
    checks += 1
    print(f"CHECK {rank} {name}", flush=True)


def record(t: torch.Tensor) -> None:
    digest.update(t.contiguous().view(torch.uint8).numpy().tobytes())


def inputs(r: int, numel: int, dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * r + numel + salt)
    if dtype.is_floating_point:
        return torch.randn(numel, generator=g, dtype=torch.float64).to(dtype)
    low = 0 if dtype == torch.uint8 else -20
    return torch.randint(low, 40, (numel,), generator=g, dtype=torch.int64).to(dtype)


def expected_reduce(stack: torch.Tensor, op, dtype: torch.dtype) -> torch.Tensor:
    wide = stack.to(torch.float64 if dtype.is_floating_point else torch.int64)
    if op == dist.ReduceOp.SUM:
        out = wide.sum(0)
    elif op == dist.ReduceOp.AVERAGE:
        out = wide.sum(0) / size if dtype.is_floating_point else torch.div(wide.sum(0), size, rounding_mode="trunc")
    elif op == dist.ReduceOp.MIN:
        out = wide.min(0).values
    else:
        out = wide.max(0).values
    return out.to(dtype)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    if actual.dtype in (torch.float16, torch.bfloat16):
        torch.testing.assert_close(actual.double(), expected.double(), rtol=2e-2, atol=2e-2, msg=what)
    elif actual.dtype.is_floating_point:
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5, msg=what)
    else:
        assert torch.equal(actual, expected), f"{what}: {actual[:8]} != {expected[:8]}"


def check_all_reduce() -> None:
    for dtype in DTYPES:
        for numel in SIZES:
            stack = torch.stack([inputs(r, numel, dtype) for r in range(size)])
            for op in OPS:
                t = stack[rank].clone()
                assert dist.all_reduce(t, op=op) is None
                assert_close(t, expected_reduce(stack, op, dtype), f"all_reduce {op} {dtype} {numel}")
                record(t)
        passed(f"all_reduce/{dtype}")
    # op=None means SUM, as the reference says
    t = torch.full((4,), float(rank + 1))
    dist.all_reduce(t, op=None)
    assert torch.equal(t, torch.full((4,), float(size * (size + 1) // 2)))
    passed("all_reduce/op_none")


def check_non_contiguous() -> None:
    stack = torch.stack([inputs(r, 6 * 8, torch.float32, salt=7).view(6, 8) for r in range(size)])
    base = stack[rank].clone()
    view = base[:, ::2]  # every other column: not contiguous
    assert not view.is_contiguous()
    dist.all_reduce(view, op=dist.ReduceOp.MAX)
    expected = stack.max(0).values
    assert torch.equal(base[:, ::2], expected[:, ::2]), "strided all_reduce result"
    assert torch.equal(base[:, 1::2], stack[rank][:, 1::2]), "all_reduce touched elements outside the view"
    big = torch.stack([inputs(r, 2 * 200_000, torch.float32, salt=8).view(200_000, 2) for r in range(size)])
    col = big[rank].clone()[:, 1]
    dist.all_reduce(col)
    torch.testing.assert_close(col, big[:, :, 1].sum(0))
    b = torch.zeros(5, 4)
    if rank == size - 1:
        b += torch.arange(20.0).view(5, 4)
    dist.broadcast(b.t(), src=size - 1)
    assert torch.equal(b, torch.arange(20.0).view(5, 4))
    passed("non_contiguous")


def check_requires_grad() -> None:
    w = torch.ones(3, requires_grad=True)
    with torch.no_grad():
        dist.all_reduce(w)
    assert torch.equal(w.detach(), torch.full((3,), float(size)))
    passed("requires_grad")


def check_broadcast() -> None:
    for src in sorted({0, size - 1}):
        for dtype in DTYPES:
            t = inputs(rank, 33, dtype, salt=src)
            dist.broadcast(t, src=src)
            assert torch.equal(t, inputs(src, 33, dtype, salt=src)), f"broadcast from {src} {dtype}"
            record(t)
        big = inputs(rank, 500_000, torch.float32, salt=src)
        dist.broadcast(big, src)
        assert torch.equal(big, inputs(src, 500_000, torch.float32, salt=src))
        passed(f"broadcast/src{src}")


def check_all_gather() -> None:
    for dtype in DTYPES:
        mine = inputs(rank, 12, dtype, salt=3).view(3, 4)
        out = [torch.empty(3, 4, dtype=dtype) for _ in range(size)]
        dist.all_gather(out, mine)
        for r in range(size):
            assert torch.equal(out[r], inputs(r, 12, dtype, salt=3).view(3, 4)), f"all_gather slot {r} {dtype}"
    passed("all_gather/order")


def check_all_to_all() -> None:
    # equal splits: 2 rows per peer
    rows = 2 * size
    mine = torch.stack([inputs(rank, 3, torch.float32, salt=100 + i) for i in range(rows)])
    out = torch.empty(rows, 3)
    dist.all_to_all_single(out, mine)
    for src in range(size):
        theirs = torch.stack([inputs(src, 3, torch.float32, salt=100 + i) for i in range(rows)])
        assert torch.equal(out[2 * src:2 * src + 2], theirs[2 * rank:2 * rank + 2]), f"equal split from {src}"
    passed("all_to_all/equal")

    # uneven: rank i sends i + j + 1 rows to rank j
    def send_sizes(i):
        return [i + j + 1 for j in range(size)]

    def rows_of(i):
        return torch.stack([inputs(i, 2, torch.int64, salt=200 + k) for k in range(sum(send_sizes(i)))])

    in_splits = send_sizes(rank)
    out_splits = [send_sizes(i)[rank] for i in range(size)]
    out = torch.empty(sum(out_splits), 2, dtype=torch.int64)
    dist.all_to_all_single(out, rows_of(rank), output_split_sizes=out_splits, input_split_sizes=in_splits)
    offset = 0
    for src in range(size):
        start = sum(send_sizes(src)[:rank])
        expect = rows_of(src)[start:start + out_splits[src]]
        assert torch.equal(out[offset:offset + out_splits[src]], expect), f"uneven split from {src}"
        offset += out_splits[src]
    passed("all_to_all/uneven")


def check_async() -> None:
    tensors = [torch.full((1000,), float(rank + i)) for i in range(4)]
    handles = [dist.all_reduce(t, async_op=True) for t in tensors]
    handles.append(dist.broadcast(torch.zeros(3), src=0, async_op=True))
    handles.append(dist.barrier(async_op=True))
    for h in handles:
        assert h is not None
        h.wait()
        assert h.is_completed()
    for i, t in enumerate(tensors):
        assert torch.equal(t, torch.full((1000,), float(sum(r + i for r in range(size)))))
    passed("async_handles")


def check_torch_interop() -> None:
    import torch.distributed as tdist

    assert tdist.is_initialized()
    assert tdist.get_rank() == rank and tdist.get_world_size() == size
    t = torch.full((5,), float(rank + 1))
    tdist.all_reduce(t)
    assert torch.equal(t, torch.full((5,), float(size * (size + 1) // 2)))
    t = torch.full((5,), float(rank))
    tdist.all_reduce(t, op=tdist.ReduceOp.MAX)
    assert torch.equal(t, torch.full((5,), float(size - 1)))
    out = [torch.empty(2) for _ in range(size)]
    tdist.all_gather(out, torch.full((2,), float(rank)))
    assert [o[0].item() for o in out] == [float(r) for r in range(size)]
    b = torch.full((3,), float(rank))
    tdist.broadcast(b, src=size - 1)
    assert torch.equal(b, torch.full((3,), float(size - 1)))
    tdist.barrier()
    obj = [None]
    if rank == 0:
        obj = [{"epoch": 3}]
    tdist.broadcast_object_list(obj, src=0)
    assert obj == [{"epoch": 3}]
    passed("torch_interop")

    # torch's own DDP on the smddp backend: gradients are the average over ranks
    torch.manual_seed(rank)  # different starting weights: DDP must broadcast rank 0's
    model = torch.nn.Linear(4, 1)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    torch.manual_seed(0)
    reference = torch.nn.Linear(4, 1)
    assert torch.equal(model.weight.detach(), reference.weight.detach()), "DDP did not broadcast rank 0's weights"
    xs = [torch.randn(3, 4, generator=torch.Generator().manual_seed(r)) for r in range(size)]
    ddp(xs[rank]).sum().backward()
    for x in xs:
        reference(x).sum().backward()
    torch.testing.assert_close(model.weight.grad, reference.weight.grad / size)
    passed("torch_ddp")


def check_torch_reductions() -> None:
    """torch.distributed's bitwise reductions and reduce_scatter of chunks of different sizes on the
    smddp backend: the values computed here, and the bits torch's gloo group gives on the same inputs."""
    import torch.distributed as tdist

    R = tdist.ReduceOp
    gloo = tdist.new_group(backend="gloo")
    folds = {R.BAND: torch.bitwise_and, R.BOR: torch.bitwise_or, R.BXOR: torch.bitwise_xor, R.SUM: torch.add,
             R.MAX: torch.maximum}

    def bits(r: int, numel: int, dtype: torch.dtype, salt: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(500 * r + numel + salt)
        if dtype is torch.bool:
            return torch.randint(0, 2, (numel,), generator=g).bool()
        info = torch.iinfo(dtype)
        return torch.randint(max(info.min, -2**62), min(info.max, 2**62), (numel,), generator=g).to(dtype)

    def fold(rows, op):
        acc = rows[0].clone()
        for row in rows[1:]:
            acc = folds[op](acc, row)
        return acc

    for dtype in (torch.bool, torch.uint8, torch.int8, torch.int32, torch.int64):
        for k, op in enumerate((R.BAND, R.BOR, R.BXOR)):
            rows = [bits(r, 37, dtype, k) for r in range(size)]
            t, theirs = rows[rank].clone(), rows[rank].clone()
            tdist.all_reduce(t, op=op)
            tdist.all_reduce(theirs, op=op, group=gloo)
            assert torch.equal(t, fold(rows, op)), (dtype, op)
            assert torch.equal(t.view(torch.uint8), theirs.view(torch.uint8)), (dtype, op, "not gloo's bits")
            record(t)
        passed(f"torch_bitwise/{dtype}")
    counts = [2 + 3 * j for j in range(size)]  # rank j's chunk: 2 + 3j elements
    for k, (dtype, op) in enumerate(((torch.float32, R.SUM), (torch.float32, R.MAX), (torch.int32, R.BXOR),
                                     (torch.bool, R.BOR), (torch.int64, R.SUM))):
        if dtype.is_floating_point:
            lists = [[inputs(r * size + j, n, dtype, salt=60 + k).round() for j, n in enumerate(counts)]
                     for r in range(size)]  # whole numbers: exact in any order of summation
        else:
            lists = [[bits(r * size + j, n, dtype, 60 + k) for j, n in enumerate(counts)] for r in range(size)]
        out, theirs = torch.zeros(counts[rank], dtype=dtype), torch.zeros(counts[rank], dtype=dtype)
        tdist.reduce_scatter(out, [c.clone() for c in lists[rank]], op=op)
        tdist.reduce_scatter(theirs, [c.clone() for c in lists[rank]], op=op, group=gloo)
        assert torch.equal(out, fold([lists[r][rank] for r in range(size)], op)), (dtype, op)
        assert torch.equal(out.view(torch.uint8), theirs.view(torch.uint8)), (dtype, op, "not gloo's bits")
    passed("torch_reduce_scatter_uneven")
    expect_error(TypeError, lambda: tdist.all_reduce(torch.ones(3), op=R.BAND), "BAND of float32")
    passed("torch_bitwise_refused")


def expect_error(exc_type, fn, *words) -> None:
    try:
        fn()
    except exc_type as exc:
        assert isinstance(exc, smddp.SMDDPError), f"{type(exc)} is not an SMDDPError"
        for word in words:
            assert word in str(exc), f"{word!r} not in {exc}"
        return
    raise AssertionError(f"{fn} did not raise {exc_type.__name__}")


def check_bad_input() -> None:
    t = torch.ones(4)
    expect_error(ValueError, lambda: dist.all_reduce(t, group=object()), "group.WORLD")
    expect_error(ValueError, lambda: dist.barrier(group="world"), "group.WORLD")
    expect_error(ValueError, lambda: dist.get_rank(group=1), "group.WORLD")
    expect_error(TypeError, lambda: dist.all_reduce([1.0, 2.0]), "Tensor")
    expect_error(TypeError, lambda: dist.broadcast(3, src=0), "Tensor")
    expect_error(ValueError, lambda: dist.all_reduce(t, op="sum"), "ReduceOp.SUM")
    expect_error(ValueError, lambda: dist.broadcast(t, src=size), "src")
    expect_error(ValueError, lambda: dist.all_gather([torch.ones(4)] * (size + 1), t), "one per rank")
    expect_error(ValueError, lambda: dist.all_gather([torch.ones(3)] * size, t), "shape")
    expect_error(TypeError, lambda: dist.all_gather(torch.ones(4), t), "list")
    out = torch.empty(size * 2)
    ones = torch.ones(size * 2)
    expect_error(ValueError, lambda: dist.all_to_all_single(out, ones, [2] * size, [1] * size), "add up")
    expect_error(ValueError, lambda: dist.all_to_all_single(out, torch.ones(size * 2), [2] * (size + 1)), "split")
    expect_error(ValueError, lambda: dist.all_to_all_single(torch.empty(size * 2 + 1), torch.ones(size * 2 + 1)),
                 "divisible")
    expect_error(TypeError, lambda: dist.all_reduce(torch.ones(2, dtype=torch.complex64)), "dtype")
    # nothing above communicated: the next collective still matches on every rank
    t = torch.ones(2)
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((2,), float(size)))
    passed("bad_input")


def check_repeated_init() -> None:
    """init_process_group() again: no arguments, or the group's own, change nothing; any other
    argument raises on the calling rank, naming it, and the group keeps what it was made with."""
    engine = groups.current().engine
    timeout = engine.timeout
    dist.init_process_group()
    dist.init_process_group(dist.get_backend(), timeout=timedelta(seconds=timeout), rank=rank, world_size=size)
    expect_error(ValueError, lambda: dist.init_process_group(timeout=timedelta(seconds=3)),
                 "timeout=0:00:03", "destroy_process_group()")
    expect_error(ValueError, lambda: dist.init_process_group(backend="local"), "backend='local'")
    expect_error(ValueError, lambda: dist.init_process_group(rank=(rank + 1) % size), "rank=")
    expect_error(ValueError, lambda: dist.init_process_group(world_size=size + 1), "world_size=")
    expect_error(ValueError, lambda: dist.init_process_group(init_method="tcp://127.0.0.1:1"), "init_method=")
    assert groups.current().engine is engine and engine.timeout == timeout, (engine.timeout, timeout)
    stack = torch.stack([inputs(r, 9, torch.int64, salt=44) for r in range(size)])
    t = stack[rank].clone()
    dist.all_reduce(t)
    assert torch.equal(t, stack.sum(0)), (t, stack.sum(0))
    passed("repeated_init")


if __name__ == "__main__":
    expected_backend = sys.argv[1] if len(sys.argv) > 1 else None
    assert dist.is_available()
    assert not dist.is_initialized()
    dist.init_process_group()
    assert dist.is_initialized()
    rank, size = dist.get_rank(), dist.get_world_size()
    if expected_backend:
        assert dist.get_backend() == expected_backend, (dist.get_backend(), expected_backend)
    assert 0 <= dist.get_local_rank() < dist.get_local_size() <= size
    lr = os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK") or os.environ.get("LOCAL_RANK")
    assert dist.get_local_rank() == int(lr), (dist.get_local_rank(), lr)
    passed("topology")
    for check in (check_all_reduce, check_non_contiguous, check_requires_grad, check_broadcast, check_all_gather,
                  check_all_to_all, check_async, check_torch_interop, check_torch_reductions, check_bad_input,
                  check_repeated_init):
        check()
    print(f"DIGEST {rank} {digest.hexdigest()}", flush=True)
    dist.destroy_process_group()
    assert not dist.is_initialized()
    print(f"PASSED {rank} {checks}", flush=True)
