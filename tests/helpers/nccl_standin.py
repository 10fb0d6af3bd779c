"""CuPy's NCCL on host memory, for running :class:`smddp.comm.backends.nccl.NCCLCommunicator` without a GPU.

CuPy's NCCL calls take raw device pointers and a stream handle. :class:`HostNccl` performs
them on host memory; ranks are threads of one process that meet per operation. CUDA streams
are :class:`HostStream`: *inline* ones run work in the calling thread as it is enqueued
(a collective then blocks the host until every rank arrived, as NCCL's first call with a
peer can); *deferred* ones run it, in order, on a worker thread, like a GPU, and
:class:`HostEvent` completes when that worker reaches it. ``abort()`` ends this rank's
wait for its peers at once, as ``ncclCommAbort`` does, and its peers' later operations fail
with an asynchronous error (``check_async_error()``), as NCCL reports a peer that went away;
a wait for a peer that never comes ends after :data:`STUCK` seconds with an error, so a
broken test cannot hang.

``NcclCommunicator(...)`` returns once every rank of its unique id has made its own, as
``ncclCommInitRank`` does (or after :attr:`HostNccl.init_wait` seconds, with an error).
CUDA's per-thread current device is kept per thread (``torch.cuda.set_device``,
``torch.cuda.device``, ``torch.cuda.current_device``), and every event query records the
querying thread's device (:attr:`HostNccl.queries`), so a test can see which thread set what.

Install it with :func:`install` (a pytest ``monkeypatch``): tensors stay on the CPU and
the communicator's own code (pointer and offset arithmetic, dtype and op codes, grouping,
stream ordering, held tensors, deadlines, abort, teardown) runs unchanged.

``install(monkeypatch, null=True)`` is the host-cost benchmarks' variant (one thread, a world of
one): NCCL's calls move nothing, and CUDA's and NCCL's primitives that smddp calls on a collective's
path (the current stream, the capture check, an event's record and wait, NCCL's calls and its
asynchronous-error check) are single C calls, as on a GPU host, where they are CUDA's and CuPy's
compiled functions: C builtins stand in for them (:func:`_c_primitives`).
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import operator
import os
import queue
import sys
import threading
import types
from typing import Dict, List, Optional

import torch

#: ``ncclDataType_t`` (nccl.h) by CuPy's constant name.
NCCL_H = {"NCCL_INT8": torch.int8, "NCCL_UINT8": torch.uint8, "NCCL_INT32": torch.int32,
          "NCCL_INT64": torch.int64, "NCCL_FLOAT16": torch.float16, "NCCL_FLOAT32": torch.float32,
          "NCCL_FLOAT64": torch.float64, "NCCL_BFLOAT16": torch.bfloat16}
CODES = {"NCCL_INT8": 0, "NCCL_UINT8": 1, "NCCL_INT32": 2, "NCCL_INT64": 4, "NCCL_FLOAT16": 6,
         "NCCL_FLOAT32": 7, "NCCL_FLOAT64": 8, "NCCL_BFLOAT16": 9}
_DTYPES = {CODES[name]: dtype for name, dtype in NCCL_H.items()}

#: Seconds a rank waits for a peer (or an event) before the stand-in gives up with an error.
STUCK = 60.0


def host_view(ptr: int, count: int, code: int) -> torch.Tensor:
    """The ``count`` elements of NCCL type ``code`` at address ``ptr``, as a tensor (no copy)."""
    dtype = _DTYPES[code]
    nbytes = count * torch.empty(0, dtype=dtype).element_size()
    if not nbytes:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer((ctypes.c_char * nbytes).from_address(ptr), dtype=dtype)


def reduce(values: List[torch.Tensor], op: int) -> torch.Tensor:
    """NCCL's reduction ``op`` of ``values``, computed wide and rounded once to their dtype."""
    stack = torch.stack(values)
    wide = stack.double() if stack.is_floating_point() else stack.long()
    if op == 0:
        out = wide.sum(0)
    elif op == 1:
        out = wide.prod(0)
    elif op == 2:
        out = wide.max(0).values
    elif op == 3:
        out = wide.min(0).values
    elif stack.is_floating_point():
        out = wide.sum(0) / len(values)
    else:
        out = torch.div(wide.sum(0), len(values), rounding_mode="trunc")
    return out.to(stack.dtype)


_REACHED = threading.Event()
_REACHED.set()


class HostEvent:
    """A CUDA event: complete once the stream it was recorded on has reached it."""

    #: Set by :func:`install`: the stand-in whose ``queries`` record who asks.
    fake: Optional[HostNccl] = None

    def __init__(self, **kwargs):
        self._done = _REACHED  # never recorded: complete, as in CUDA

    def record(self, stream=None) -> None:
        stream = stream if stream is not None else torch.cuda.current_stream()
        if not stream.deferred and stream.graph is None:
            self._done = _REACHED  # an inline stream has run everything enqueued on it
            stream.enqueued += 1
            return
        done = self._done = threading.Event()
        stream.enqueue(done.set)

    def query(self) -> bool:
        fake = HostEvent.fake
        if fake is not None:
            fake.queries.append((threading.current_thread().name, getattr(fake.thread, "device", None)))
            if fake.capturing:
                fake.queries_during_capture.append(threading.current_thread().name)
            if fake.on_query is not None:
                fake.on_query(self)
        return self._done.is_set()

    def wait(self) -> None:
        HostEvent.waiting_on(self._done)()

    synchronize = wait

    @staticmethod
    def waiting_on(done: threading.Event):
        """A wait for one recording of an event (its ``threading.Event``), failing after :data:`STUCK` s."""

        def wait() -> None:
            if not done.wait(STUCK):
                raise RuntimeError(f"stand-in: an event did not complete within {STUCK:g} s")

        return wait


class HostStream:
    """A CUDA stream on the host (see the module docstring for *inline* and *deferred*)."""

    _handles = itertools.count(100)

    def __init__(self, fake: HostNccl, deferred: bool = False):
        self.cuda_stream = next(self._handles)
        self.device = torch.device("cpu")
        # what torch's C calls name a stream by (stream_id, device_index, device_type)
        self.stream_id, self.device_index, self.device_type = self.cuda_stream, 0, 1
        self.deferred = deferred
        self.errors: List[BaseException] = []  # what its work raised (a CUDA error)
        self.graph: Optional[HostGraph] = None  # capturing into it (see HostNccl.capture)
        self.enqueued = 0  # work enqueued on it, captured work included
        fake.streams[self.cuda_stream] = self
        if deferred:
            self.defer()

    def defer(self) -> None:
        """Run work on a worker thread from now on (a stream made inline becomes deferred)."""
        self._queue: queue.Queue = queue.Queue()
        self._worker = threading.Thread(target=self._run, name=f"stream-{self.cuda_stream}", daemon=True)
        self._worker.start()
        self.deferred = True

    def enqueue(self, work) -> None:
        self.enqueued += 1
        if self.graph is not None:
            self.graph.nodes.append((self, work))
        elif not self.deferred:
            work()
        else:
            self._queue.put(work)

    def _run(self) -> None:
        while True:
            work = self._queue.get()
            if work is None:
                return
            try:
                work()
            except Exception as exc:  # noqa: BLE001 - kept, as a CUDA error would be
                self.errors.append(exc)

    def wait_event(self, event: HostEvent) -> None:
        # What the event is now, as cudaStreamWaitEvent: recording it again later changes nothing here
        self.enqueue(HostEvent.waiting_on(event._done))

    def wait_stream(self, other: HostStream) -> None:
        event = HostEvent()
        event.record(other)
        self.wait_event(event)

    def synchronize(self) -> None:
        event = HostEvent()
        event.record(self)
        event.wait()

    def close(self) -> None:
        if self.deferred:
            self._queue.put(None)
            self._worker.join(STUCK)


class HostGraph:
    """A CUDA graph: the work captured on a stream, run again at each :meth:`replay`."""

    def __init__(self):
        self.nodes: List[tuple] = []

    def replay(self) -> None:
        for stream, work in self.nodes:
            stream.enqueue(work)


class _World:
    """The ranks of one unique id: their contributions per operation, and their mail."""

    def __init__(self, size: int):
        self.size = size
        self.cv = threading.Condition()
        self.rounds: Dict[int, Dict[int, object]] = {}
        self.aborted: set = set()  # ranks whose communicator was aborted
        self.joined: set = set()  # ranks whose NcclCommunicator(...) was called
        self.gone = False  # set by a test: a creation still waiting for peers fails now
        self.mail: Dict[tuple, torch.Tensor] = {}


class HostNccl(types.ModuleType):
    """``cupy.cuda.nccl`` on host memory.

    Attributes:
        version: what ``get_version()`` returns.
        comms: every communicator made, in order.
        op_codes: the reduction code of every ``allReduce`` and ``reduceScatter`` call.
        streams: stream handle to :class:`HostStream`.
    """

    def __init__(self, version: int = 22703):
        super().__init__("cupy.cuda.nccl")
        #: Seconds ``NcclCommunicator(...)`` waits for the other ranks of its id before failing.
        self.init_wait = STUCK
        #: Set: ``abort()`` blocks until ``release_abort`` is set (an abort that hangs).
        self.abort_blocks = threading.Event()
        self.release_abort = threading.Event()
        #: ``(thread name, the thread's CUDA device)`` of every event query.
        self.queries: List[tuple] = []
        #: Per-thread CUDA state: ``device`` (as set), ``initialized``.
        self.thread = threading.local()
        #: ``(thread name, device)`` of every ``torch.cuda.set_device`` call.
        self.set_devices: List[tuple] = []
        self.available, self.version = True, version
        for name, code in CODES.items():
            setattr(self, name, code)
        self.NCCL_SUM, self.NCCL_PROD, self.NCCL_MAX, self.NCCL_MIN, self.NCCL_AVG = 0, 1, 2, 3, 4
        self.worlds: Dict[bytes, _World] = {}
        self.lock, self.local = threading.Lock(), threading.local()
        self.comms: List[HostCommunicator] = []
        self.op_codes: List[int] = []
        self.streams: Dict[int, HostStream] = {}
        #: Streams capturing now; the names of threads that queried an event meanwhile.
        self.capturing: set = set()
        self.queries_during_capture: List[str] = []
        #: Called with the event at each query (a test's probe), or None.
        self.on_query = None
        #: Threads that put themselves in CUDA's relaxed capture mode (the watchdog's).
        self.relaxed: List[str] = []
        #: Every CUDA-aware future made: ``(future, devices)``.
        self.futures: List[tuple] = []
        #: True: NCCL calls move nothing and queue nothing (host-cost benchmarks at world size 1).
        self.null = False
        #: Every launch, in order, as ``(rank, names)``: the name of one NCCL call outside a group, or
        #: those of one ``groupStart()``..``groupEnd()`` (a single launch: NCCL runs its calls together).
        self.launches: List[tuple] = []
        #: Set by a test: NCCL's collective calls raise this synchronously (as CuPy raises an
        #: ``NcclError`` for an invalid argument), enqueuing nothing.
        self.refuse: Optional[str] = None
        self.NcclCommunicator = lambda ndev, uid, rank: HostCommunicator(self, ndev, uid, rank)

    def get_unique_id(self) -> bytes:
        return os.urandom(128)

    @contextlib.contextmanager
    def capture(self, stream: HostStream):
        """``torch.cuda.graph``: what ``stream`` is given meanwhile is captured into the graph yielded."""
        graph = stream.graph = HostGraph()
        self.capturing.add(stream)
        try:
            yield graph
        finally:
            stream.graph = None
            self.capturing.discard(stream)

    def get_version(self) -> int:
        return self.version

    def groupStart(self) -> None:  # noqa: N802 - CuPy's names
        self.local.group = []

    def groupEnd(self) -> None:  # noqa: N802
        """Launch the group's calls as one: its sends and receives together, then its collectives in order."""
        calls, self.local.group = self.local.group, None
        if not calls:
            return
        self.launches.append((calls[0][0].rank, [call[1] for call in calls]))
        p2p = [call for call in calls if call[1] in ("send", "recv")]
        collectives = [call[2] for call in calls if call[1] not in ("send", "recv")]
        owner, handle = calls[0][0], calls[0][-1]

        def run() -> None:
            if p2p:
                owner.run_group(p2p)
            for work in collectives:
                work()

        owner._enqueue(handle, run)


class HostCommunicator:
    """``cupy.cuda.nccl.NcclCommunicator`` over a :class:`_World` of threads."""

    def __init__(self, fake: HostNccl, ndev: int, uid, rank: int):
        assert isinstance(uid, bytes) and len(uid) == 128
        with fake.lock:
            self.world = fake.worlds.setdefault(uid, _World(ndev))
        self.fake, self.rank = fake, rank
        self.device = getattr(fake.thread, "device", None)  # the creating thread's, as NCCL binds it
        self.calls_after_abort: List[str] = []
        w = self.world
        with w.cv:  # ncclCommInitRank returns once every rank of the id has joined
            w.joined.add(rank)
            w.cv.notify_all()
            if not w.cv.wait_for(lambda: len(w.joined) == ndev or w.gone, fake.init_wait) or w.gone:
                raise RuntimeError(f"stand-in: ncclCommInitRank of rank {rank} waited {fake.init_wait:g} s "
                                   f"for ranks {sorted(set(range(ndev)) - w.joined)}")
        self.error: Optional[str] = None  # set by a test: what check_async_error() raises
        self.destroyed = self.aborted = False
        self.started_after_abort = False  # the current operation began after a peer aborted
        self._rounds = itertools.count()
        self._sent: Dict[int, itertools.count] = {}
        self._received: Dict[int, itertools.count] = {}
        fake.comms.append(self)
        if fake.null:  # CuPy's compiled calls: C builtins that take their integer arguments and do nothing
            self.allReduce = self.reduceScatter = self.broadcast = self.allGather = max  # noqa: N815
            self.check_async_error = int

    def _await(self, ready) -> None:
        """Wait (under the world's lock) until ``ready()``, or fail as an aborted NCCL call does.

        An operation started after a peer aborted fails at once, as NCCL reports a peer that
        went away (an asynchronous error); one already waiting waits for its own abort.
        """
        w = self.world
        if self.started_after_abort:
            self.error = f"the NCCL communicator of rank {min(w.aborted)} was aborted"
            raise RuntimeError(self.error)
        if not w.cv.wait_for(lambda: self.aborted or ready(), STUCK):
            raise RuntimeError(f"stand-in: rank {self.rank} waited {STUCK:g} s for its peers")
        if self.aborted or not ready():  # an abort ends every operation of the communicator
            raise RuntimeError(f"NCCL communicator of rank {self.rank} was aborted")

    def _exchange(self, value) -> list:
        """Every rank's ``value`` for this rank's next collective, in rank order."""
        w, n = self.world, next(self._rounds)
        with w.cv:
            self.started_after_abort = bool(w.aborted)
            slot = w.rounds.setdefault(n, {})
            slot[self.rank] = value
            w.cv.notify_all()
            self._await(lambda: len(slot) == w.size)
            return [slot[r] for r in range(w.size)]

    def _call(self, name: str, stream: int, work) -> None:
        """One NCCL call: refused at once (``fake.refuse``), added to this thread's open group, or launched."""
        if self.fake.refuse is not None:
            raise RuntimeError(self.fake.refuse)
        group = getattr(self.fake.local, "group", None)
        if group is not None:
            group.append((self, name, work, stream))
            return
        self.fake.launches.append((self.rank, [name]))
        self._enqueue(stream, work)

    def _enqueue(self, stream: int, work) -> None:
        if self.fake.null:
            return
        if self.aborted:
            self.calls_after_abort.append(getattr(work, "__qualname__", "call"))
        self.fake.streams[stream].enqueue(work)

    def allReduce(self, send, recv, count, code, op, stream):  # noqa: N802 - CuPy's names
        self.fake.op_codes.append(op)

        def work():
            values = self._exchange(host_view(send, count, code).clone())
            host_view(recv, count, code).copy_(reduce(values, op))

        self._call("allReduce", stream, work)

    def reduceScatter(self, send, recv, count, code, op, stream):  # noqa: N802
        self.fake.op_codes.append(op)

        def work():
            values = self._exchange(host_view(send, count * self.world.size, code).clone())
            mine = [v[self.rank * count:(self.rank + 1) * count] for v in values]
            host_view(recv, count, code).copy_(reduce(mine, op))

        self._call("reduceScatter", stream, work)

    def broadcast(self, send, recv, count, code, root, stream):
        def work():
            values = self._exchange(host_view(send, count, code).clone())
            host_view(recv, count, code).copy_(values[root])

        self._call("broadcast", stream, work)

    def allGather(self, send, recv, count, code, stream):  # noqa: N802
        def work():
            values = self._exchange(host_view(send, count, code).clone())
            host_view(recv, count * self.world.size, code).copy_(torch.cat(values))

        self._call("allGather", stream, work)

    def send(self, ptr, count, code, peer, stream):
        self.fake.local.group.append((self, "send", ptr, count, code, peer, stream))

    def recv(self, ptr, count, code, peer, stream):
        self.fake.local.group.append((self, "recv", ptr, count, code, peer, stream))

    def run_group(self, calls) -> None:
        """A ``groupStart()``..``groupEnd()`` of sends and receives: post every send, then receive."""
        w = self.world
        with w.cv:
            self.started_after_abort = bool(w.aborted)
            for _, kind, ptr, count, code, peer, _ in calls:
                if kind == "send":
                    k = next(self._sent.setdefault(peer, itertools.count()))
                    w.mail[(self.rank, peer, k)] = host_view(ptr, count, code).clone()
            w.cv.notify_all()
            for _, kind, ptr, count, code, peer, _ in calls:
                if kind == "recv":
                    key = (peer, self.rank, next(self._received.setdefault(peer, itertools.count())))
                    self._await(lambda key=key: key in w.mail)
                    host_view(ptr, count, code).copy_(w.mail.pop(key))

    def check_async_error(self):
        if self.error:
            raise RuntimeError(self.error)

    def destroy(self):
        self.destroyed = True

    def abort(self):
        with self.world.cv:
            self.aborted = True
            self.world.aborted.add(self.rank)
            self.world.cv.notify_all()
        if self.fake.abort_blocks.is_set():
            self.fake.release_abort.wait(STUCK)  # ncclCommAbort stuck (a peer holds a lock it needs)


class HostFuture(torch.futures.Future):
    """A CUDA-aware future as the stand-in makes one: it records the stream current when it was
    completed (``completed_on``), where a real one records its CUDA events."""

    completed_on: Optional[HostStream] = None

    def set_result(self, result) -> None:
        self.completed_on = torch.cuda.current_stream()
        super().set_result(result)


def _c_primitives(monkeypatch, fake: HostNccl, default: HostStream) -> None:
    """The null variant's CUDA primitives as C calls, as torch's CUDA build has them (one thread).

    The current stream is a ``dict.get`` (torch's ``_cuda_getCurrentStream``), the capture check
    ``bool``, an event's record and a stream's wait on one ``operator.is_`` or ``operator.not_``
    (``cudaEventRecord``, ``cudaStreamWaitEvent``); only making a stream current stays Python
    (``_cuda_setStream``: a future's completion on a collective's stream, off the timed calls).
    """
    from smddp import _compat

    keys = {index: (default.stream_id, index, default.device_type) for index in range(8)}

    def set_stream_ids(stream_id, device_index, device_type) -> None:
        for index in keys:
            keys[index] = (stream_id, index, device_type)

    monkeypatch.setattr(torch._C, "_cuda_getCurrentStream", keys.get, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_setStream", set_stream_ids, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_isCurrentStreamCapturing", bool, raising=False)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: fake.streams[keys[0][0]])
    monkeypatch.setattr(torch.cuda, "set_stream", lambda stream: set_stream_ids(stream.stream_id, 0, 1))
    monkeypatch.setattr(_compat, "record_event", operator.is_, raising=False)
    monkeypatch.setattr(_compat, "wait_event", operator.is_, raising=False)
    # smddp before _compat.record_event called torch.cuda.Event's and Stream's own methods
    monkeypatch.setattr(HostEvent, "record", operator.not_)
    monkeypatch.setattr(HostStream, "wait_event", operator.not_)
    fake.groupStart = fake.groupEnd = tuple


def install(monkeypatch, deferred: bool = False, null: bool = False) -> HostNccl:
    """Put :class:`HostNccl` in CuPy's place and host streams in torch.cuda's; tensors stay on the CPU.

    Args:
        monkeypatch: pytest's fixture (everything is undone after the test).
        deferred: streams (the default stream of every thread, and new ones) run work on
            worker threads instead of inline.
        null: the host-cost benchmarks' variant (see the module docstring): one thread, NCCL's
            calls move nothing, the primitives on a collective's path are C calls.

    Returns:
        The stand-in; ``fake.current.stream`` sets the calling thread's current stream.
    """
    import smddp.comm.backends.nccl.communicator as nccl_module
    from smddp import _compat
    from smddp.comm.backends.nccl import pending, watchdog

    fake = HostNccl()
    fake.null = null
    runtime = types.SimpleNamespace(devices=[], setDevice=lambda index: runtime.devices.append(index))
    cuda = types.ModuleType("cupy.cuda")
    cuda.nccl, cuda.runtime = fake, runtime
    cupy = types.ModuleType("cupy")
    cupy.cuda = cuda
    for name, module in (("cupy", cupy), ("cupy.cuda", cuda), ("cupy.cuda.nccl", fake)):
        monkeypatch.setitem(sys.modules, name, module)
    current = threading.local()

    def current_stream(device=None) -> HostStream:
        if not hasattr(current, "stream"):
            current.stream = HostStream(fake, deferred)  # each thread's default stream
        return current.stream

    thread = fake.thread

    def set_device(device) -> None:
        index = device.index if isinstance(device, torch.device) else int(device)
        thread.device, thread.initialized = index, True
        fake.set_devices.append((threading.current_thread().name, index))

    @contextlib.contextmanager
    def device_guard(device):
        before = getattr(thread, "device", None)
        thread.device = device.index if isinstance(device, torch.device) else device
        try:
            yield
        finally:
            thread.device = before

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: getattr(thread, "initialized", False))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: getattr(thread, "device", None) or 0)
    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    monkeypatch.setattr(torch.cuda, "device", device_guard)
    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)

    def set_stream(stream) -> None:
        current.stream = stream

    monkeypatch.setattr(torch.cuda, "set_stream", set_stream)
    # On a CUDA build of torch, smddp would ask torch's C calls for the current stream
    # (_compat.CudaStreams) and get real streams: hidden here, it asks the functions above.
    for name in ("_cuda_getCurrentStream", "_cuda_setStream", "_cuda_isCurrentStreamCapturing"):
        monkeypatch.setattr(torch._C, name, None, raising=False)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: current_stream().graph is not None)

    def device_future(device):
        future = HostFuture()  # CUDA-aware on a GPU; here the devices are recorded
        fake.futures.append((future, [device]))
        return future

    monkeypatch.setattr(_compat, "device_future", device_future, raising=False)

    def relax_capture_mode() -> bool:
        fake.relaxed.append(threading.current_thread().name)
        return True

    monkeypatch.setattr(watchdog, "relax_capture_mode", relax_capture_mode, raising=False)
    monkeypatch.setattr(pending, "relax_capture_mode", relax_capture_mode, raising=False)
    def stream(device=None, stream_id=None, device_index=None, device_type=None) -> HostStream:
        # torch.cuda.Stream(stream_id=...) names an existing stream (what _compat.CudaStreams makes)
        return fake.streams[stream_id] if stream_id is not None else HostStream(fake, deferred)

    monkeypatch.setattr(torch.cuda, "Stream", stream)
    monkeypatch.setattr(torch.cuda, "Event", HostEvent)
    # an event's record and a stream's wait on it, as smddp calls them (torch's C methods on a GPU)
    monkeypatch.setattr(_compat, "record_event", lambda event, stream: event.record(stream), raising=False)
    monkeypatch.setattr(_compat, "wait_event", lambda event, stream: stream.wait_event(event), raising=False)
    # Host code inside `with torch.cuda.stream(s)` runs at once: the tests that use deferred
    # streams avoid it (no AVERAGE before NCCL 2.10, no all_to_all_single to oneself).
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None)
    # Tensors stay on the CPU; the CUDA index the communicator sets is the real choice
    # (device_id, the current device as set, the local rank), kept per rank (thread).
    real_pick = nccl_module.pick_device

    def pick_device(ctx, kind):
        if ctx.device is None or ctx.device.type == kind:  # smddp before issue 34 passed the CPU device on
            thread.chosen = real_pick(ctx, kind).index
        return torch.device("cpu")

    monkeypatch.setattr(nccl_module, "pick_device", pick_device)
    # raising=False: the same stand-in also runs the tests against smddp before it had these
    monkeypatch.setattr(nccl_module, "cuda_index", lambda device: thread.chosen, raising=False)
    monkeypatch.setattr(HostEvent, "fake", fake)
    fake.current, fake.runtime = current, runtime
    if null:
        _c_primitives(monkeypatch, fake, current_stream())
    return fake

