"""The direct path of NCCL all-reduces (smddp/comm/backends/nccl/direct.py) on the host-memory stand-in.

What torch's NCCL group does is the contract: a synchronous all-reduce runs on the caller's
current stream and leaves nothing to track; an asynchronous one runs on the group's stream and
its Work's future is CUDA-aware and complete as it is enqueued, so DDP's backward never waits for
the device; the watchdog never makes a caller wait; collectives captured in a CUDA graph replay
right. Ranks are threads (tests/helpers/nccl_ranks.py); every result is checked against values computed
here from every rank's seeded inputs.
"""

from __future__ import annotations

import copy
import threading
import time
from datetime import timedelta

import pytest
import torch
from nccl_ranks import JOIN, expected_reduce, gate, run_ranks, seeded
from nccl_standin import HostStream, install

from smddp import _compat
from smddp.comm.algorithms import derived
from smddp.comm.backends.nccl import pending
from smddp.comm.backends.nccl.direct import StreamWork
from smddp.comm.backends.nccl.watchdog import DEADLINE, EVENT, HELD, SEQ, Watchdog
from smddp.comm.base import Pending
from smddp.comm.engine import Handle
from smddp.comm.reduction import Op
from smddp.errors import CollectiveError, WaitTimeout
from smddp.torch.process_group import SmddpProcessGroup

pytestmark = pytest.mark.unit  # in-process, no job started: the fast tier


def _opened(engine) -> None:
    """Make the group's NCCL communicator (the first collective does, on the general path)."""
    engine.all_reduce(torch.zeros(1), Op.SUM)
    torch.cuda.current_stream().synchronize()


def _count_new(monkeypatch, cls) -> list:
    """A list that gets one entry per ``cls`` object made from now on: the name of the thread that
    made it (the ranks are threads: :func:`_mine` counts the calling rank's)."""
    made, init = [], cls.__init__

    def counting(self, *args, **kwargs):
        made.append(threading.current_thread().name)
        init(self, *args, **kwargs)

    monkeypatch.setattr(cls, "__init__", counting)
    return made


def _mine(made: list) -> int:
    """How many of ``made`` (:func:`_count_new`) the calling thread (rank) made."""
    return made.count(threading.current_thread().name)


def test_a_synchronous_all_reduce_runs_on_the_callers_stream_with_nothing_to_track(monkeypatch):
    fake = install(monkeypatch, deferred=True)
    handles = _count_new(monkeypatch, Handle)
    pendings = _count_new(monkeypatch, pending.StreamOrdered)

    def body(r, engine, nccl_comm):
        _opened(engine)
        side, mine = nccl_comm._lane.side, torch.cuda.current_stream()
        before = (_mine(handles), _mine(pendings), side.enqueued, mine.enqueued)
        first = engine.seq + 1
        got = []
        for i, (dtype, op) in enumerate([(torch.float32, Op.SUM), (torch.bfloat16, Op.AVERAGE),
                                         (torch.int64, Op.MAX), (torch.float64, Op.PRODUCT)]):
            t = seeded(r, (3, 4), dtype, i)
            assert engine.all_reduce(t, op) is None
            got.append(t)
        records = [w for w in nccl_comm.watch._inflight if w[SEQ] >= first]
        after = (_mine(handles), _mine(pendings), side.enqueued, mine.enqueued)
        mine.synchronize()
        return got, before, after, [w[HELD] for w in records], list(engine.flight.handles)

    results = run_ranks(fake, 2, body)
    for r in range(2):
        got, before, after, held, inflight = results[r]
        for i, (dtype, op) in enumerate([(torch.float32, Op.SUM), (torch.bfloat16, Op.AVERAGE),
                                         (torch.int64, Op.MAX), (torch.float64, Op.PRODUCT)]):
            assert torch.equal(got[i], expected_reduce(2, (3, 4), dtype, op, i)), (r, dtype, op)
        # no handle, no Pending, nothing on the group's stream; the caller's stream ran them
        assert after[:3] == before[:3] and after[3] > before[3]
        assert all(h == () for h in held) and inflight == []


@pytest.mark.parametrize("size", [2, 3])
def test_broadcast_all_gather_and_reduce_scatter_take_the_direct_path(monkeypatch, size):
    """DDP's broadcasts, FSDP2's and tensor parallelism's all-gathers into a tensor and reduce-scatters:
    synchronous ones on the caller's stream with nothing to track, asynchronous ones a StreamWork
    with a CUDA-aware future, the results every rank's seeded inputs give."""
    fake = install(monkeypatch, deferred=True)
    handles = _count_new(monkeypatch, Handle)
    pendings = _count_new(monkeypatch, pending.StreamOrdered)

    def body(r, engine, nccl_comm):
        _opened(engine)
        side, mine = nccl_comm._lane.side, torch.cuda.current_stream()
        got, kinds = {}, {}
        for async_op in (False, True):
            before = (_mine(handles), _mine(pendings), side.enqueued, mine.enqueued)
            b = seeded(r, (5,), torch.float64, 11) if r == size - 1 else torch.zeros(5, dtype=torch.float64)
            gathered = torch.zeros(size, 4, dtype=torch.bfloat16)
            scattered = torch.zeros(3, dtype=torch.float32)
            # inputs held until the stream ran (on a GPU the allocator orders reuse on the stream;
            # the stand-in's host memory would go back to malloc at once)
            mine_g, mine_s = seeded(r, (4,), torch.bfloat16, 12), seeded(r, (3 * size,), torch.float32, 13)
            works = [engine.broadcast(b, size - 1, async_op),
                     engine.all_gather_into_tensor(gathered, mine_g, async_op),
                     derived.reduce_scatter_tensor(engine, scattered, mine_s, Op.MAX, async_op=async_op)]
            after = (_mine(handles), _mine(pendings), side.enqueued, mine.enqueued)
            for work in works:
                if work is not None:
                    assert work.get_future().done()  # complete at enqueue, as torch's NCCL futures
                    work.wait()
            mine.synchronize()
            got[async_op] = (b, gathered, scattered)
            kinds[async_op] = ([type(w).__name__ for w in works], after[0] - before[0], after[1] - before[1],
                               after[2] > before[2], after[3] > before[3])
        return got, kinds, len(fake.futures)

    results = run_ranks(fake, size, body)
    want_b = seeded(size - 1, (5,), torch.float64, 11)
    want_g = torch.stack([seeded(q, (4,), torch.bfloat16, 12) for q in range(size)])
    full = expected_reduce(size, (3 * size,), torch.float32, Op.MAX, 13)
    for r, (got, kinds, futures) in results.items():
        for async_op in (False, True):
            b, gathered, scattered = got[async_op]
            assert torch.equal(b, want_b) and torch.equal(gathered, want_g), (r, async_op)
            assert torch.equal(scattered, full[3 * r:3 * r + 3]), (r, async_op)
        # synchronous: nothing returned, no handle or Pending, the caller's stream ran them, not the group's
        assert kinds[False] == (["NoneType"] * 3, 0, 0, False, True), (r, kinds[False])
        # asynchronous: a StreamWork each, on the group's stream, still no handle or Pending
        assert kinds[True][:4] == (["StreamWork"] * 3, 0, 0, True), (r, kinds[True])
        assert futures >= 3


def test_coalesced_collectives_on_the_direct_path_and_beside_the_general_one(monkeypatch):
    """torch's coalesced calls start one collective per tensor and hand back the last one's Work,
    which stands for them all: direct ones, and a last one the direct path refuses (a bool tensor)."""
    fake = install(monkeypatch)

    def body(r, engine, nccl_comm):
        _opened(engine)
        group = SmddpProcessGroup(engine, r, 2)
        floats = [seeded(r, (4,), torch.float32, 20 + i) for i in range(3)]
        work = group.allreduce_coalesced(floats, torch.distributed.AllreduceCoalescedOptions())
        kinds = [type(work).__name__, [type(w).__name__ for w in work.covers]]
        work.wait()
        mixed = [seeded(r, (2,), torch.float32, 30), seeded(r, (3,), torch.int32, 31) > 0]
        last = group.allreduce_coalesced(mixed, torch.distributed.AllreduceCoalescedOptions())
        kinds += [type(last).__name__, [type(w).__name__ for w in last.covers]]
        last.wait()
        torch.cuda.current_stream().synchronize()
        return floats, mixed, kinds, last.exception()

    for r, (floats, mixed, kinds, error) in run_ranks(fake, 2, body).items():
        for i, t in enumerate(floats):
            assert torch.equal(t, expected_reduce(2, (4,), torch.float32, Op.SUM, 20 + i)), (r, i)
        assert torch.equal(mixed[0], expected_reduce(2, (2,), torch.float32, Op.SUM, 30))
        assert torch.equal(mixed[1], (seeded(0, (3,), torch.int32, 31) > 0) | (seeded(1, (3,), torch.int32, 31) > 0))
        assert kinds == ["StreamWork", ["StreamWork", "StreamWork"], "Handle", ["StreamWork"]], kinds
        assert error is None


def test_the_stand_in_runs_on_a_cuda_build_of_torch_too(monkeypatch):
    # A CUDA build has torch's C calls for the current stream, which smddp prefers: the stand-in
    # must hide them (the device machine runs nccl_host_cost.py on one).
    def real_cuda(*args):
        raise AssertionError("torch's CUDA was called under the stand-in")

    for name in ("_cuda_getCurrentStream", "_cuda_setStream", "_cuda_isCurrentStreamCapturing"):
        monkeypatch.setattr(torch._C, name, real_cuda, raising=False)
    fake = install(monkeypatch)

    def body(r, engine, nccl_comm):
        _opened(engine)
        t, u = seeded(r, (5,), torch.float32, 1), seeded(r, (5,), torch.float32, 2)
        engine.all_reduce(t, Op.SUM)
        engine.all_reduce(u, Op.MAX, async_op=True).wait()
        return t, u

    for r, (t, u) in run_ranks(fake, 2, body).items():
        assert torch.equal(t, expected_reduce(2, (5,), torch.float32, Op.SUM, 1)), r
        assert torch.equal(u, expected_reduce(2, (5,), torch.float32, Op.MAX, 2)), r


def test_an_asynchronous_work_has_a_cuda_aware_future_complete_at_enqueue(monkeypatch):
    fake = install(monkeypatch, deferred=True)

    def body(r, engine, nccl_comm):
        _opened(engine)
        mine, side = torch.cuda.current_stream(), nccl_comm._lane.side
        opened = gate(mine)  # nothing queued after this on `mine` runs, nor on the group's stream after it
        t = seeded(r, (6,), torch.float32, 1)
        sent = t.clone()
        work = engine.all_reduce(t, Op.SUM, async_op=True)
        future = work.get_future()
        state = {"future done at once": future.done(), "tensor untouched": torch.equal(t, sent),
                 "completed while gated": work.is_completed(), "future is the Work's": work.get_future() is future,
                 "devices": fake.futures[-1][1], "lane device": nccl_comm._lane.device}
        with pytest.raises(WaitTimeout, match="still in flight"):
            work.wait(timeout=timedelta(seconds=0.2))  # a timeout makes the host wait, as torch's
        work.wait()  # no timeout: returns at once; `mine` now waits for the collective
        seen = []
        mine.enqueue(lambda: seen.append(t.clone()))  # a kernel queued after the wait
        opened.set()
        mine.synchronize()
        side.synchronize()
        state.update(kind=type(work), seen=seen[0], completed=work.is_completed(), success=work.is_success(),
                     result=work.result()[0] is t, value=future.value()[0] is t)
        return state

    results = run_ranks(fake, 2, body)
    want = expected_reduce(2, (6,), torch.float32, Op.SUM, 1)
    for r in range(2):
        s = results[r]
        assert s["kind"] is StreamWork and s["future done at once"] and s["tensor untouched"]
        assert not s["completed while gated"] and s["future is the Work's"]
        assert s["devices"] == [s["lane device"]]  # CUDA-aware, on the group's device
        assert torch.equal(s["seen"], want) and s["completed"] and s["success"] and s["result"] and s["value"]


def test_a_ddp_backward_never_waits_for_the_device(monkeypatch):
    """DDP's reducer reads its buckets' futures: complete at enqueue, it goes on; the all-reduces run
    on the group's stream later, into the gradients (bucket views)."""
    fake = install(monkeypatch)
    handles = _count_new(monkeypatch, Handle)

    torch.manual_seed(0)
    reference = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))

    def body(r, engine, nccl_comm):
        group = SmddpProcessGroup(engine, r, 2)
        model = copy.deepcopy(reference)
        ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=group, gradient_as_bucket_view=True)
        side = nccl_comm._lane.side
        side.defer()  # the group's stream runs its work later, like a GPU
        opened = gate(side)
        timer = threading.Timer(10.0, opened.set)  # a host that waited for the device would wait this long
        timer.start()
        made, futures = _mine(handles), len(fake.futures)
        ddp(seeded(r, (5, 4), torch.float32, 2)).sum().backward()
        returned_first = not opened.is_set()
        opened.set()
        timer.cancel()
        side.synchronize()
        got = [p.grad.clone() for p in model.parameters()]
        return returned_first, _mine(handles) - made, fake.futures[futures:], got, nccl_comm._lane.device

    results = run_ranks(fake, 2, body)
    per_rank = []
    for r in range(2):
        reference.zero_grad()
        reference(seeded(r, (5, 4), torch.float32, 2)).sum().backward()
        per_rank.append([p.grad.clone() for p in reference.parameters()])
    for r in range(2):
        returned_first, new_handles, futures, got, device = results[r]
        assert returned_first, "backward() waited for the group's stream"
        assert new_handles == 0 and futures  # the buckets' futures (the ranks' together), no engine handle
        assert all(f.done() and devices == [device] for f, devices in futures)
        for i, grad in enumerate(got):
            torch.testing.assert_close(grad, (per_rank[0][i] + per_rank[1][i]) / 2, rtol=0, atol=1e-6)


def test_the_watchdog_queries_events_holding_no_lock_and_callers_never_wait_for_it(monkeypatch):
    fake = install(monkeypatch)
    in_query, release = threading.Event(), threading.Event()

    def probe(event) -> None:
        if threading.current_thread().name.startswith("smddp-nccl-watchdog") and not release.is_set():
            in_query.set()
            release.wait(JOIN)  # the watchdog is stuck in an event query

    def body(r, engine, nccl_comm):
        _opened(engine)
        fake.on_query = probe
        t = seeded(r, (4,), torch.float32, 3)
        engine.all_reduce(t, Op.SUM)
        assert in_query.wait(JOIN), "the watchdog never looked"
        start = time.monotonic()
        for _ in range(50):  # callers start operations while the watchdog sits in a query
            engine.all_reduce(t, Op.SUM)
            engine.all_reduce(t, Op.SUM, async_op=True).wait()
        took = time.monotonic() - start
        stuck = not release.is_set()
        release.set()
        return took, stuck, nccl_comm.watch.drain()

    took, stuck, drained = run_ranks(fake, 1, body)[0]
    assert stuck and took < JOIN / 2 and drained


class _Event:
    """A CUDA event a test completes by hand."""

    def __init__(self, done: bool = False):
        self.done, self.queries = done, 0

    def query(self) -> bool:
        self.queries += 1
        return self.done


def test_the_watchdog_takes_completed_records_in_order_and_reads_the_oldest_deadline():
    expired = []
    watch = Watchdog(60.0, lambda watched, error: expired.append((watched[SEQ], error)), lambda: None)
    first = watch.start(1, "all_reduce", held=("first's tensor",))
    second = watch.start(2, "all_reduce", held=("second's tensor",))
    first[EVENT], second[EVENT] = _Event(), _Event(done=True)
    assert watch._look() == (None, None)
    # the second completed first: it stays until the first does, and its event is not even asked
    assert list(watch._inflight) == [first, second] and second[EVENT].queries == 0
    first[EVENT].done = True
    assert watch._look() == (None, None) and not watch._inflight and first[HELD] == second[HELD] == ()
    third = watch.start(3, "broadcast")
    third[EVENT], third[DEADLINE] = _Event(), time.monotonic() - 1  # past its deadline
    assert watch._look() == (third, None)
    watch.stop()


def test_a_look_asks_each_stream_its_newest_event_and_takes_the_older_ones_off_unasked():
    watch = Watchdog(60.0, lambda watched, error: None, lambda: None)
    on_a = [watch.start(seq, "all_reduce", stream="a") for seq in (1, 2, 3)]
    on_b = watch.start(4, "all_reduce", stream="b")
    unnamed = watch.start(5, "all_reduce")
    for record in on_a:
        record[EVENT] = _Event(done=True)
    on_b[EVENT], unnamed[EVENT] = _Event(), _Event(done=True)
    assert watch._look() == (None, None)
    # stream a: its newest asked, once; the two before it taken off without a query of their own
    assert [r[EVENT].queries for r in on_a] == [0, 0, 1] and all(r[HELD] == () for r in on_a)
    # stream b's newest is not done: it stays, and what follows it waits behind it, unasked
    assert list(watch._inflight) == [on_b, unnamed] and on_b[EVENT].queries == 2 and unnamed[EVENT].queries == 0
    # a record whose stream's newest is still in flight is asked itself
    later_a = watch.start(6, "all_reduce", stream="a")
    on_b[EVENT].done = True
    assert watch._look() == (None, None)
    assert list(watch._inflight) == [later_a] and unnamed[EVENT].queries == 1
    # a stream's newest without its event yet (its NCCL call has not returned) proves nothing
    before = watch.start(7, "all_reduce", stream="a")
    later_a[EVENT], before[EVENT] = _Event(), _Event()
    newest = watch.start(8, "all_reduce", stream="a")
    assert watch._look() == (None, None) and list(watch._inflight) == [later_a, before, newest]
    later_a[EVENT].done = before[EVENT].done = True
    assert watch._look() == (None, None) and list(watch._inflight) == [newest]
    # asked themselves: the oldest at both looks, the next once the oldest was done
    assert (later_a[EVENT].queries, before[EVENT].queries, newest[EVENT]) == (2, 1, None)
    watch.stop()


def test_collectives_captured_in_a_cuda_graph_replay_with_the_right_results(monkeypatch):
    fake = install(monkeypatch)

    def body(r, engine, nccl_comm):
        _opened(engine)
        capture = HostStream(fake)  # graphs capture on a stream of their own
        fake.current.stream = capture
        t, u = torch.zeros(5), torch.zeros(3, dtype=torch.float64)
        watched = len(nccl_comm.watch._inflight)
        with fake.capture(capture) as graph:
            engine.all_reduce(t, Op.SUM)
            engine.all_reduce(u, Op.MAX, async_op=True).wait()
        state = {"watched during capture": len(nccl_comm.watch._inflight) - watched, "replays": []}
        for replay in range(3):
            t.copy_(seeded(r, (5,), torch.float32, 10 + replay))
            u.copy_(seeded(r, (3,), torch.float64, 20 + replay))
            graph.replay()
            capture.synchronize()
            state["replays"].append((t.clone(), u.clone()))
        return state

    results = run_ranks(fake, 2, body)
    for r in range(2):
        s = results[r]
        assert s["watched during capture"] == 0
        for replay, (t, u) in enumerate(s["replays"]):
            assert torch.equal(t, expected_reduce(2, (5,), torch.float32, Op.SUM, 10 + replay))
            assert torch.equal(u, expected_reduce(2, (3,), torch.float64, Op.MAX, 20 + replay))
    # the watchdog may look at events recorded before a capture meanwhile: only in relaxed mode
    assert set(fake.queries_during_capture) <= set(fake.relaxed)
    assert any(name.startswith("smddp-nccl-watchdog") for name in fake.relaxed)


class _Held(Pending):
    """An operation of the general path that completes when a test says so (another communicator's:
    a CPU one, say, which the host moves)."""

    done = False

    def test(self) -> bool:
        return self.done


class _HeldOnStream(_Held):
    """A stream-ordered operation of the general path (the NCCL communicator's own), held in flight."""

    def query(self) -> bool:
        return self.done


def test_what_the_direct_path_cannot_take_goes_the_general_way_in_issue_order(monkeypatch):
    """Converted dtypes (bool), strided tensors, and anything behind this communicator's own general
    path in flight: the general path, whose handles complete in issue order."""
    fake = install(monkeypatch)

    def body(r, engine, nccl_comm):
        _opened(engine)
        kinds = {}
        b = seeded(r, (7,), torch.bool, 4)
        kinds["bool"] = type(engine.all_reduce(b, Op.SUM, async_op=True))
        strided = seeded(r, (4, 2), torch.float32, 5).t()
        kinds["strided"] = type(engine.all_reduce(strided, Op.SUM, async_op=True))
        held = _HeldOnStream()  # a collective of this communicator's general path still in flight
        first = engine.run("held", lambda seq: held, async_op=True)
        kinds["behind one in flight"] = type(engine.all_reduce(torch.ones(2), Op.SUM, async_op=True))
        held.done = True
        first.wait()
        kinds["after"] = type(engine.all_reduce(torch.ones(2), Op.SUM, async_op=True))
        torch.cuda.current_stream().synchronize()
        return kinds, b, strided

    for kinds, b, strided in run_ranks(fake, 2, body).values():
        assert kinds == {"bool": Handle, "strided": Handle, "behind one in flight": Handle, "after": StreamWork}
        assert torch.equal(b, expected_reduce(2, (7,), torch.bool, Op.SUM, 4))
        assert torch.equal(strided, expected_reduce(2, (4, 2), torch.float32, Op.SUM, 5).t())


def test_another_communicators_operation_in_flight_leaves_the_direct_path_on(monkeypatch):
    """An asynchronous CPU all-reduce of a metric in flight (another communicator's, completed by the
    host) does not send the GPU's collectives to the general path, nor does DDP's end of backward then
    wait: they still take the direct path, nothing tracked, their results right."""
    fake = install(monkeypatch)
    handles = _count_new(monkeypatch, Handle)

    def body(r, engine, nccl_comm):
        _opened(engine)
        metric = _Held()
        pending = engine.run("all_reduce (a metric on the CPU)", lambda seq: metric, async_op=True)
        made = _mine(handles)
        t, u = seeded(r, (5,), torch.float32, 60), seeded(r, (4,), torch.float64, 61)
        engine.all_reduce(t, Op.SUM)
        work = engine.all_reduce(u, Op.MAX, async_op=True)
        kinds = (type(work), _mine(handles) - made, pending.is_completed())
        work.wait()
        metric.done = True
        pending.wait()
        torch.cuda.current_stream().synchronize()
        return kinds, t, u

    # timeout: a synchronous all-reduce that waited behind the metric would wait for ever
    for r, (kinds, t, u) in run_ranks(fake, 2, body, timeout=5.0).items():
        assert kinds == (StreamWork, 0, False), (r, kinds)
        assert torch.equal(t, expected_reduce(2, (5,), torch.float32, Op.SUM, 60)), r
        assert torch.equal(u, expected_reduce(2, (4,), torch.float64, Op.MAX, 61)), r


def test_under_the_profiler_the_direct_path_records_its_own_events(monkeypatch):
    """torch.profiler recording does not turn the direct path off: each collective is still enqueued
    with nothing tracked, and the profiler sees it as the general path shows it (smddp:<collective>,
    with its input's shape)."""
    fake = install(monkeypatch)
    handles = _count_new(monkeypatch, Handle)

    def body(r, engine, nccl_comm):
        _opened(engine)
        made = _mine(handles)
        t = seeded(r, (3, 2), torch.float32, 62)
        gathered = torch.zeros(5)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
            engine.all_reduce(t, Op.SUM)
            engine.all_gather_into_tensor(gathered, seeded(r, (5,), torch.float32, 63), async_op=True).wait()
        events = [(e.name, e.input_shapes) for e in prof.events() if e.name.startswith("smddp:")]
        torch.cuda.current_stream().synchronize()
        return _mine(handles) - made, events, t, gathered

    # one rank: torch's profiler is the process's, and two sessions at once (ranks as threads) crash it
    new_handles, events, t, gathered = run_ranks(fake, 1, body)[0]
    assert new_handles == 0  # the direct path: no engine handle, profiled or not
    assert events == [("smddp:all_reduce", [[3, 2]]), ("smddp:all_gather_into_tensor", [[5]])], events
    assert torch.equal(t, seeded(0, (3, 2), torch.float32, 62))
    assert torch.equal(gathered, seeded(0, (5,), torch.float32, 63))


def test_with_the_current_stream_a_future_completes_on_the_collectives_stream(monkeypatch):
    """SMDDP_NCCL_STREAM=current: an asynchronous collective runs on the stream current at the call;
    its future, asked for once another stream is current, still completes on the collective's (its
    event must follow the collective, not whatever the other stream runs)."""
    monkeypatch.setenv("SMDDP_NCCL_STREAM", "current")
    fake = install(monkeypatch, deferred=True)

    def body(r, engine, nccl_comm):
        _opened(engine)
        called_on = torch.cuda.current_stream()
        t = seeded(r, (4,), torch.float32, 64)
        work = engine.all_reduce(t, Op.SUM, async_op=True)
        elsewhere = HostStream(fake, deferred=True)
        fake.current.stream = elsewhere  # the caller moves on to another stream, then asks
        future = work.get_future()
        fake.current.stream = called_on
        called_on.synchronize()
        elsewhere.close()
        return nccl_comm._lane.side, future.completed_on is called_on, future.completed_on is elsewhere, t

    for r, (side, on_collectives, on_elsewhere, t) in run_ranks(fake, 2, body).items():
        assert side is None  # no stream of the group's own in this mode
        assert on_collectives and not on_elsewhere, r
        assert torch.equal(t, expected_reduce(2, (4,), torch.float32, Op.SUM, 64)), r


@pytest.mark.parametrize("size", [2, 3])
def test_a_coalesced_call_is_one_grouped_launch(monkeypatch, size):
    """torch's coalesced all-reduce, all-gather into tensors and reduce-scatter of tensors: one
    ncclGroupStart/ncclGroupEnd each, not a launch per tensor; a tensor only the general path takes
    (bool) launches after the group of those before it. Every rank's results right."""
    fake = install(monkeypatch)

    def body(r, engine, nccl_comm):
        _opened(engine)
        group = SmddpProcessGroup(engine, r, size)
        launched = len(fake.launches)  # the ranks' launches, interleaved: each rank reads its own
        floats = [seeded(r, (4,), torch.float32, 80 + i) for i in range(3)]
        group.allreduce_coalesced(floats, torch.distributed.AllreduceCoalescedOptions()).wait()
        outs = [torch.zeros(size * 2, dtype=torch.float64) for _ in range(2)]
        ins = [seeded(r, (2,), torch.float64, 85 + i) for i in range(2)]
        group.allgather_into_tensor_coalesced(outs, ins).wait()
        scattered = [torch.zeros(3) for _ in range(2)]
        full = [seeded(r, (3 * size,), torch.float32, 88 + i) for i in range(2)]
        options = torch.distributed.ReduceScatterOptions()
        options.reduceOp = torch.distributed.ReduceOp.MAX
        group.reduce_scatter_tensor_coalesced(scattered, full, options).wait()
        mixed = [seeded(r, (2,), torch.float32, 90), seeded(r, (2,), torch.float32, 91),
                 seeded(r, (3,), torch.int32, 92) > 0]
        group.allreduce_coalesced(mixed, torch.distributed.AllreduceCoalescedOptions()).wait()
        torch.cuda.current_stream().synchronize()
        return [names for rank, names in fake.launches[launched:] if rank == r], floats, outs, scattered, mixed

    for r, (launches, floats, outs, scattered, mixed) in run_ranks(fake, size, body).items():
        assert launches[:3] == [["allReduce"] * 3, ["allGather"] * 2, ["reduceScatter"] * 2], (r, launches)
        assert launches[3:] == [["allReduce"] * 2, ["allReduce"]], (r, launches)  # the group, then bool's
        for i, t in enumerate(floats):
            assert torch.equal(t, expected_reduce(size, (4,), torch.float32, Op.SUM, 80 + i)), (r, i)
        for i, out in enumerate(outs):
            assert torch.equal(out, torch.cat([seeded(q, (2,), torch.float64, 85 + i) for q in range(size)]))
        for i, out in enumerate(scattered):
            want = expected_reduce(size, (3 * size,), torch.float32, Op.MAX, 88 + i)[3 * r:3 * r + 3]
            assert torch.equal(out, want), (r, i)
        for i in range(2):
            assert torch.equal(mixed[i], expected_reduce(size, (2,), torch.float32, Op.SUM, 90 + i)), (r, i)
        assert torch.equal(mixed[2], torch.stack([seeded(q, (3,), torch.int32, 92) > 0 for q in range(size)]).any(0))


def test_a_groups_first_collective_inside_a_capture_is_refused_before_anything_is_made(monkeypatch):
    """Making the NCCL communicator cannot be captured (its unique id goes through the store,
    ncclCommInitRank is no kernel): the first collective inside a capture raises, saying to run one
    before capturing, and nothing is made; after the capture the same call works on every rank."""
    fake = install(monkeypatch)

    def body(r, engine, nccl_comm):
        torch.cuda.set_device(r)  # as a training script does (a capture needs CUDA initialized)
        capture = HostStream(fake)
        fake.current.stream = capture
        t = seeded(r, (4,), torch.float32, 93)
        with fake.capture(capture) as graph:
            with pytest.raises(CollectiveError, match="Run one collective on the group before capturing") as err:
                engine.all_reduce(t, Op.SUM)
        made = (nccl_comm._lane, len(graph.nodes))
        fake.current.stream = HostStream(fake)
        engine.all_reduce(t, Op.SUM)
        return str(err.value), made, t

    for r, (message, (lane, captured), t) in run_ranks(fake, 2, body).items():
        assert "during a CUDA graph capture" in message and f"rank {r}" in message, message
        assert lane is None and captured == 0, r  # no communicator, nothing in the graph
        assert torch.equal(t, expected_reduce(2, (4,), torch.float32, Op.SUM, 93)), r
    assert len(fake.comms) == 2  # one each, made after the capture


def test_on_torch_without_pywork_holder_an_asynchronous_call_returns_a_work_cpp_can_keep(monkeypatch):
    """torch 2.4 to 2.6 keep only the C++ half of a Python Work that C++ (DDP's reducer) holds: there
    the direct path returns a C++ Work made from the collective's CUDA-aware future (torch's
    _create_work_from_future), complete at enqueue: its wait() is the future's, which orders the
    caller's streams after the future's events on a GPU (torch's own, not the stand-in's)."""
    monkeypatch.setattr(_compat, "PY_WORK_HOLDER", False, raising=False)
    fake = install(monkeypatch, deferred=True)

    def body(r, engine, nccl_comm):
        _opened(engine)
        side = nccl_comm._lane.side
        opened = gate(side)
        t = seeded(r, (5,), torch.float32, 94)
        work = engine.all_reduce(t, Op.SUM, async_op=True)
        done = work.get_future().done()
        (made, devices), = [(f, d) for f, d in list(fake.futures) if f.done() and f.value()[0] is t]  # this rank's
        state = (type(work), isinstance(work, StreamWork), done, devices, made.completed_on is side, work.wait())
        value = work.get_future().value()[0] is t
        opened.set()
        side.synchronize()
        return state, value, t, nccl_comm._lane.device

    for r, ((kind, python_work, done, devices, on_side, waited), value, t, device) in run_ranks(fake, 2, body).items():
        assert kind is torch.distributed.Work and not python_work, (r, kind)  # C++'s own, no Python half
        assert done and devices == [device] and on_side, r  # CUDA-aware, complete at enqueue, on the group's stream
        assert waited and value, r
        assert torch.equal(t, expected_reduce(2, (5,), torch.float32, Op.SUM, 94)), r
