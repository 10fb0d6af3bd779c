"""What an NCCL collective keeps, and until when: its tensors until wait() or its stream is done, its events in a pool.

torch's NCCL group stashes a collective's tensors and lets go of them at ``wait()`` (the caller's
stream then orders their reuse), or once the watchdog sees the collective done; it takes its CUDA
events from a cache and returns each when the last holder lets go. smddp's ``nccl`` communicator
must do the same (smddp/comm/backends/nccl/direct.py, watchdog.py), on every stream independently.
Ranks are threads on the host-memory stand-in (tests/helpers/nccl_ranks.py); results are checked
against every rank's seeded inputs.
"""

from __future__ import annotations

import gc
import threading
import time
import weakref

import pytest
import torch
from nccl_ranks import JOIN, expected_reduce, gate, run_ranks, seeded
from nccl_standin import HostEvent, install

from smddp.comm.backends.nccl import watchdog
from smddp.comm.backends.nccl.watchdog import EVENT, HELD, Watchdog
from smddp.comm.reduction import Op

pytestmark = pytest.mark.unit  # in-process, no job started: the fast tier


def _opened(engine) -> None:
    """Make the group's NCCL communicator (the first collective does, on the general path)."""
    engine.all_reduce(torch.zeros(1), Op.SUM)
    torch.cuda.current_stream().synchronize()


def test_an_asynchronous_collectives_input_is_let_go_at_wait_before_its_stream_ran(monkeypatch):
    """An all-gather's input, dropped by the caller, is held while the collective is in flight, and
    let go by ``wait()`` (the caller's stream now waits for it), not later by the watchdog: the
    group's stream is held back meanwhile, so the collective has not even run."""
    fake = install(monkeypatch, deferred=True)

    def body(r, engine, nccl_comm):
        _opened(engine)
        side = nccl_comm._lane.side
        opened = gate(side)  # the group's stream runs nothing until the test opens it
        # The input is a view of a buffer the test keeps: the stand-in's stream reads host memory,
        # which only the buffer must keep; the view is the object the collective holds.
        buffer = seeded(r, (8,), torch.float32, 70)
        view = buffer[2:6]
        dropped = weakref.ref(view)
        out = torch.zeros(2 * 4)
        work = engine.all_gather_into_tensor(out, view, async_op=True)
        del view
        gc.collect()
        held_in_flight = dropped() is not None
        work.wait()
        let_go_at_wait = dropped() is None
        before_it_ran = out.clone()  # the gate holds the group's stream: the all-gather has not run
        opened.set()
        torch.cuda.current_stream().synchronize()
        return held_in_flight, let_go_at_wait, before_it_ran, out, nccl_comm.watch.drain()

    for r, (held, let_go, before_it_ran, out, drained) in run_ranks(fake, 2, body).items():
        assert held, f"rank {r}: the input of a collective in flight was not held"
        assert let_go, f"rank {r}: wait() did not let go of the input"
        assert not before_it_ran.any(), r
        assert torch.equal(out, torch.cat([seeded(q, (8,), torch.float32, 70)[2:6] for q in range(2)])), r
        assert drained


class _Event:
    """A CUDA event a test completes by hand."""

    def __init__(self, done: bool = False):
        self.done = done

    def query(self) -> bool:
        return self.done


def test_a_look_lets_go_of_what_a_finished_stream_used_behind_another_streams_collective():
    """Records on two streams: the first stream's collective is still running, the second stream's
    (made later) has finished. The second's tensors go at the next look, not in issue order behind
    the first's, whose own stay held."""
    watch = Watchdog(60.0, lambda watched, error: None, lambda: None)
    slow = watch.start(1, "all_reduce", held=("slow's tensor",), stream="a")
    fast = watch.start(2, "all_gather_into_tensor", held=("fast's output", "fast's input"), stream="b")
    slow[EVENT], fast[EVENT] = _Event(), _Event(done=True)
    assert watch._look() == (None, None)
    assert fast[HELD] == () and slow[HELD] == ("slow's tensor",)
    assert list(watch._inflight) == [slow, fast]  # taken off in order; only what they hold goes early
    slow[EVENT].done = True
    assert watch._look() == (None, None) and not watch._inflight and slow[HELD] == ()
    watch.stop()


def _count_new_events(monkeypatch) -> list:
    """A list that gets one entry (the making thread's name: never the event, which must be free to go)
    per CUDA event made from now on."""
    made, init = [], HostEvent.__init__

    def counting(self, **kwargs):
        made.append(threading.current_thread().name)
        init(self, **kwargs)

    monkeypatch.setattr(HostEvent, "__init__", counting)
    return made


def test_asynchronous_collectives_take_their_events_from_a_pool(monkeypatch):
    """Once the pool holds enough, asynchronous all-reduces (on the direct path) and all-reduces of a
    strided tensor (the general path, with its copy back) make no new CUDA event; an event a Work
    still holds is not handed to another collective."""
    fake = install(monkeypatch)
    made = _count_new_events(monkeypatch)
    # The watchdog looks (and takes events back) only when the test wakes it: the first burst then
    # fills the pool with as many events as a burst needs, whatever the machine's timing.
    monkeypatch.setattr(watchdog, "POLL", 30.0)

    def rounds(r, engine, what: int, n: int):
        works = []
        for i in range(n):
            t = seeded(r, (4,), torch.float32, 100 * what + i)
            engine.all_reduce(t, Op.SUM, async_op=True).wait()
            s = seeded(r, (3, 2), torch.float32, 100 * what + 50 + i).t()
            engine.all_reduce(s, Op.SUM, async_op=True).wait()
            works.append((i, t, s))
        return works

    def body(r, engine, nccl_comm):
        _opened(engine)
        rounds(r, engine, 1, 20)  # fills the pool: an event per collective, one per copy back: 60
        watch = nccl_comm.watch
        assert watch.drain()
        deadline = time.monotonic() + JOIN / 4  # the engine lets go of its handles; the watchdog looks again
        while len(watch.free) < 3 * 19 and time.monotonic() < deadline:  # the engine may keep its latest
            watch._wake.set()
            time.sleep(0.01)
        before = made.count(threading.current_thread().name)
        got = rounds(r, engine, 2, 19)
        new = made.count(threading.current_thread().name) - before
        kept = engine.all_reduce(torch.ones(2), Op.SUM, async_op=True)
        assert nccl_comm.watch.drain()
        lent = kept._watched[EVENT] in nccl_comm.watch.free  # a Work's event must not be lent out again
        kept.wait()
        return new, lent, got

    for r, (new, lent, got) in run_ranks(fake, 2, body).items():
        assert new == 0, f"rank {r}: {new} CUDA events made for 38 asynchronous collectives"
        assert len(got) == 19
        assert not lent, f"rank {r}: the event of a Work still held went back to the pool"
        for i, t, s in got:
            assert torch.equal(t, expected_reduce(2, (4,), torch.float32, Op.SUM, 200 + i)), (r, i)
            assert torch.equal(s, expected_reduce(2, (3, 2), torch.float32, Op.SUM, 250 + i).t()), (r, i)


def test_a_steady_stream_of_collectives_never_wakes_the_watchdog(monkeypatch):
    """While small synchronous collectives keep coming, each finished before the watchdog's next look,
    the watchdog keeps looking every POLL rather than going to sleep and being woken by a caller
    (an ``Event.set`` costs the caller a microsecond, every few collectives: issue 51's host cost). The
    host-cost variant of the stand-in: events come back to the pool at the look that sees them done."""
    fake = install(monkeypatch, null=True)
    monkeypatch.setattr(watchdog, "POLL", 0.01)

    def body(r, engine, nccl_comm):
        _opened(engine)
        watch = nccl_comm.watch
        sets, real = [], watch._wake.set
        monkeypatch.setattr(watch._wake, "set", lambda: (sets.append(1), real())[1])
        t = seeded(r, (4,), torch.float32, 7)
        calls, end = 0, time.monotonic() + 0.3  # some 30 looks
        while time.monotonic() < end:
            engine.all_reduce(t, Op.SUM)
            calls += 1
        return len(sets), calls

    for r, (sets, calls) in run_ranks(fake, 1, body).items():
        assert sets <= 1, f"rank {r}: {calls} collectives in 0.3 s woke the watchdog {sets} times"


def test_the_watchdog_looks_often_enough_to_keep_the_pool_from_running_dry():
    """Records coming at more than POOL / 2 per POLL shorten the wait before the next look so that
    half the pool comes back in time (never below BUSY_POLL); a slower stream waits POLL."""
    watch = Watchdog(60.0, lambda watched, error: None, lambda: None)
    try:
        watch._taken = watchdog.POOL // 4  # a quarter of the pool in one POLL: no hurry
        assert watch._pause(watchdog.POLL) == watchdog.POLL
        watch._taken = 4 * watchdog.POOL  # four pools in one POLL: look 8 times as often
        pause = watch._pause(watchdog.POLL)
        assert pause == pytest.approx(watchdog.POLL / 8)
        assert pause * watch._taken / watchdog.POLL <= watchdog.POOL // 2  # records until the next look
        watch._taken = 10 ** 9
        assert watch._pause(watchdog.POLL) == watchdog.BUSY_POLL
    finally:
        watch.stop()
