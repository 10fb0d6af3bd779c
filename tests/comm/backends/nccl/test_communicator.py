"""The ``nccl`` communicator on a host-memory stand-in for CuPy's NCCL (tests/helpers/nccl_standin.py).

Ranks are threads with their own engine and a shared TCPStore, as processes would have
(tests/helpers/nccl_ranks.py). Every collective's inputs are seeded per rank; each rank's result is
checked against values computed here from all ranks' inputs. What torch's NCCL group does is
the contract: bool, complex and float8 tensors as it sends them, the device it picks, the
communicator made at first use, the group's own stream, every tensor held until its stream is
done. Deadlines and failures: tests/comm/backends/nccl/test_failures.py.
"""

from __future__ import annotations

import threading
import types
from datetime import timedelta

import pytest
import torch
import torch.distributed as tdist
from nccl_ranks import JOIN, expected_reduce, gate, run_ranks, seeded
from nccl_standin import install

from smddp.comm.algorithms import derived
from smddp.comm.backends.nccl.communicator import NCCL_2_10
from smddp.comm.backends.nccl.watchdog import HELD
from smddp.comm.base import Context
from smddp.comm.engine import Engine
from smddp.comm.engine.handle import _cpp_future
from smddp.comm.reduction import ARITHMETIC, Op
from smddp.comm.subgroups import group_topology, subgroup_communicators
from smddp.errors import InvalidArgumentError, InvalidTypeError
from smddp.job import excepthook
from smddp.job.topology import Topology


@pytest.fixture
def fake(monkeypatch):
    return install(monkeypatch)


# ---------------------------------------------------------------------------- results
@pytest.mark.unit
@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("version", [22703, 2804])  # with ncclAvg, and before it (sum, then divide)
def test_collectives_on_every_rank(fake, size, version):
    fake.version = version
    floats = (torch.float32, torch.bfloat16) if version >= NCCL_2_10 else (torch.float32,)
    reduce_dtypes = (*floats, torch.int64)

    def body(r, engine, nccl_comm):
        got = {}
        if version < NCCL_2_10:  # ncclBfloat16 came with NCCL 2.10: refused before any call
            with pytest.raises(InvalidTypeError, match="bfloat16"):
                engine.all_reduce(torch.ones(2, dtype=torch.bfloat16), Op.SUM)
        for i, op in enumerate(ARITHMETIC):
            for j, dtype in enumerate(reduce_dtypes):
                t = seeded(r, (3, 5), dtype, 10 * i + j)
                engine.all_reduce(t, op)
                got[("all_reduce", op, dtype)] = t
        strided = seeded(r, (4, 6), torch.float64, 90).t()  # non-contiguous: copied back
        engine.all_reduce(strided, Op.SUM)
        got["strided"] = strided
        b = seeded(r, (7,), torch.float16, 91)
        engine.broadcast(b, size - 1)
        got["broadcast"] = b
        slots = [torch.zeros(2, 3, dtype=torch.int32) for _ in range(size)]
        engine.all_gather(slots, seeded(r, (2, 3), torch.int32, 92))
        got["all_gather"] = slots
        flat = torch.zeros(size * 4, dtype=torch.uint8)
        engine.all_gather_into_tensor(flat, seeded(r, (4,), torch.uint8, 93))
        got["all_gather_into_tensor"] = flat
        # uneven splits, 8-byte elements: offsets are counted in elements, moved in bytes
        sends = [(r + peer) % 3 + 1 for peer in range(size)]
        src = seeded(r, (sum(sends),), torch.int64, 94)
        dst = torch.full((sum((peer + r) % 3 + 1 for peer in range(size)),), -1, dtype=torch.int64)
        engine.all_to_all_single(dst, src, [(peer + r) % 3 + 1 for peer in range(size)], sends)
        got["all_to_all"] = dst
        for k, op in enumerate((Op.SUM, Op.AVERAGE)):
            out = torch.zeros(3)
            derived.reduce_scatter_tensor(engine, out, seeded(r, (size * 3,), torch.float32, 95 + k), op).wait()
            got[("reduce_scatter", op)] = out
            # chunks of different sizes, as torch's NCCL group takes them (ncclReduceScatter cannot)
            uneven = torch.zeros(2 + r)
            derived.reduce_scatter(engine, uneven, [seeded(r, (2 + j,), torch.float32, 97 + 2 * j + k)
                                                    for j in range(size)], op).wait()
            got[("reduce_scatter uneven", op)] = uneven
        got["barrier"] = engine.barrier(async_op=True).wait()
        lane = nccl_comm._lane
        engine.close()
        nccl_comm.close()
        got["destroyed"] = lane.comm is None
        return got

    results = run_ranks(fake, size, body)
    for r in range(size):
        got = results[r]
        for i, op in enumerate(ARITHMETIC):
            for j, dtype in enumerate(reduce_dtypes):
                want = expected_reduce(size, (3, 5), dtype, op, 10 * i + j, version >= NCCL_2_10)
                assert torch.equal(got[("all_reduce", op, dtype)], want), (r, op, dtype)
        assert torch.equal(got["strided"], expected_reduce(size, (4, 6), torch.float64, Op.SUM, 90).t())
        assert torch.equal(got["broadcast"], seeded(size - 1, (7,), torch.float16, 91))
        for peer in range(size):
            assert torch.equal(got["all_gather"][peer], seeded(peer, (2, 3), torch.int32, 92))
        assert torch.equal(got["all_gather_into_tensor"],
                           torch.cat([seeded(peer, (4,), torch.uint8, 93) for peer in range(size)]))
        pieces = []
        for peer in range(size):  # what peer sent to r: its slice r
            peer_sends = [(peer + q) % 3 + 1 for q in range(size)]
            start = sum(peer_sends[:r])
            pieces.append(seeded(peer, (sum(peer_sends),), torch.int64, 94)[start:start + peer_sends[r]])
        assert torch.equal(got["all_to_all"], torch.cat(pieces))
        for k, op in enumerate((Op.SUM, Op.AVERAGE)):
            want = expected_reduce(size, (size * 3,), torch.float32, op, 95 + k, version >= NCCL_2_10)
            want = want[r * 3:(r + 1) * 3]
            assert torch.equal(got[("reduce_scatter", op)], want), (r, op)
            want = expected_reduce(size, (2 + r,), torch.float32, op, 97 + 2 * r + k, version >= NCCL_2_10)
            assert torch.equal(got[("reduce_scatter uneven", op)], want), (r, op)
        assert got["barrier"] is True and got["destroyed"]
    assert all(c.destroyed and not c.aborted for c in fake.comms)
    assert (4 in fake.op_codes) == (version >= NCCL_2_10)  # ncclAvg only where NCCL has it


@pytest.mark.unit
def test_world_of_one_and_device_setup(fake):
    def body(r, engine, nccl_comm):
        assert fake.comms == [] and fake.runtime.devices == []  # nothing made at init, as torch's group
        t = seeded(0, (5,), torch.float32)
        engine.all_reduce(t, Op.AVERAGE)
        out = torch.zeros(4)
        engine.all_gather_into_tensor(out, seeded(0, (4,), torch.float32, 1))
        a2a = torch.zeros(3, dtype=torch.int64)
        engine.all_to_all_single(a2a, seeded(0, (3,), torch.int64, 2))
        return t, out, a2a, nccl_comm

    t, out, a2a, nccl_comm = run_ranks(fake, 1, body)[0]
    assert torch.equal(t, seeded(0, (5,), torch.float32))
    assert torch.equal(out, seeded(0, (4,), torch.float32, 1)) and torch.equal(a2a, seeded(0, (3,), torch.int64, 2))
    assert fake.runtime.devices == [nccl_comm._lane.index]  # CuPy's device set before the communicator
    assert nccl_comm.nccl_version == 22703 and torch.bfloat16 in nccl_comm.dtypes


# ---------------------------------------------------------------------------- stream order
def test_a_wait_from_another_stream_orders_that_stream_after_the_collective(monkeypatch):
    fake = install(monkeypatch, deferred=True)

    def body(r, engine, nccl_comm):
        mine = torch.cuda.current_stream()
        opened = gate(mine)  # the collective cannot run until the gate opens
        t = seeded(r, (6,), torch.float32)
        handle = engine.all_reduce(t, Op.SUM, async_op=True)
        other = torch.cuda.Stream()
        fake.current.stream = other
        handle.wait()  # returns at once: `other` now waits for the collective
        seen = []
        other.enqueue(lambda: seen.append(t.clone()))  # a kernel on `other` after the wait
        opened.set()
        other.synchronize()
        again = []
        fake.current.stream = third = torch.cuda.Stream()
        handle.wait()  # every wait orders the waiting stream, not only the first
        third.enqueue(lambda: again.append(t.clone()))
        third.synchronize()
        fake.current.stream = mine
        return seen[0], again[0]

    results = run_ranks(fake, 2, body)
    want = expected_reduce(2, (6,), torch.float32, Op.SUM, 0)
    for r in range(2):
        assert torch.equal(results[r][0], want) and torch.equal(results[r][1], want)


@pytest.mark.unit
def test_the_groups_own_stream_is_the_default_and_orders_both_ways(monkeypatch):
    fake = install(monkeypatch, deferred=True)

    def body(r, engine, nccl_comm):
        current = torch.cuda.current_stream()
        t = torch.zeros(4)
        opened = gate(current)
        value = seeded(r, (4,), torch.float32)
        current.enqueue(lambda: t.copy_(value))  # a kernel the collective must see
        handle = engine.all_reduce(t, Op.SUM, async_op=True)
        opened.set()
        handle.wait()
        seen = []
        current.enqueue(lambda: seen.append(t.clone()))  # a kernel that must see the result
        current.synchronize()
        return nccl_comm.stream_mode, handle._pending._stream is nccl_comm._lane.side, seen[0]

    results = run_ranks(fake, 2, body)
    want = expected_reduce(2, (4,), torch.float32, Op.SUM, 0)
    for r in range(2):
        mode, on_side, seen = results[r]
        assert mode == "side" and on_side and torch.equal(seen, want)


@pytest.mark.unit
def test_an_enqueued_collective_is_done_at_once_and_its_cpp_half_settles_after_its_stream(monkeypatch):
    """An asynchronous collective is done as it is enqueued (torch's NCCL Work:
    ``is_completed()`` and ``wait()`` speak of the enqueue); the C++ half's future, which
    carries no CUDA event, completes only once the stream has run the collective."""
    fake = install(monkeypatch, deferred=True)

    def body(r, engine, nccl_comm):
        current = torch.cuda.current_stream()
        opened = gate(current)  # the collective cannot run until the gate opens
        t = seeded(r, (5,), torch.float32)
        handle = engine.all_reduce(t, Op.SUM, async_op=True)
        cpp = _cpp_future(handle)
        before = (handle.is_completed(), cpp.done())
        handle.wait()
        still = cpp.done()
        opened.set()
        value = cpp.wait()  # the progress thread completes it once the stream has run
        current.synchronize()
        return before, still, value[0] is t, t

    results = run_ranks(fake, 2, body)
    want = expected_reduce(2, (5,), torch.float32, Op.SUM, 0)
    for r in range(2):
        before, still, same, t = results[r]
        assert before == (True, False) and still is False and same and torch.equal(t, want)


# ---------------------------------------------------------------------------- dtypes torch's NCCL group sends
@pytest.mark.unit
def test_bool_complex_and_float8_travel_as_torchs_nccl_group_sends_them(fake):
    """bool as uint8 (SUM an or), complex as its real view, float8 as bytes; refusals raise before
    anything is sent and leave the ranks in step; int16 and the bitwise reductions (of any dtype)
    are refused, as by torch's NCCL group, each by its name."""
    both = threading.Barrier(2, timeout=JOIN)  # the stand-in's record of calls is shared by the ranks

    def body(r, engine, nccl_comm):
        got = {}
        for i, op in enumerate((Op.SUM, Op.MIN, Op.MAX, Op.PRODUCT)):
            t = seeded(r, (9,), torch.bool, 10 + i)
            engine.all_reduce(t, op)
            got[("bool", op)] = t
        buffer = seeded(r, (7,), torch.bool, 20)  # what DDP broadcasts at construction: every buffer
        engine.broadcast(buffer, 0)
        got["bool broadcast"] = buffer
        for j, dtype in enumerate((torch.complex64, torch.complex128)):
            for k, op in enumerate((Op.SUM, Op.AVERAGE)):
                t = seeded(r, (2, 3), dtype, 30 + 2 * j + k)
                engine.all_reduce(t, op)
                got[(dtype, op)] = t
        slots = [torch.zeros(4, dtype=torch.complex64) for _ in range(2)]
        engine.all_gather(slots, seeded(r, (4,), torch.complex64, 40))
        got["complex all_gather"] = slots
        src = seeded(r, (4,), torch.complex128, 41)
        dst = torch.zeros(4, dtype=torch.complex128)
        engine.all_to_all_single(dst, src)
        got["complex all_to_all"] = dst
        f8 = seeded(r, (6,), torch.float32, 42).to(torch.float8_e4m3fn)
        flat = torch.zeros(12, dtype=torch.float8_e4m3fn)
        engine.all_gather_into_tensor(flat, f8)
        got["float8 all_gather"] = flat
        both.wait()
        codes = len(fake.op_codes)
        with pytest.raises(InvalidTypeError, match="AVERAGE of bool"):
            engine.all_reduce(torch.ones(3, dtype=torch.bool), Op.AVERAGE)
        with pytest.raises(InvalidArgumentError, match="MAX on complex"):
            engine.all_reduce(torch.ones(3, dtype=torch.complex64), Op.MAX)
        with pytest.raises(InvalidTypeError, match="moved, not reduced"):
            engine.all_reduce(torch.ones(3, dtype=torch.float8_e5m2), Op.SUM)
        with pytest.raises(InvalidTypeError, match="int16 is not supported by the nccl backend"):
            engine.all_reduce(torch.ones(3, dtype=torch.int16), Op.SUM)
        bitwise = ((Op.BAND, torch.int32), (Op.BOR, torch.bool), (Op.BXOR, torch.int64), (Op.BAND, torch.float32))
        for op, dtype in bitwise:
            refusal = f"{op.name} is refused on NCCL, as by torch's NCCL group"
            with pytest.raises(InvalidArgumentError, match=refusal):
                engine.all_reduce(torch.ones(3, dtype=dtype), op)
            with pytest.raises(InvalidArgumentError, match=refusal):
                derived.reduce_scatter_tensor(engine, torch.ones(3, dtype=dtype), torch.ones(6, dtype=dtype), op)
            with pytest.raises(InvalidArgumentError, match=refusal):  # uneven chunks: an all_reduce, refused
                derived.reduce_scatter(engine, torch.ones(1 + r, dtype=dtype), [torch.ones(1, dtype=dtype),
                                                                                torch.ones(2, dtype=dtype)], op)
        got["sent after refusals"] = len(fake.op_codes) - codes
        both.wait()
        after = seeded(r, (3,), torch.float32, 43)
        engine.all_reduce(after, Op.SUM)  # the ranks are still in step
        got["after"] = after
        return got

    results = run_ranks(fake, 2, body)
    for r in range(2):
        got = results[r]
        for i, op in enumerate((Op.SUM, Op.MIN, Op.MAX, Op.PRODUCT)):
            assert torch.equal(got[("bool", op)], expected_reduce(2, (9,), torch.bool, op, 10 + i)), op
        assert torch.equal(got["bool broadcast"], seeded(0, (7,), torch.bool, 20))
        for j, dtype in enumerate((torch.complex64, torch.complex128)):
            for k, op in enumerate((Op.SUM, Op.AVERAGE)):
                assert torch.equal(got[(dtype, op)], expected_reduce(2, (2, 3), dtype, op, 30 + 2 * j + k))
        for peer in range(2):
            assert torch.equal(got["complex all_gather"][peer], seeded(peer, (4,), torch.complex64, 40))
        want = torch.cat([seeded(peer, (4,), torch.complex128, 41)[2 * r:2 * r + 2] for peer in range(2)])
        assert torch.equal(got["complex all_to_all"], want)
        f8 = torch.cat([seeded(peer, (6,), torch.float32, 42).to(torch.float8_e4m3fn) for peer in range(2)])
        assert torch.equal(got["float8 all_gather"].view(torch.uint8), f8.view(torch.uint8))
        assert got["sent after refusals"] == 0
        assert torch.equal(got["after"], expected_reduce(2, (3,), torch.float32, Op.SUM, 43))
    assert fake.op_codes[:2] == [2, 2] and fake.op_codes[2:4] == [3, 3]  # bool SUM went as MAX, MIN as MIN


# ---------------------------------------------------------------------------- memory NCCL still uses
def _storages(held) -> set:
    """The storages of the tensors in ``held``: tensors, sequences of them, and what closures keep."""
    found, todo = set(), [held]
    while todo:
        item = todo.pop()
        if isinstance(item, torch.Tensor):
            found.add(item.untyped_storage().data_ptr())
        elif isinstance(item, (list, tuple)):
            todo.extend(item)
        elif callable(item) and getattr(item, "__closure__", None):
            todo.extend(cell.cell_contents for cell in item.__closure__)
    return found


@pytest.mark.unit
def test_every_tensor_the_stream_touches_is_held_until_it_is_done(monkeypatch):
    """An all_gather's output list and a strided tensor are written by steps queued after the
    collective on its stream: the watchdog holds them (as torch's NCCL group stashes tensors)
    until the stream has run those steps, then lets go."""
    fake = install(monkeypatch, deferred=True)

    def body(r, engine, nccl_comm):
        opened = gate(torch.cuda.current_stream())  # the group's stream waits for this one
        slots = [torch.zeros(3) for _ in range(2)]
        strided = seeded(r, (4, 2), torch.float32, 1).t()
        mine = {t.untyped_storage().data_ptr() for t in (*slots, strided)}
        engine.all_gather(slots, seeded(r, (3,), torch.float32, 0), async_op=True).wait()
        engine.all_reduce(strided, Op.SUM, async_op=True).wait()
        records = list(nccl_comm.watch._inflight)
        held = set().union(*(_storages(w[HELD]) for w in records))  # a record is a list (watchdog.HELD)
        opened.set()
        drained = nccl_comm.watch.drain()
        return mine - held, drained, [w[HELD] for w in records]

    for missing, drained, after in run_ranks(fake, 2, body).values():
        assert not missing, "a tensor the stream writes was not held"
        assert drained and all(held == () for held in after)


# ---------------------------------------------------------------------------- device and first use
def test_the_communicator_is_made_at_first_use_on_the_chosen_device_by_threads_that_set_it(fake):
    """device_id wins (cuda:3 and cuda:4 here); nothing exists before the first collective; the
    creating thread, the watchdog and the engine's progress thread set that device before any
    CUDA call, and the caller's current device is left as the caller had it."""

    def body(r, engine, nccl_comm):
        made_before = list(fake.comms)
        t = seeded(r, (5,), torch.float32)
        handle = engine.all_reduce(t, Op.SUM, async_op=True)
        engine.barrier(async_op=True).wait()  # host-polled: the progress thread may test it too
        handle.wait()
        assert nccl_comm.watch.drain()
        return made_before, nccl_comm._lane.index, getattr(fake.thread, "device", None), t

    results = run_ranks(fake, 2, body, device=lambda r: torch.device("cuda", 3 + r))
    for r in range(2):
        made_before, index, caller_device, t = results[r]
        assert made_before == [] and index == 3 + r and caller_device is None
        assert torch.equal(t, expected_reduce(2, (5,), torch.float32, Op.SUM, 0))
    threads = {name for name, _ in fake.set_devices}
    assert any(name.startswith("smddp-nccl-init") for name in threads), fake.set_devices
    assert any(name.startswith("smddp-nccl-watchdog") for name in threads), fake.set_devices
    assert not any(name.startswith("rank-") for name in threads), fake.set_devices
    assert sorted(c.device for c in fake.comms) == [3, 4]  # each made with its rank's device current
    smddp_queries = [(name, device) for name, device in fake.queries if name.startswith("smddp-")]
    assert smddp_queries and all(device in (3, 4) for _, device in smddp_queries), smddp_queries


@pytest.mark.unit
def test_without_device_id_the_current_device_as_set_else_the_local_rank(fake):
    def body(r, engine, nccl_comm):
        if r == 1:
            torch.cuda.set_device(6)  # this rank chose its device; rank 0 did not
        engine.barrier()
        return nccl_comm._lane.index

    assert run_ranks(fake, 2, body) == {0: 0, 1: 6}


@pytest.mark.unit
def test_a_tensor_on_another_device_is_refused_before_anything_is_sent(fake):
    def body(r, engine, nccl_comm):
        with pytest.raises(InvalidArgumentError, match="group runs on cpu .* but a tensor is on meta"):
            nccl_comm.all_reduce(torch.ones(2, device="meta"), Op.SUM, 1)
        return len(fake.comms)

    assert run_ranks(fake, 2, body) == {0: 0, 1: 0}


# ---------------------------------------------------------------------------- store keys
def test_a_world_made_again_after_a_subgroup_meets_under_the_same_key(fake):
    """Ranks 0 and 1 make a subgroup and use it; every rank destroys; the next world's first
    collective must find one unique id, not one per rank's count of communicators."""
    master = tdist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))

    def first(r, engine, nccl_comm, store):
        engine.barrier()
        if r == 2:
            return None
        world = Topology(rank=r, size=3, local_rank=r, local_size=3, launcher="torchrun")
        ctx = Context(group_topology(world, [0, 1]), timedelta(seconds=10), tdist.PrefixStore("pair", store))
        comms = subgroup_communicators({"cpu": nccl_comm}, [0, 1], ctx)
        sub = Engine(comms, timeout=10.0, store=ctx.store)
        try:
            t = seeded(r, (4,), torch.float32)
            sub.all_reduce(t, Op.SUM)
            return t
        finally:
            sub.close()
            excepthook.forget(sub)
            comms["cpu"].close()

    def second(r, engine, nccl_comm):
        t = seeded(r, (4,), torch.float32, 1)
        engine.all_reduce(t, Op.SUM)
        return t

    pair = run_ranks(fake, 3, first, timeout=10.0, with_store=True, master=master, prefix="world-1")
    assert torch.equal(pair[0], expected_reduce(2, (4,), torch.float32, Op.SUM, 0))
    again = run_ranks(fake, 3, second, timeout=10.0, master=master, prefix="world-2")
    for r in range(3):
        assert torch.equal(again[r], expected_reduce(3, (4,), torch.float32, Op.SUM, 1))


@pytest.mark.unit
def test_device_id_is_read_where_torch_creates_the_group():
    """torch passes init_process_group's (and new_group's) device_id to _new_process_group_helper,
    not to a backend's creator: smddp's creator reads it from that frame."""
    import inspect

    import torch.distributed.distributed_c10d as c10d

    from smddp import _compat

    assert "device_id" in inspect.signature(c10d._new_process_group_helper).parameters

    def _new_process_group_helper(device_id, creator):  # torch's name, in torch's module
        return creator()

    helper = types.FunctionType(_new_process_group_helper.__code__, vars(c10d), "_new_process_group_helper")
    assert helper(torch.device("cuda", 3), _compat.requested_device_id) == torch.device("cuda", 3)
    assert helper(None, _compat.requested_device_id) is None
    assert _compat.requested_device_id() is None  # not inside torch's group creation
