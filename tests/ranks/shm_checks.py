"""The MPI backend's CPU planes, checked on every rank; run by tests/comm/planes/test_shm.py under mpirun.

``python shm_checks.py MODE PLANE``: PLANE is the plane the job must be on. Every rank builds
every rank's inputs from seeds, so it knows the exact answer without communicating. Prints
``CHECK <rank> <name>`` per passed check, ``DIGEST <rank> <sha256>`` over float results (ranks
must agree bit for bit), ``PLANES <rank> <collective:plane,...>``, then ``PASSED <rank> <count>``.

Modes: ``checks`` (every collective, dtype and op; async operations waited out of order),
``switch`` (all-reduces of every dtype and op at sizes on either side of every size where the
plane changes path or cuts its steps: the one-step limits, the single-copy threshold, the
slices, the slot; ``switch light``: float32, bfloat16 and int64 only),
``kill`` (rank 1 kills itself with SIGKILL in the middle of all-reduces of
``SHM_CHECKS_KILL_NUMEL`` floats, 1000 by default; the others must fail, not hang), ``idle``
(rank 1 sleeps a second before an all-reduce; the others print the CPU seconds their waiting
thread used, ``WAITCPU <rank> <cpu> <wall>``). ``CORE <rank> native|python``
says which implementation ran the shared-memory plane; ``SHM_CHECKS_PYTHON_ON_RANK=R`` turns the
compiled core off on rank R alone (the ranks must then agree on the Python path), and
``SHM_CHECKS_NO_CMA_ON_RANK=R`` the single-copy all-reduce (``SMDDP_SHM_CMA=0``).
``SINGLECOPY <rank> <threshold> <count>``: the plane's single-copy threshold (0: the host does not
read its peers' memory) and how many all-reduces took that path.

``checks`` also runs what torch's gloo group runs on the same inputs, over a gloo group of the
same ranks, and requires the same bits: the bitwise reductions (and bool's others) and
``reduce_scatter`` of chunks of different sizes, through ``torch.distributed``.
"""

from __future__ import annotations

import hashlib
import os
import signal
import socket
import sys
import time

import torch

torch.set_num_threads(1)

import torch.distributed as tdist  # noqa: E402

import smddp  # noqa: E402
import smddp.torch.distributed as dist  # noqa: E402
from smddp.comm.algorithms import derived  # noqa: E402
from smddp.comm.planes.shm_torch import ONE_SHOT_MAX  # noqa: E402
from smddp.comm.reduction import Op  # noqa: E402
from smddp.torch import groups  # noqa: E402

MODE, PLANE = sys.argv[1], sys.argv[2]
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64,
          torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64]
# 5 elements: one step; 12,345: one step in the Python path, sliced in the compiled core
# (above its 32 KiB one-shot limit) for most dtypes; 70,000: past a 64 KiB slot (sliced) for
# every dtype but int8/uint8, and past the compiled core's 256 KiB steps for 8-byte dtypes.
SIZES = [5, 12_345, 70_000]
OPS = [Op.SUM, Op.AVERAGE, Op.MIN, Op.MAX, Op.PRODUCT]

_LAUNCHED_RANK = os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("RANK"))
if os.environ.get("SHM_CHECKS_PYTHON_ON_RANK", "-") == _LAUNCHED_RANK:
    os.environ["SMDDP_SHM_NATIVE"] = "0"
if os.environ.get("SHM_CHECKS_NO_CMA_ON_RANK", "-") == _LAUNCHED_RANK:
    os.environ["SMDDP_SHM_CMA"] = "0"
dist.init_process_group()
rank, size = dist.get_rank(), dist.get_world_size()
engine = groups.current().engine
comm = engine.comms["cpu"]
DTYPES = [d for d in DTYPES if d in comm.dtypes]  # gloo has no int16
digest = hashlib.sha256()
checks = 0


def passed(name: str) -> None:
    global checks
    checks += 1
    print(f"CHECK {rank} {name}", flush=True)


def values(r: int, numel: int, dtype: torch.dtype, salt: int, op: Op = Op.SUM) -> torch.Tensor:
    """Small integers (exact in every dtype and under any summation order), seeded per rank."""
    g = torch.Generator().manual_seed(7919 * r + 31 * numel + salt)
    if op is Op.PRODUCT:
        return torch.randint(1, 3, (numel,), generator=g).to(dtype)
    low = 0 if dtype == torch.uint8 else -9
    return torch.randint(low, 10, (numel,), generator=g).to(dtype)


def expected(stack: torch.Tensor, op: Op, dtype: torch.dtype) -> torch.Tensor:
    wide = stack.to(torch.float64 if dtype.is_floating_point else torch.int64)
    if op is Op.SUM:
        out = wide.sum(0)
    elif op is Op.AVERAGE:
        out = wide.sum(0) / size if dtype.is_floating_point else torch.div(wide.sum(0), size, rounding_mode="trunc")
    elif op is Op.MIN:
        out = wide.min(0).values
    elif op is Op.MAX:
        out = wide.max(0).values
    else:
        out = wide.prod(0)
    return out.to(dtype)


def drive(pending) -> None:
    deadline = time.monotonic() + 60
    while not pending.test():
        assert time.monotonic() < deadline, "communicator operation did not complete in 60 s"


def exact_all_reduce(dtype: torch.dtype, numel: int, op: Op, salt: int, label: str) -> None:
    """All-reduce seeded per-rank values and compare with the sum computed here, on every rank."""
    if op is Op.PRODUCT and dtype in (torch.int8, torch.uint8, torch.float16, torch.bfloat16):
        return  # products of 2s overflow these
    stack = torch.stack([values(r, numel, dtype, salt, op) for r in range(size)])
    t = stack[rank].clone()
    if op is Op.PRODUCT:  # not in smddp's ReduceOp: straight to the engine
        engine.all_reduce(t, op)
    else:
        dist.all_reduce(t, op=_REDUCE_OPS[op])
    want = expected(stack, op, dtype)
    assert torch.equal(t, want), (dtype, numel, op, (t != want).nonzero()[:5])
    passed(f"{label}/{dtype}/{numel}/{op.name}")


def check_all_reduce() -> None:
    for dtype in DTYPES:
        for numel in SIZES:
            for op in OPS:
                exact_all_reduce(dtype, numel, op, 1, "all_reduce")


def check_random_bits() -> None:
    """Random floats: results close to float64's and bitwise identical on every rank (DIGEST)."""
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        for numel in SIZES:
            g = [torch.Generator().manual_seed(100 * r + numel) for r in range(size)]
            stack = torch.stack([torch.randn(numel, generator=g[r], dtype=torch.float64) for r in range(size)])
            t = stack[rank].to(dtype).clone()  # float64: .to() alone would alias stack
            dist.all_reduce(t)
            tol = 1e-2 if dtype in (torch.float16, torch.bfloat16) else 1e-5
            assert torch.allclose(t.double(), stack.to(dtype).double().sum(0), rtol=tol, atol=tol * size)
            digest.update(t.view(torch.uint8).numpy().tobytes())
            passed(f"all_reduce-random/{dtype}/{numel}")


def check_every_half_pattern() -> None:
    """Every float16 and bfloat16 bit pattern, all-reduced: the bits torch's conversions give.

    Rank r holds all 65,536 patterns, rotated by 7,919 r, so every pattern (subnormals,
    infinities, NaNs, both zeros) meets others; the expected result is computed here as the
    plane computes it: float32 in rank order, divided for AVERAGE, rounded once by torch.
    Exact bit for bit but for NaNs, which only need to be NaN where torch's are (torch's own
    conversions keep NaN payloads in one code path and not in another).
    """
    patterns = torch.arange(65536, dtype=torch.int32).to(torch.int16)
    for dtype in (torch.float16, torch.bfloat16):
        inputs = [torch.roll(patterns, 7919 * r).view(dtype) for r in range(size)]
        acc = inputs[0].float()
        for r in range(1, size):
            acc = acc + inputs[r].float()
        for op, want in ((Op.SUM, acc.to(dtype)), (Op.AVERAGE, (acc / size).to(dtype))):
            t = inputs[rank].clone()
            dist.all_reduce(t, op=_REDUCE_OPS[op])
            nan = torch.isnan(want)
            assert torch.equal(torch.isnan(t), nan), (dtype, op, "NaN where torch has none, or none where it has")
            bits, expected_bits = t.view(torch.int16)[~nan], want.view(torch.int16)[~nan]
            wrong = (bits != expected_bits).nonzero().flatten()[:5]
            pairs = [(hex(int(bits[i]) & 0xFFFF), hex(int(expected_bits[i]) & 0xFFFF)) for i in wrong]
            assert wrong.numel() == 0, (dtype, op, "got, torch's:", pairs)
            passed(f"all_reduce-every-pattern/{dtype}/{op.name}")


def check_reduce_scatter() -> None:
    for dtype in DTYPES:
        for numel in SIZES:
            for op in (Op.SUM, Op.AVERAGE, Op.MAX):
                stack = torch.stack([values(r, numel * size, dtype, 2) for r in range(size)])
                out = torch.full((numel,), 77, dtype=dtype)
                drive(comm.reduce_scatter(out, stack[rank].clone(), op, 0))
                want = expected(stack, op, dtype)[rank * numel:(rank + 1) * numel]
                assert torch.equal(out, want), (dtype, numel, op)
                passed(f"reduce_scatter/{dtype}/{numel}/{op.name}")


def check_reduce_scatter_tensor() -> None:
    """torch's reduce_scatter_tensor as the backend runs it: the plane's native reduce-scatter."""
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        for numel in SIZES:
            stack = torch.stack([values(r, numel * size, dtype, 6) for r in range(size)])
            out = torch.full((numel,), 77, dtype=dtype)
            derived.reduce_scatter_tensor(engine, out, stack[rank].clone(), Op.SUM).wait()
            want = expected(stack, Op.SUM, dtype)[rank * numel:(rank + 1) * numel]
            assert torch.equal(out, want), (dtype, numel)
            passed(f"reduce_scatter_tensor/{dtype}/{numel}")


R = tdist.ReduceOp
#: torch's reductions by smddp's Op, to compute what they give here (rank order).
_FOLDS = {R.SUM: torch.add, R.MIN: torch.minimum, R.MAX: torch.maximum, R.PRODUCT: torch.mul,
          R.BAND: torch.bitwise_and, R.BOR: torch.bitwise_or, R.BXOR: torch.bitwise_xor}
BITWISE = (R.BAND, R.BOR, R.BXOR)
#: The dtypes of the bitwise reductions, as gloo has them (no int16).
BITWISE_DTYPES = [d for d in (torch.bool, torch.uint8, torch.int8, torch.int32, torch.int64) if d in comm.dtypes]


def bits(r: int, numel: int, dtype: torch.dtype, salt: int) -> torch.Tensor:
    """Seeded random bits over the whole range of ``dtype`` (0 and 1 for bool)."""
    g = torch.Generator().manual_seed(7919 * r + 31 * numel + salt)
    if dtype is torch.bool:
        return torch.randint(0, 2, (numel,), generator=g).bool()
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -2**62), min(info.max, 2**62), (numel,), generator=g).to(dtype)


def folded(stack: torch.Tensor, op) -> torch.Tensor:
    """``op`` of the rows of ``stack`` in rank order, as torch computes it (bool: SUM an or)."""
    acc = stack[0].clone()
    for row in stack[1:]:
        acc = _FOLDS[op](acc, row)
    return acc


def same_as_gloo(t: torch.Tensor, want: torch.Tensor, gloo_result, what) -> None:
    """``t`` equals ``want`` (computed here) and ``gloo_result`` (gloo's, None where gloo has no such
    reduction), bit for bit."""
    assert t.dtype == want.dtype, (what, t.dtype, want.dtype)
    assert torch.equal(t, want), (what, (t != want).nonzero()[:5].flatten())
    if gloo_result is not None:
        assert torch.equal(t.view(-1).view(torch.uint8), gloo_result.view(-1).view(torch.uint8)), (what, "gloo's")


def check_bitwise() -> None:
    """BAND, BOR and BXOR of integers and bools, bool's other reductions, through torch.distributed:
    the bits computed here and gloo's, at every size the plane cuts differently."""
    for dtype in BITWISE_DTYPES:
        ops = BITWISE + ((R.SUM, R.MIN, R.MAX, R.PRODUCT) if dtype is torch.bool else ())
        for numel in SIZES:
            for k, op in enumerate(ops):
                stack = torch.stack([bits(r, numel, dtype, 11 + k) for r in range(size)])
                t, theirs = stack[rank].clone(), stack[rank].clone()
                tdist.all_reduce(t, op=op)
                tdist.all_reduce(theirs, op=op, group=GLOO)
                if op == R.SUM and dtype is torch.bool:
                    # gloo adds bool's bytes (two Trues give the byte 2, 256 wrap to False); smddp, as
                    # torch's NCCL group, gives a logical or: the same truth values while they do not wrap.
                    theirs = theirs.view(torch.uint8).ne(0)
                same_as_gloo(t, folded(stack, op), theirs, (dtype, numel, op))
                digest.update(t.view(torch.uint8).numpy().tobytes())
            passed(f"all_reduce-bitwise/{dtype}/{numel}")


def refuses(words: str, call) -> None:
    try:
        call()
    except smddp.InvalidTypeError as exc:
        assert words in str(exc) and "object at" not in str(exc), exc
    else:
        raise AssertionError(f"{words} was not refused")


def check_refused_reductions() -> None:
    """What no plane reduces is refused by name before anything is sent; the ranks stay in step."""
    refused = [(torch.float32, R.BAND, "BAND of float32"), (torch.float16, R.BOR, "BOR of float16"),
               (torch.float64, R.BXOR, "BXOR of float64"), (torch.bool, R.AVG, "AVERAGE of bool")]
    for dtype, op, words in refused:
        ones = torch.ones(4, dtype=dtype)
        refuses(words, lambda: tdist.all_reduce(ones, op=op))  # noqa: B023 - called at once
        refuses(words, lambda: tdist.reduce_scatter(ones[:1], [ones[:1]] * size, op=op))  # noqa: B023
        uneven = [ones[:r + 1] for r in range(size)]
        refuses(words, lambda: tdist.reduce_scatter(uneven[rank], uneven, op=op))  # noqa: B023
    t = torch.full((3,), rank + 1, dtype=torch.int64)
    tdist.all_reduce(t)
    assert torch.equal(t, torch.full((3,), size * (size + 1) // 2, dtype=torch.int64)), t
    passed("refused-reductions")


def check_reduce_scatter_uneven() -> None:
    """reduce_scatter of a list whose chunks differ in size (gloo and torch's NCCL group take it):
    every op of every dtype, the bits computed here and gloo's; chunks from empty to past a slot."""
    arithmetic = {R.SUM: Op.SUM, R.AVG: Op.AVERAGE, R.MIN: Op.MIN, R.MAX: Op.MAX, R.PRODUCT: Op.PRODUCT}
    every = [(dtype, tuple(arithmetic)) for dtype in (torch.float32, torch.bfloat16, torch.float64, torch.int64,
                                                      torch.int32, torch.uint8) if dtype in comm.dtypes]
    every += [(dtype, BITWISE) for dtype in BITWISE_DTYPES]
    # Large chunks (past a slot, and the hierarchical plane's threshold): fewer cases, the same paths.
    large = [(torch.float32, (R.SUM, R.AVG, R.MAX)), (torch.bfloat16, (R.SUM,)), (torch.int64, (R.BXOR, R.MIN)),
             (torch.bool, (R.BOR,))]
    chunkings = [([3 + 4 * j for j in range(size)], every), ([1] + [0] * (size - 1), every),
                 ([70_001 - 9_000 * j if j % 2 else 5 + j for j in range(size)], large)]
    for counts, cases in chunkings:
        for dtype, ops in cases:
            for k, op in enumerate(ops):
                if op in BITWISE:
                    lists = [[bits(r * size + j, n, dtype, 40 + k) for j, n in enumerate(counts)] for r in range(size)]
                else:
                    lists = [[values(r * size + j, n, dtype, 40 + k, arithmetic[op]) for j, n in enumerate(counts)]
                             for r in range(size)]
                stack = torch.stack([lists[r][rank] for r in range(size)])
                want = folded(stack, op) if op in BITWISE else expected(stack, arithmetic[op], dtype)
                out = torch.full((counts[rank],), 77, dtype=dtype)
                tdist.reduce_scatter(out, [c.clone() for c in lists[rank]], op=op)
                theirs = None
                if op != R.AVG:  # gloo has no AVG of integers
                    theirs = torch.full((counts[rank],), 77, dtype=dtype)
                    tdist.reduce_scatter(theirs, [c.clone() for c in lists[rank]], op=op, group=GLOO)
                same_as_gloo(out, want, theirs, ("reduce_scatter uneven", counts, dtype, op))
            passed(f"reduce_scatter-uneven/{counts}/{dtype}")


def check_gather_broadcast() -> None:
    for dtype in DTYPES:
        for numel in SIZES:
            mine = values(rank, numel, dtype, 3)
            out = torch.empty(size * numel, dtype=dtype)
            engine.all_gather_into_tensor(out, mine)
            assert torch.equal(out, torch.cat([values(r, numel, dtype, 3) for r in range(size)]))
            passed(f"all_gather/{dtype}/{numel}")
            for src in range(size):
                t = values(rank, numel, dtype, 4 + src)
                dist.broadcast(t, src=src)
                assert torch.equal(t, values(src, numel, dtype, 4 + src))
                passed(f"broadcast/{dtype}/{numel}/src{src}")
    dist.barrier()
    passed("barrier")


def check_edges() -> None:
    """Empty tensors, NaN under MIN/MAX (it wins, as in torch.minimum), integer sums that wrap."""
    empty = torch.empty(0)
    dist.all_reduce(empty)
    dist.broadcast(empty, src=size - 1)
    gathered = torch.empty(0)
    engine.all_gather_into_tensor(gathered, empty)
    passed("empty")
    # NaN under MIN/MAX is the shared-memory plane's promise (torch.minimum's); MPI's and gloo's
    # comparisons may drop it, depending on the order they reduce in.
    nan_ops = ((dist.ReduceOp.MIN, torch.minimum), (dist.ReduceOp.MAX, torch.maximum)) if PLANE == "shm" else ()
    for op, reduce in nan_ops:
        stack = torch.stack([values(r, 9, torch.float32, 8) for r in range(size)])
        stack[1, 4] = float("nan")  # rank 1's element 4
        want = stack[0]
        for r in range(1, size):
            want = reduce(want, stack[r])
        t = stack[rank].clone()
        dist.all_reduce(t, op=op)
        assert torch.equal(t.isnan(), want.isnan()) and t[4].isnan(), (t, want)
        assert torch.equal(t[~t.isnan()], want[~want.isnan()]), (t, want)
        passed(f"nan/{op}")
    big = torch.stack([torch.full((7,), 2**31 - 1 - r, dtype=torch.int32) for r in range(size)])
    want = big[0].clone()
    for r in range(1, size):
        want += big[r]  # torch's int32 sum wraps
    t = big[rank].clone()
    dist.all_reduce(t)
    assert torch.equal(t, want), (t, want)
    passed("int32-wraps")


def check_all_to_all() -> None:
    """Equal and uneven splits (empty parts, parts over several of the core's steps)."""
    src = torch.arange(size * 4, dtype=torch.int64) + 100 * rank
    out = torch.empty(size * 4, dtype=torch.int64)
    dist.all_to_all_single(out, src)
    want = torch.cat([torch.arange(rank * 4, rank * 4 + 4) + 100 * r for r in range(size)])
    assert torch.equal(out, want), (out, want)

    def rows(sender: int, receiver: int) -> int:  # a seeded, uneven matrix of part lengths
        return [0, 3, 40_000, 1][(sender + 2 * receiver) % 4]

    def part(sender: int, receiver: int, dtype: torch.dtype) -> torch.Tensor:
        n = rows(sender, receiver)
        return values(sender * size + receiver, n * 3, dtype, 7).view(n, 3)

    for dtype in (torch.float32, torch.bfloat16, torch.uint8):
        send = [rows(rank, r) for r in range(size)]
        recv = [rows(r, rank) for r in range(size)]
        src = torch.cat([part(rank, r, dtype) for r in range(size)])
        out = torch.zeros(sum(recv), 3, dtype=dtype)
        dist.all_to_all_single(out, src, output_split_sizes=recv, input_split_sizes=send)
        assert torch.equal(out, torch.cat([part(r, rank, dtype) for r in range(size)])), dtype
    passed("all_to_all_single")


def check_async_out_of_order() -> None:
    """Several operations in flight at once, waited in reverse: each must hold its own answer."""
    tensors = [values(rank, n, torch.float32, 5) for n in (3, 70_000, 11, 200_000)]
    handles = [dist.all_reduce(t, async_op=True) for t in tensors]
    gathered = torch.empty(size * 9, dtype=torch.int32)
    handles.append(engine.all_gather_into_tensor(gathered, torch.full((9,), rank, dtype=torch.int32), async_op=True))
    for h in reversed(handles):
        h.wait()
    for t, n in zip(tensors, (3, 70_000, 11, 200_000)):
        assert torch.equal(t, sum(values(r, n, torch.float32, 5) for r in range(size)))
    assert torch.equal(gathered, torch.arange(size, dtype=torch.int32).repeat_interleave(9))
    passed("async-reverse-waits")


def switch_sizes(itemsize: int) -> list:
    """Element counts on either side of every byte count where an all-reduce changes path or cut.

    From the group's agreed layout, which is the same whichever path runs (so jobs on different
    paths compare bit for bit): the compiled core's one-step limit, the single-copy threshold,
    the slot (the Python path's one-step limit and slice) and slices of the core's steps, among
    them one whose last slice has fewer elements than there are ranks.
    """
    agreed = comm.layout
    chunk = min(agreed.chunk_bytes, agreed.slot) // itemsize
    edges = {agreed.one_shot_max, agreed.cma_min_bytes, agreed.slot, min(ONE_SHOT_MAX, agreed.slot)}
    counts = {n + d for edge in edges for n in (edge // itemsize,) for d in (-1, 0, 1)}
    first = -(-max(agreed.cma_min_bytes // itemsize, chunk) // chunk)  # slices in the first sliced size
    counts |= {first * chunk + 1, (first + 1) * chunk + size - 1}
    return sorted(n for n in counts if n > 0)


def check_switch_points(light: bool) -> None:
    """Exact results at every switch point; random floats into DIGEST (bit for bit across paths)."""
    dtypes = [torch.float32, torch.bfloat16, torch.int64] if light else DTYPES
    ops = [Op.SUM, Op.AVERAGE, Op.MAX] if light else OPS
    for dtype in dtypes:
        for numel in switch_sizes(dtype.itemsize):
            for op in ops:
                exact_all_reduce(dtype, numel, op, 9, "switch")
            if dtype.is_floating_point:
                for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVERAGE):
                    g = [torch.Generator().manual_seed(1000 * r + numel) for r in range(size)]
                    t = torch.randn(numel, generator=g[rank], dtype=torch.float64).to(dtype)
                    dist.all_reduce(t, op=op)
                    digest.update(t.view(torch.uint8).numpy().tobytes())


def kill() -> None:
    t = torch.ones(int(os.environ.get("SHM_CHECKS_KILL_NUMEL", "1000")))
    for i in range(50):
        if rank == 1 and i == 20:
            print(f"KILLING {rank}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        dist.all_reduce(t)
    print(f"UNREACHABLE {rank}", flush=True)


def idle() -> None:
    t = torch.full((1000,), float(rank + 1))
    dist.barrier()
    if rank == 1:
        time.sleep(1.0)
    cpu, wall = time.thread_time(), time.monotonic()
    dist.all_reduce(t)
    print(f"WAITCPU {rank} {time.thread_time() - cpu:.3f} {time.monotonic() - wall:.3f}", flush=True)
    assert torch.equal(t, torch.full((1000,), float(size * (size + 1) // 2)))
    dist.destroy_process_group()
    print(f"PASSED {rank} 1", flush=True)


_REDUCE_OPS = {Op.SUM: dist.ReduceOp.SUM, Op.AVERAGE: dist.ReduceOp.AVERAGE, Op.MIN: dist.ReduceOp.MIN,
               Op.MAX: dist.ReduceOp.MAX}

# The plane is made at the group's first collective; every rank makes it here alike, first.
shm_plane = comm.open() if hasattr(comm, "open") else getattr(comm, "_shm", None)
assert getattr(comm, "plane", "gloo") == PLANE, (getattr(comm, "plane", None), PLANE)
print(f"LOCAL {rank} {dist.get_local_rank()} {socket.gethostname()}", flush=True)
if shm_plane is not None:
    print(f"CORE {rank} {'native' if shm_plane.native else 'python'}", flush=True)
if MODE == "kill":
    kill()
elif MODE == "idle":
    idle()
elif MODE == "switch":
    check_switch_points(sys.argv[3:] == ["light"])
    ops = shm_plane._seg.single_copy_ops if shm_plane.native else 0
    print(f"SINGLECOPY {rank} {shm_plane.single_copy_min} {ops}", flush=True)
    print(f"DIGEST {rank} {digest.hexdigest()}", flush=True)
    dist.destroy_process_group()
    print(f"PASSED {rank} {checks}", flush=True)
else:
    GLOO = tdist.new_group(backend="gloo")  # the reference: torch's gloo group of the same ranks
    check_all_reduce()
    check_bitwise()
    check_refused_reductions()
    check_reduce_scatter_uneven()
    check_random_bits()
    check_gather_broadcast()
    check_edges()
    if PLANE == "shm":
        check_every_half_pattern()  # the plane's own rounding: float32 in rank order
        check_reduce_scatter()
    check_reduce_scatter_tensor()
    check_async_out_of_order()
    check_all_to_all()
    used = getattr(comm, "planes_used", None)
    if used is None:  # a flat communicator: everything moves through it (reduce_scatter if its own)
        used = {(c, comm.plane) for c in ("all_reduce", "broadcast", "all_gather", "all_to_all_single", "barrier")}
        used.add(("reduce_scatter", comm.plane if comm.native_reduce_scatter else "derived"))
    planes = sorted(f"{c}:{p}" for c, p in used)
    print(f"PLANES {rank} {','.join(planes)}", flush=True)
    print(f"DIGEST {rank} {digest.hexdigest()}", flush=True)
    dist.destroy_process_group()
    print(f"PASSED {rank} {checks}", flush=True)
