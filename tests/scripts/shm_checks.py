"""The MPI backend's CPU planes, checked on every rank; run by tests/test_shm.py under mpirun.

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

import smddp.torch.distributed as dist  # noqa: E402
from smddp.comm.algorithms import derived  # noqa: E402
from smddp.comm.backends.shm_torch import ONE_SHOT_MAX  # noqa: E402
from smddp.comm.base import Op  # noqa: E402
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

assert getattr(comm, "plane", "gloo") == PLANE, (getattr(comm, "plane", None), PLANE)
print(f"LOCAL {rank} {dist.get_local_rank()} {socket.gethostname()}", flush=True)
shm_plane = getattr(comm, "_shm", None)
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
    check_all_reduce()
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
