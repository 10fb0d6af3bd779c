"""The ``nccl`` communicator's deadlines and failures, on the host-memory stand-in (tests/helpers/nccl_standin.py).

Ranks are threads (tests/helpers/nccl_ranks.py). A rank that never arrives makes the others raise
CollectiveTimeout naming it; what follows is torch's ``TORCH_NCCL_ASYNC_ERROR_HANDLING``
choice (``SMDDP_NCCL_ASYNC_ERROR_HANDLING``): by default the process ends (seen here through a
recorder in place of the exit, and once for real in a child process), with 2 the communicator
is aborted and the next call raises. Every step has a deadline: the unique id, the
communicator's creation, each operation, and the abort itself.
"""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as tdist
from nccl_ranks import JOIN, expected_reduce, run_ranks, seeded
from nccl_standin import install

from smddp.comm.backends.nccl import failures
from smddp.comm.base import Context
from smddp.comm.engine import Engine
from smddp.comm.reduction import Op
from smddp.comm.subgroups import group_topology, subgroup_communicators
from smddp.errors import CollectiveError, CollectiveTimeout, InvalidArgumentError
from smddp.job import excepthook
from smddp.job.topology import Topology

from launchers import ROOT, python


@pytest.fixture
def fake(monkeypatch):
    """The stand-in, with failures handled by aborting and raising at the next call (mode 2)."""
    monkeypatch.setenv("SMDDP_NCCL_ASYNC_ERROR_HANDLING", "2")
    return install(monkeypatch)


def _cleanup_only(monkeypatch, deferred: bool = False):
    monkeypatch.setenv("SMDDP_NCCL_ASYNC_ERROR_HANDLING", "2")
    return install(monkeypatch, deferred=deferred)


# ---------------------------------------------------------------------------- deadlines (mode 2)

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
        out["aborted"] = nccl_comm._lane.comm is None
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
    assert all(c.aborted and not c.destroyed for c in fake.comms if c.rank < missing)


def test_a_stalled_gpu_is_noticed_without_the_host_waiting(monkeypatch):
    """The collective is enqueued and the host goes on; the watchdog sees its event never complete."""
    fake = _cleanup_only(monkeypatch, deferred=True)
    others_done = threading.Barrier(2, timeout=JOIN)

    def body(r, engine, nccl_comm):
        if r == 1:
            engine.barrier()  # the communicator exists: rank 1 then never calls the all_reduce
            others_done.wait()
            return None
        engine.barrier()
        handle = engine.all_reduce(torch.ones(3), Op.SUM, async_op=True)
        handle.wait()  # stream-ordered: returns although rank 1 never calls
        with pytest.raises(CollectiveTimeout, match="Ranks that never arrived: 1.") as err:
            handle.wait(timeout=timedelta(seconds=JOIN))  # with a timeout the host waits: the deadline comes first
        with pytest.raises(CollectiveTimeout):
            handle.wait()  # the next wait raises it too
        assert not nccl_comm.watch.drain()  # returns once the watchdog has acted
        others_done.wait()
        return str(err.value), nccl_comm._lane.comm is None

    message, aborted = run_ranks(fake, 2, body, timeout=2.0)[0]
    assert "did not complete within 2 s" in message and aborted
    assert [c.aborted for c in fake.comms if c.rank == 0] == [True]
    errors = [str(e) for stream in fake.streams.values() for e in stream.errors]
    assert "NCCL communicator of rank 0 was aborted" in errors  # the stalled kernel ended by the abort


@pytest.mark.unit
def test_an_async_nccl_error_fails_the_next_call_and_aborts(fake):
    def body(r, engine, nccl_comm):
        engine.barrier()
        raw = nccl_comm._lane.comm
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
        assert nccl_comm.watch.drain()  # every watched operation completed
        later = threading.Event()
        later.wait(2.5)  # past the 2 s deadline of the all_reduce
        engine.barrier()
        return t, nccl_comm.watch.expired

    results = run_ranks(fake, 2, body, timeout=2.0)
    for r in range(2):
        assert torch.equal(results[r][0], expected_reduce(2, (4,), torch.float64, Op.MAX, 0))
        assert results[r][1] is False
    assert all(c.destroyed and not c.aborted for c in fake.comms)



def test_a_barrier_blocks_the_host_until_its_deadline(monkeypatch):
    """barrier() waits on the host (as torch's NCCL barrier does): a missing rank times it out there."""
    fake = _cleanup_only(monkeypatch, deferred=True)
    others_done = threading.Barrier(2, timeout=JOIN)

    def body(r, engine, nccl_comm):
        engine.all_reduce(torch.ones(1), Op.SUM)  # the communicator exists
        if r == 1:
            others_done.wait()
            return None
        with pytest.raises(CollectiveTimeout, match="Ranks that never arrived: 1.") as err:
            engine.barrier()
        assert not nccl_comm.watch.drain()  # the watchdog expired it too, and aborted NCCL
        others_done.wait()
        return str(err.value), nccl_comm._lane.comm is None

    message, aborted = run_ranks(fake, 2, body, timeout=2.0)[0]
    assert "barrier (sequence number 2)" in message and aborted


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
            excepthook.forget(sub)
            comms["cpu"].close()

    results = run_ranks(fake, 3, body, timeout=20.0, with_store=True)
    want = torch.stack([seeded(r, (5,), torch.float32) for r in group]).double().sum(0).float()
    assert torch.equal(results[0][0], want) and torch.equal(results[2][0], want)
    message = results[0][1]
    assert "Ranks that never arrived: 2." in message, message
    assert "process group 'pair', global ranks 0, 2" in message, message


# ---------------------------------------------------------------------------- torch's error handling
def test_by_default_a_deadline_that_passes_ends_the_process_without_an_abort(monkeypatch):
    """Mode 3, torch's default: the error is reported and the process ends (recorded here in place
    of the exit); the communicator is not aborted (an abort can itself block)."""
    monkeypatch.delenv("SMDDP_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    fake = install(monkeypatch, deferred=True)
    ended = []
    def end_process(error, rank, mode):  # what the process is like when it would end
        mine = [c for c in fake.comms if c.rank == rank]
        ended.append((str(error), rank, mode, any(c.aborted for c in mine)))
        for c in mine:
            c.abort()  # as the process's end would: its peers see it gone

    monkeypatch.setattr(failures, "end_process", end_process)
    others_done = threading.Barrier(2, timeout=JOIN)

    def body(r, engine, nccl_comm):
        engine.barrier()
        if r == 0:
            engine.all_reduce(torch.ones(3), Op.SUM, async_op=True).wait()  # rank 1 never calls it
            assert not nccl_comm.watch.drain()  # the watchdog acted
        others_done.wait()
        return nccl_comm.error_handling

    assert run_ranks(fake, 2, body, timeout=2.0) == {0: 3, 1: 3}
    ((message, rank, mode, aborted),) = ended
    assert rank == 0 and mode == 3 and "Ranks that never arrived: 1." in message, ended
    assert not aborted


@pytest.mark.unit
def test_the_mode_comes_from_smddps_variable_else_torchs():
    assert failures.error_handling({}) == 3
    assert failures.error_handling({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}) == 1
    assert failures.error_handling({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
                                       "SMDDP_NCCL_ASYNC_ERROR_HANDLING": "2"}) == 2
    with pytest.raises(InvalidArgumentError, match=r"SMDDP_NCCL_ASYNC_ERROR_HANDLING=7 \(environment\) is above 3: "
                                                   r"SMDDP_NCCL_ASYNC_ERROR_HANDLING takes a whole number from 0 to 3"):
        failures.error_handling({"SMDDP_NCCL_ASYNC_ERROR_HANDLING": "7"})
    assert [failures.aborts(m) for m in range(4)] == [False, True, True, False]
    assert [failures.ends_process(m) for m in range(4)] == [False, True, False, True]


TEAR_DOWN_SCRIPT = """
import sys, threading
import pytest, torch
sys.path.insert(0, {tests!r})
from nccl_ranks import run_ranks
from nccl_standin import install
from smddp.comm.reduction import Op

patch = pytest.MonkeyPatch()
fake = install(patch, deferred=True)

def body(r, engine, comm):
    engine.barrier()
    if r == 0:
        engine.all_reduce(torch.ones(2), Op.SUM, async_op=True).wait()
        threading.Event().wait(30)  # the watchdog ends the process within the 2 s deadline
    else:
        threading.Event().wait(30)
    return r

run_ranks(fake, 2, body, timeout=2.0)
print("STILL RUNNING", flush=True)
"""


def test_the_default_really_ends_the_process(tmp_path):
    """A child process whose rank 0 passes a deadline exits non-zero, saying why and how to keep it."""
    script = tmp_path / "tear_down.py"
    script.write_text(TEAR_DOWN_SCRIPT.format(tests=str(ROOT / "tests" / "helpers")))
    result = python([str(script)], timeout=120, env={"SMDDP_NCCL_ASYNC_ERROR_HANDLING": ""})
    assert result.returncode == 1, result.output
    assert "STILL RUNNING" not in result.stdout
    assert "smddp: rank 0: CollectiveTimeout: all_reduce (sequence number 2)" in result.stderr, result.output
    assert "SMDDP_NCCL_ASYNC_ERROR_HANDLING=3" in result.stderr and "=2 to abort" in result.stderr, result.output


# ---------------------------------------------------------------------------- every step has a deadline
def test_a_peer_that_never_creates_its_communicator_times_out_the_creation(fake):
    """Rank 1 never reaches its first collective (it died after the unique id was shared): rank 0's
    ncclCommInitRank would wait forever; its first all_reduce raises at the deadline instead."""
    fake.init_wait = 30.0  # the stand-in's own limit, well past the 2 s deadline
    others_done = threading.Barrier(2, timeout=JOIN)

    def body(r, engine, nccl_comm):
        if r == 1:
            others_done.wait()
            return None
        with pytest.raises(CollectiveTimeout) as err:
            engine.all_reduce(torch.ones(2), Op.SUM)
        with pytest.raises(CollectiveTimeout):
            engine.broadcast(torch.ones(2), 0)  # and every later call
        others_done.wait()
        return str(err.value)

    message = run_ranks(fake, 2, body, timeout=2.0)[0]
    assert "all_reduce (creating the NCCL communicator) (sequence number 1)" in message, message
    assert "Ranks that never arrived: 1." in message, message
    for world in fake.worlds.values():
        with world.cv:
            world.gone = True  # the abandoned creation ends (smddp aborts what it would make)
            world.cv.notify_all()


def test_an_abort_that_blocks_ends_the_process_and_nothing_reaches_the_communicator(monkeypatch):
    """Mode 2 aborts; here ncclCommAbort never returns: after the grace the process is ended
    (recorded), and a call made meanwhile never reaches the communicator being aborted."""
    fake = _cleanup_only(monkeypatch)
    fake.abort_blocks.set()
    monkeypatch.setattr(failures, "ABORT_GRACE", 0.5)
    ended = []
    monkeypatch.setattr(failures, "end_process", lambda error, rank, mode: ended.append((str(error), rank)))
    others_done = threading.Barrier(2, timeout=JOIN)

    def body(r, engine, nccl_comm):
        engine.barrier()
        if r == 1:
            others_done.wait()
            return None
        with pytest.raises(CollectiveTimeout):
            engine.all_reduce(torch.ones(2), Op.SUM)  # blocks in NCCL's call until the abort
        with pytest.raises(CollectiveTimeout):
            engine.all_reduce(torch.ones(2), Op.SUM)
        raw = [c for c in fake.comms if c.rank == 0][0]
        fake.release_abort.set()
        others_done.wait()
        return raw.calls_after_abort

    calls_after_abort = run_ranks(fake, 2, body, timeout=2.0)[0]
    assert calls_after_abort == []
    assert [rank for _, rank in ended] == [0] and "ncclCommAbort did not return within 0.5 s" in ended[0][0]


@pytest.mark.unit
def test_an_error_creating_the_communicator_says_what_to_check(fake):
    def refuse(ndev, uid, rank):
        raise RuntimeError("NCCL_ERROR_INVALID_USAGE: Duplicate GPU detected")

    fake.NcclCommunicator = refuse

    def body(r, engine, nccl_comm):
        with pytest.raises(CollectiveError) as err:
            engine.all_reduce(torch.ones(2), Op.SUM)
        return str(err.value)

    for message in run_ranks(fake, 2, body).values():
        assert "NCCL could not create the communicator of rank" in message
        assert "Duplicate GPU detected" in message and "torch.cuda.set_device(local_rank)" in message


@pytest.mark.unit
def test_an_error_nccl_returns_from_a_call_is_raised_there_and_the_process_goes_on(monkeypatch):
    """NCCL refusing a call (CuPy raises its NcclError from the call itself: an argument it refuses)
    is raised at the call, as torch's NCCL group raises it: in torch's default mode (3), which ends
    the process for a passed deadline or an asynchronous error, the process goes on, the
    communicator is not aborted, nothing is left for the watchdog, and the ranks' next collectives
    run. On the direct path, synchronous and not, and on the general path (a bool tensor)."""
    monkeypatch.delenv("SMDDP_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    fake = install(monkeypatch)
    ended = []
    monkeypatch.setattr(failures, "end_process", lambda error, rank, mode: ended.append((str(error), rank)))
    step = threading.Barrier(2, timeout=JOIN)

    def body(r, engine, nccl_comm):
        engine.all_reduce(torch.zeros(1), Op.SUM)  # the communicator exists
        step.wait()
        if r == 0:
            fake.refuse = "NCCL_ERROR_INVALID_ARGUMENT: invalid argument"
        step.wait()
        refused = []
        for call in (lambda: engine.all_reduce(torch.ones(3), Op.SUM),
                     lambda: engine.all_reduce(torch.ones(3), Op.MAX, async_op=True),
                     lambda: engine.all_reduce(torch.ones(3, dtype=torch.bool), Op.SUM)):
            with pytest.raises(CollectiveError) as err:
                call()
            refused.append(str(err.value))
        step.wait()
        if r == 0:
            fake.refuse = None
        step.wait()
        t, u = seeded(r, (4,), torch.float32, 5), seeded(r, (2,), torch.float64, 6)
        engine.all_reduce(t, Op.SUM)
        engine.all_reduce(u, Op.MIN, async_op=True).wait()
        drained = nccl_comm.watch.drain()
        return refused, t, u, drained, nccl_comm.failure, nccl_comm._lane.comm is not None

    for r, (refused, t, u, drained, error, alive) in run_ranks(fake, 2, body).items():
        for message in refused:
            assert "NCCL refused all_reduce (sequence number" in message, message
            assert "invalid argument" in message and "still usable" in message, message
        assert torch.equal(t, expected_reduce(2, (4,), torch.float32, Op.SUM, 5)), r
        assert torch.equal(u, expected_reduce(2, (2,), torch.float64, Op.MIN, 6)), r
        assert drained and error is None and alive, r
    assert ended == [] and not any(c.aborted for c in fake.comms)
