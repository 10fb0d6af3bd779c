"""The ``nccl`` communicator on a host-memory stand-in for CuPy's NCCL (tests/nccl_standin.py).

Ranks are threads with their own engine and a shared TCPStore, as processes would have.
Every collective's inputs are seeded per rank; each rank's result is checked against values
computed here from all ranks' inputs. Deadlines: a rank that never arrives makes the others
raise CollectiveTimeout naming it, their NCCL communicators aborted, nothing hanging.
"""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as tdist
from nccl_standin import HostStream, install

from smddp import _excepthook
from smddp._topology import Topology
from smddp.comm.algorithms import derived
from smddp.comm.backends.nccl import NCCL_2_10, NCCLCommunicator
from smddp.comm.base import Context, Op
from smddp.comm.engine import Engine
from smddp.comm.subgroups import group_topology, subgroup_communicators
from smddp.errors import CollectiveError, CollectiveTimeout, InvalidTypeError

JOIN = 60.0  # seconds a rank's thread may take at most: a hang fails the test instead


def run_ranks(fake, size: int, body, timeout: float = 20.0, with_store: bool = False):
    """``body(rank, engine, comm)`` on ``size`` ranks (threads); returns ``{rank: result}``.

    Each rank has its own NCCLCommunicator and engine with the given ``timeout``, over one
    TCPStore (passed as a fourth argument with ``with_store``); engines and communicators
    are closed afterwards whatever happened.
    """
    master = tdist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                            timeout=timedelta(seconds=30))
    results, errors = {}, []
    # Every rank starts its body once all are set up: a short deadline then measures the
    # operations, not how long a starved machine takes to start threads.
    ready = threading.Barrier(size, timeout=JOIN)

    def rank(r: int) -> None:
        engine = nccl_comm = None
        try:
            store = tdist.TCPStore("127.0.0.1", master.port, is_master=False, timeout=timedelta(seconds=30))
            topology = Topology(rank=r, size=size, local_rank=r, local_size=size,
                                launcher="torchrun" if size > 1 else "none")
            nccl_comm = NCCLCommunicator(Context(topology, timedelta(seconds=timeout), store))
            # the stand-in's tensors live on the CPU: route them to the NCCL communicator
            engine = Engine({"cpu": nccl_comm}, timeout=timeout, store=store)
            ready.wait()
            results[r] = body(r, engine, nccl_comm, *((store,) if with_store else ()))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
            ready.abort()
        finally:
            if engine is not None:
                engine.close()
                _excepthook.forget(engine)  # a broken engine would end pytest's process at exit
            if nccl_comm is not None:
                nccl_comm.close()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    if errors:
        raise errors[0]
    assert sorted(results) == list(range(size))
    for stream in fake.streams.values():
        # the only failure a "kernel" may have: NCCL's call ended by an abort (its own or a peer's)
        assert all("was aborted" in str(e) for e in stream.errors), stream.errors
        stream.close()
    return results


def seeded(rank: int, shape, dtype, what: int = 0) -> torch.Tensor:
    """Rank ``rank``'s input ``what``: the same on every call, different per rank."""
    g = torch.Generator().manual_seed(1000 * what + rank)
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 4).to(dtype)
    return torch.randint(-50, 50, shape, generator=g).to(dtype)


def expected_reduce(size: int, shape, dtype, op: Op, what: int, ncclavg: bool = True) -> torch.Tensor:
    """NCCL's result: the reduction of every rank's input, rounded once to ``dtype``.

    ``ncclavg=False``: AVERAGE as before NCCL 2.10, the rounded sum divided by ``size``.
    """
    if op is Op.AVERAGE and not ncclavg and dtype.is_floating_point:
        return expected_reduce(size, shape, dtype, Op.SUM, what) / size
    stack = torch.stack([seeded(r, shape, dtype, what) for r in range(size)])
    wide = stack.double() if dtype.is_floating_point else stack.long()
    if op is Op.SUM:
        out = wide.sum(0)
    elif op is Op.PRODUCT:
        out = wide.prod(0)
    elif op is Op.MIN:
        out = wide.min(0).values
    elif op is Op.MAX:
        out = wide.max(0).values
    elif dtype.is_floating_point:
        out = wide.sum(0) / size
    else:
        out = torch.div(wide.sum(0), size, rounding_mode="trunc")
    return out.to(dtype)


@pytest.fixture
def fake(monkeypatch):
    return install(monkeypatch)


# ---------------------------------------------------------------------------- results
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
        for i, op in enumerate(Op):
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
        got["barrier"] = engine.barrier(async_op=True).wait()
        engine.close()
        got["destroyed"] = nccl_comm._comm is None
        return got

    results = run_ranks(fake, size, body)
    for r in range(size):
        got = results[r]
        for i, op in enumerate(Op):
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
        assert got["barrier"] is True and got["destroyed"]
    assert all(c.destroyed and not c.aborted for c in fake.comms)
    assert (4 in fake.op_codes) == (version >= NCCL_2_10)  # ncclAvg only where NCCL has it


def test_world_of_one_and_device_setup(fake):
    def body(r, engine, nccl_comm):
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
    assert fake.runtime.devices == [nccl_comm.device.index]  # CuPy's device set before the communicator
    assert nccl_comm.nccl_version == 22703 and torch.bfloat16 in nccl_comm.dtypes


# ---------------------------------------------------------------------------- stream order
def _gate(stream: HostStream) -> threading.Event:
    """Hold ``stream``'s queue until the returned event is set."""
    gate = threading.Event()
    stream.enqueue(lambda: gate.wait(JOIN))
    return gate


def test_a_wait_from_another_stream_orders_that_stream_after_the_collective(monkeypatch):
    fake = install(monkeypatch, deferred=True)

    def body(r, engine, nccl_comm):
        mine = torch.cuda.current_stream()
        gate = _gate(mine)  # the collective cannot run until the gate opens
        t = seeded(r, (6,), torch.float32)
        handle = engine.all_reduce(t, Op.SUM, async_op=True)
        other = torch.cuda.Stream()
        fake.current.stream = other
        handle.wait()  # returns at once: `other` now waits for the collective
        seen = []
        other.enqueue(lambda: seen.append(t.clone()))  # a kernel on `other` after the wait
        gate.set()
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


def test_side_stream_mode_orders_both_ways(monkeypatch):
    monkeypatch.setenv("SMDDP_NCCL_STREAM", "side")
    fake = install(monkeypatch, deferred=True)

    def body(r, engine, nccl_comm):
        current = torch.cuda.current_stream()
        t = torch.zeros(4)
        gate = _gate(current)
        value = seeded(r, (4,), torch.float32)
        current.enqueue(lambda: t.copy_(value))  # a kernel the collective must see
        handle = engine.all_reduce(t, Op.SUM, async_op=True)
        gate.set()
        handle.wait()
        seen = []
        current.enqueue(lambda: seen.append(t.clone()))  # a kernel that must see the result
        current.synchronize()
        return nccl_comm.stream_mode, handle._pending._stream is nccl_comm._side, seen[0]

    results = run_ranks(fake, 2, body)
    want = expected_reduce(2, (4,), torch.float32, Op.SUM, 0)
    for r in range(2):
        mode, on_side, seen = results[r]
        assert mode == "side" and on_side and torch.equal(seen, want)


# ---------------------------------------------------------------------------- deadlines and errors
@pytest.mark.parametrize("size", [2, 3])
def test_a_rank_that_never_arrives_times_out_the_others_and_aborts_them(fake, size):
    """The last rank skips the second all_reduce: the others block inside NCCL's call."""
    missing = size - 1
    others_done = threading.Barrier(size, timeout=JOIN)

    def body(r, engine, nccl_comm):
        t = seeded(r, (3,), torch.float32)
        engine.all_reduce(t, Op.SUM)
        out = {"first": t}
        if r == missing:
            others_done.wait()  # answers the others' questions meanwhile (the stall channel)
            return out
        with pytest.raises(CollectiveTimeout) as err:
            engine.all_reduce(seeded(r, (3,), torch.float32, 1), Op.SUM)
        out["error"] = str(err.value)
        with pytest.raises(CollectiveTimeout):  # and so does every later call
            engine.broadcast(torch.zeros(2), 0)
        out["aborted"] = nccl_comm._comm is None
        others_done.wait()
        return out

    results = run_ranks(fake, size, body, timeout=2.0)
    want = expected_reduce(size, (3,), torch.float32, Op.SUM, 0)
    for r in range(size):
        assert torch.equal(results[r]["first"], want)
    for r in range(missing):
        assert f"Ranks that never arrived: {missing}." in results[r]["error"]
        assert "all_reduce (sequence number 2)" in results[r]["error"]
        assert results[r]["aborted"]
    assert all(c.aborted and not c.destroyed for c in fake.comms[:missing])


def test_a_stalled_gpu_is_noticed_without_the_host_waiting(monkeypatch):
    """The collective is enqueued and the host goes on; the watchdog sees its event never complete."""
    fake = install(monkeypatch, deferred=True)
    others_done = threading.Barrier(2, timeout=JOIN)

    def body(r, engine, nccl_comm):
        if r == 1:
            others_done.wait()
            return None
        handle = engine.all_reduce(torch.ones(3), Op.SUM, async_op=True)
        handle.wait()  # stream-ordered: returns although rank 1 never calls
        with pytest.raises(CollectiveTimeout, match="Ranks that never arrived: 1.") as err:
            handle._pending.synchronize()  # blocks the host, until the deadline at most
        with pytest.raises(CollectiveTimeout):
            handle.wait()  # the next wait raises it too
        assert not nccl_comm._watch.drain()  # returns once the watchdog has acted
        others_done.wait()
        return str(err.value), nccl_comm._comm is None

    message, aborted = run_ranks(fake, 2, body, timeout=2.0)[0]
    assert "did not complete within 2 s" in message and aborted
    assert fake.comms[0].aborted
    assert [str(e) for e in fake.streams[min(fake.streams)].errors] == ["NCCL communicator of rank 0 was aborted"]


def test_an_async_nccl_error_fails_the_next_call_and_aborts(fake):
    def body(r, engine, nccl_comm):
        raw = nccl_comm._comm
        raw.error = "remote process exited"
        with pytest.raises(CollectiveError, match="remote process exited"):
            engine.all_reduce(torch.ones(2), Op.SUM)
        return raw

    raw = run_ranks(fake, 1, body)[0]
    assert raw.aborted and not raw.destroyed


def test_a_normal_operation_does_not_expire(fake):
    """Operations that complete leave the watchdog with nothing to expire, past their deadline too."""
    def body(r, engine, nccl_comm):
        t = seeded(r, (4,), torch.float64)
        engine.all_reduce(t, Op.MAX)
        assert nccl_comm._watch.drain()  # every watched operation completed
        later = threading.Event()
        later.wait(2.5)  # past the 2 s deadline of the all_reduce
        engine.barrier()
        return t, nccl_comm._watch.expired

    results = run_ranks(fake, 2, body, timeout=2.0)
    for r in range(2):
        assert torch.equal(results[r][0], expected_reduce(2, (4,), torch.float64, Op.MAX, 0))
        assert results[r][1] is False
    assert all(c.destroyed and not c.aborted for c in fake.comms)



def test_a_barrier_blocks_the_host_until_its_deadline(monkeypatch):
    """barrier() waits on the host (as torch's NCCL barrier does): a missing rank times it out there."""
    fake = install(monkeypatch, deferred=True)
    others_done = threading.Barrier(2, timeout=JOIN)

    def body(r, engine, nccl_comm):
        if r == 1:
            others_done.wait()
            return None
        with pytest.raises(CollectiveTimeout, match="Ranks that never arrived: 1.") as err:
            engine.barrier()
        assert not nccl_comm._watch.drain()  # the watchdog expired it too, and aborted NCCL
        others_done.wait()
        return str(err.value), nccl_comm._comm is None

    message, aborted = run_ranks(fake, 2, body, timeout=2.0)[0]
    assert "barrier (sequence number 1)" in message and aborted


def test_a_subgroup_times_out_naming_global_ranks(fake):
    """Global ranks 0 and 2 form a group; rank 2 skips its second all_reduce."""
    group = [0, 2]
    done = threading.Barrier(3, timeout=JOIN)

    def body(r, engine, nccl_comm, store):
        if r not in group:
            done.wait()
            return None
        world = Topology(rank=r, size=3, local_rank=r, local_size=3, launcher="torchrun")
        ctx = Context(group_topology(world, group), timedelta(seconds=2), tdist.PrefixStore("pair", store))
        comms = subgroup_communicators({"cpu": nccl_comm}, group, ctx)
        sub = Engine(comms, timeout=2.0, store=ctx.store)
        sub.describe_group("pair", group)
        try:
            t = seeded(r, (5,), torch.float32)
            sub.all_reduce(t, Op.SUM)
            if r == 2:
                done.wait()
                return t, None
            with pytest.raises(CollectiveTimeout) as err:
                sub.all_reduce(torch.ones(5), Op.SUM)
            done.wait()
            return t, str(err.value)
        finally:
            sub.close()
            _excepthook.forget(sub)
            comms["cpu"].close()

    results = run_ranks(fake, 3, body, timeout=20.0, with_store=True)
    want = torch.stack([seeded(r, (5,), torch.float32) for r in group]).double().sum(0).float()
    assert torch.equal(results[0][0], want) and torch.equal(results[2][0], want)
    message = results[0][1]
    assert "Ranks that never arrived: 2." in message, message
    assert "process group 'pair', global ranks 0, 2" in message, message
