"""The engine's work in flight (:class:`~smddp.comm.engine.progress.InFlight`), through its public methods.

An engine of one rank over a communicator that starts nothing; each test makes handles over
operations that complete when the test says so (:class:`Switch`), hands them to ``engine.flight``
and checks what the part does with them: issue order, failures and the collectives after them,
what a failed operation leaves held, the drain, the close, the stream-ordered test of the
direct-path gate, help from a thread about to wait. The process's progress thread passes over
them meanwhile, as it does in a job: the tests check outcomes and their order, not who found them.
"""

from __future__ import annotations

import gc
import threading
import time
import weakref
from datetime import timedelta
from typing import List, Optional

import pytest

from smddp.comm.base import Communicator, Context, Failed, Pending
from smddp.comm.engine import Engine, Handle
from smddp.comm.engine.progress import SERVICE
from smddp.comm.waiting import poll
from smddp.errors import CollectiveError, CollectiveMismatchError, CollectiveTimeout
from smddp.job.topology import Topology

pytestmark = pytest.mark.unit


class Switch(Pending):
    """An operation that completes once :meth:`open` is called (raises ``error`` from then, if set);
    with ``on_device``, a stream-ordered one whose device finishes it once ``device`` is set."""

    def __init__(self, on_device: bool = False, error: Optional[BaseException] = None):
        self.opened = threading.Event()
        self.error = error
        self.device = threading.Event()
        if on_device:
            self.query = self.device.is_set

    def open(self) -> Switch:
        self.opened.set()
        return self

    def test(self) -> bool:
        if not self.opened.is_set():
            return False
        if self.error is not None:
            raise self.error
        return True


class Idle(Communicator):
    """A communicator whose every collective starts an operation that never completes (the tests
    make their own operations)."""

    name = "idle"

    def _never(self, *args) -> Pending:
        return Switch()

    all_reduce = broadcast = all_gather = all_to_all_single = barrier = _never


def make_engine(timeout: float = 10) -> Engine:
    ctx = Context(Topology(rank=0, size=1, local_rank=0, local_size=1, launcher="none"), timedelta(seconds=timeout))
    return Engine({"cpu": Idle(ctx)}, timeout=timeout)


@pytest.fixture
def engine():
    eng = make_engine()
    yield eng
    eng.close()


def started(engine: Engine, pending: Pending, seq: int, ordered: bool = True) -> Handle:
    """A handle over ``pending``, handed to the engine's work in flight."""
    return engine.flight.track(Handle(engine, seq, f"op{seq}", pending, ordered=ordered))


def until(condition, seconds: float = 10) -> bool:
    """True once ``condition()`` is, False if ``seconds`` pass first (smddp's wait loop)."""
    return poll(condition, time.monotonic() + seconds)


def test_operations_complete_in_issue_order_whatever_order_their_operations_finish(engine):
    switches = [Switch() for _ in range(3)]
    handles = [started(engine, switch, seq) for seq, switch in enumerate(switches, 1)]
    order: List[int] = []
    for handle in handles:
        handle.add_done_callback(lambda h: order.append(h.seq))
    switches[2].open()
    switches[1].open()
    assert until(lambda: handles[1].finished and handles[2].finished)
    engine.flight.poll()
    # finished, not done: the first one, issued before them, is not
    assert not any(handle.done for handle in handles) and engine.flight.handles == handles
    assert not handles[2].is_completed() and order == []
    switches[0].open()
    assert handles[2].wait()
    assert order == [1, 2, 3] and all(handle.done for handle in handles)
    assert until(engine.flight.idle) and engine.flight.handles == []


def test_a_pass_replaces_the_list_in_flight_and_never_changes_it(engine):
    """The direct-path gate reads the list without the lock: a pass hands it a new one."""
    switch = Switch()
    handle = started(engine, switch, 1)
    seen = engine.flight.handles
    assert seen == [handle]
    switch.open()
    handle.wait()
    assert until(lambda: engine.flight.handles == [])
    assert seen == [handle] and engine.flight.handles is not seen


def test_after_a_failure_later_collectives_are_cancelled_and_a_message_is_not(engine):
    failing = Switch(error=RuntimeError("the library failed"))
    first = started(engine, failing, 1)
    second = started(engine, Switch().open(), 2)
    message = started(engine, Switch().open(), 2, ordered=False)
    failing.open()
    with pytest.raises(CollectiveError, match="op1 .*failed on rank 0 of 1: the library failed"):
        first.wait()
    with pytest.raises(CollectiveError, match=r"op2 \(sequence number 2\) was cancelled on rank 0: op1"):
        second.wait()
    assert isinstance(second.error.__cause__, CollectiveError) and second.error.__cause__ is first.error
    assert message.wait() and message.exception() is None
    assert not engine.flight.drain()  # the failed operation's buffers are held as long as the engine


def test_a_mismatch_leaves_the_collectives_after_it_running(engine):
    mismatch = CollectiveMismatchError("op1: rank 0 sent float32, rank 1 int64")
    first = started(engine, Failed(mismatch), 1)
    second = started(engine, Switch().open(), 2)
    with pytest.raises(CollectiveMismatchError, match="rank 1 int64"):
        first.wait()
    assert second.wait() and second.exception() is None


def test_an_operation_past_its_deadline_fails_with_a_timeout_and_is_held():
    engine = make_engine(timeout=0.3)
    try:
        handle = started(engine, Switch(), 1)
        with pytest.raises(CollectiveTimeout, match=r"op1 \(sequence number 1\) did not complete within 0.3 s"):
            handle.wait()
        assert handle.done and handle.finished and isinstance(handle.error, CollectiveTimeout)
        assert not engine.flight.drain()  # nothing in flight; its Pending is held
    finally:
        engine.close()


def test_drain_waits_for_every_operation_in_flight(engine):
    switches = [Switch() for _ in range(2)]
    handles = [started(engine, switch, seq) for seq, switch in enumerate(switches, 1)]
    opener = threading.Timer(0.2, lambda: [switch.open() for switch in switches])
    opener.start()
    try:
        assert engine.flight.drain()  # both completed, nothing held
        assert all(handle.done for handle in handles) and engine.flight.handles == []
    finally:
        opener.join()


def test_what_is_held_makes_the_drain_say_not_clean(engine):
    assert engine.flight.drain()
    engine.flight.hold(object())
    assert not engine.flight.drain()


def test_close_ends_what_is_in_flight_and_never_started_and_settles_what_waits_for_its_device():
    engine = make_engine()
    flight = engine.flight
    on_device = Switch(on_device=True).open()  # done for the host; its device has not finished it
    device_handle = started(engine, on_device, 1)
    assert device_handle.wait()
    assert until(lambda: device_handle.done) and not flight.idle()  # on the device still
    stuck = started(engine, Switch(), 2)
    waiting = Handle(engine, 0, "op3", Switch())  # waited to start: never tracked
    flight.close([waiting], lambda handle: CollectiveError(f"gone: {handle.op_name}"))
    for handle, name in ((stuck, "op2"), (waiting, "op3")):
        assert handle.is_completed() and handle.done
        with pytest.raises(CollectiveError, match=f"gone: {name}"):
            handle.wait()
    assert flight.idle() and flight.handles == [] and not SERVICE.serves(flight)
    assert not flight.drain()  # the abandoned operation's Pending is held
    engine.close()


def test_on_stream_is_true_only_while_a_stream_ordered_operation_is_in_flight(engine):
    host = Switch()
    started(engine, host, 1)
    assert not engine.flight.on_stream()
    device = Switch(on_device=True)
    handle = started(engine, device, 2)
    assert engine.flight.on_stream()
    host.open()
    device.open()
    handle.wait()
    assert until(lambda: not engine.flight.handles) and not engine.flight.on_stream()
    device.device.set()
    assert until(engine.flight.idle)


def test_finish_helps_until_done_or_gives_up_at_its_limit(engine):
    switch = Switch()
    handle = started(engine, switch, 1)
    began = time.monotonic()
    assert not engine.flight.finish([handle], 0.05)
    assert 0.04 < time.monotonic() - began < 5 and not handle.done
    threading.Timer(0.05, switch.open).start()
    assert engine.flight.finish([handle], 10) and handle.done


def test_a_done_callback_that_raises_fails_its_operation_only(engine):
    first, second = Switch(), Switch()
    one, two = started(engine, first, 1), started(engine, second, 2)

    def boom(handle):
        raise ValueError("bad callback")

    one.add_done_callback(boom)
    later: List[int] = []
    two.add_done_callback(lambda h: later.append(h.seq))
    first.open()
    second.open()
    with pytest.raises(CollectiveError, match=r"a done-callback of op1 \(sequence number 1\) raised .*bad callback"):
        one.wait()
    assert two.wait() and later == [2]
    done_now: List[int] = []
    one.add_done_callback(lambda h: done_now.append(h.seq))  # added once done: runs at once
    assert done_now == [1]


def test_the_engine_lets_go_of_the_callers_latest_work_once_a_pass_completes_it(engine):
    """The part tells the engine when a pass completed operations: the engine's record of where this
    rank is then counts the caller's latest Work done and no longer keeps it alive."""
    switch = Switch()
    handle = engine.run("op", lambda seq: switch, async_op=True)
    assert handle is not None and engine.flight.handles == [handle]
    assert engine.status()["done"] is False
    switch.open()
    handle.wait()
    assert until(lambda: not engine.flight.handles)
    gone = weakref.ref(handle)
    del handle
    gc.collect()
    assert gone() is None, "the engine kept the caller's Work after it was done"
    assert engine.status()["done"] is True and engine.status()["seq"] == 1


def test_the_progress_thread_fails_a_collective_a_rank_will_never_join(monkeypatch):
    """An operation no caller waits for (C++ does: DDP's reducer without smddp's hook) is looked at by
    the progress thread: once the oldest has waited LOOK_AFTER, the engine's look for ranks that ended
    fails it there and then, and the collective after it is cancelled, long before their deadline."""
    from smddp.comm.engine import progress

    monkeypatch.setattr(progress, "LOOK_AFTER", 0.05)
    asked: List[int] = []

    def look_for_ended(self, seq: int, op_name: str) -> None:
        asked.append(seq)
        if seq == 1:
            raise CollectiveError(f"{op_name} cannot complete: rank 1 ended before it")

    monkeypatch.setattr(Engine, "look_for_ended", look_for_ended)
    engine = make_engine(timeout=60)
    try:
        first, second = started(engine, Switch(), 1), started(engine, Switch(), 2)
        assert until(lambda: first.done and second.done, 10), asked
        assert asked and set(asked) == {1}
        assert "op1 cannot complete: rank 1 ended before it" in str(first.error)
        assert "op2 (sequence number 2) was cancelled on rank 0: op1" in str(second.error)
    finally:
        engine.close()
