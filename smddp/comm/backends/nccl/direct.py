"""The direct path of NCCL collectives: enqueued on a stream, nothing for the engine to track.

What torch's NCCL group does with an all-reduce, a broadcast, an all-gather into one tensor and a
reduce-scatter of one tensor (DDP's, FSDP2's and tensor parallelism's collectives), at the host
cost of a few Python calls:

- A synchronous call (torch >= 2.8 passes ``asyncOp=False``; smddp's v1 API) runs NCCL on the
  caller's current stream and hands back nothing: no stream waits on another, no Pending, no
  handle, no tensor held (the caching allocator orders reuse on that stream).
- An asynchronous call runs NCCL on the group's own stream, after a cached event made that stream
  wait for the caller's, and hands back a :class:`StreamWork` whose future is CUDA-aware and
  complete as the collective is enqueued, on the collective's stream: DDP's reducer, ``wait()``
  and ``then`` callbacks make streams wait on it, and the host never does. The tensors are held
  until ``wait()`` has made the caller's stream wait (torch's unstash), or else until the stream
  is done with them (the watchdog's record).
- Every operation is watched against its deadline from before its NCCL call
  (:mod:`~smddp.comm.backends.nccl.watchdog`); one enqueued during a CUDA graph capture is not
  (its event would not be a real one) and runs on the capturing stream, so that replaying the
  graph replays it and no other stream joins the capture. Events come from the watchdog's pool.
- An error NCCL returns from the call itself (an argument it refuses) is raised at the call, as
  torch's NCCL group raises it, and leaves the communicator as it was; NCCL's asynchronous error (a
  peer died) and a passed deadline are the communicator's failure
  (:mod:`~smddp.comm.backends.nccl.failures`).
- The collectives of a coalesced call (:meth:`DirectPath.begin_group`) are one NCCL group
  (``ncclGroupStart``/``ncclGroupEnd``): one launch, one event after them all.
- On torch before 2.7 (no ``PyWorkHolder``) C++ keeps only the C++ half of a Python ``Work``: there
  an asynchronous call returns a C++ ``Work`` made from its future (``_compat.work_from_future``).

:class:`DirectPath` looks up what it needs once, when the group's communicator is made: the
communicator, the device and its index, the codes of the dtypes and reductions NCCL has, the
group's stream and its key, the watchdog. The engine takes it whenever it can (the tensors on the
device, contiguous, a dtype and reduction NCCL has natively, nothing of this communicator's
general path in flight, no ``SMDDP_DEBUG``); everything else takes the general path
(:mod:`smddp.comm.backends.nccl`).
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Dict, Optional

import torch

from smddp import _compat
from smddp.comm.backends.nccl.watchdog import EVENT, HELD, OP_NAME, SEQ, STREAM
from smddp.errors import CollectiveError, WaitTimeout

_Work = torch.distributed.Work
_ALL_REDUCE, _BROADCAST, _ALL_GATHER, _REDUCE_SCATTER = "allReduce", "broadcast", "allGather", "reduceScatter"
_thread_id = threading.get_ident
_profiling = _compat.profiler_enabled  # one C call
_enter, _exit = _compat.record_function_enter, _compat.record_function_exit


def _seconds(timeout) -> Optional[float]:
    """A ``wait()`` timeout in seconds: None for none (torch's ``timedelta(0)`` means none)."""
    if timeout is None:
        return None
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    return seconds if seconds > 0 else None


@_compat.opaque_to_dynamo
class StreamWork(_Work):
    """An asynchronous collective enqueued on a CUDA stream: torch's NCCL ``Work``, in Python.

    What differs from torch's ``WorkNCCL``, and why, is in docs/backends.md ("The Work of a
    collective on the GPU").

    Args:
        path: the direct path that enqueued it (it makes the future, on demand).
        watched: the watchdog's record of it (:data:`~smddp.comm.backends.nccl.watchdog.SEQ`: its
            number and name, its event, what it holds, its stream), or None (enqueued during a graph
            capture: ordered on the capturing stream, nothing to wait for).
        result: the output tensors.
        future: its CUDA-aware future, if made already (a captured collective's).
    """

    __slots__ = ("_path", "_watched", "_result", "_future", "covers")

    def __init__(self, path: DirectPath, watched, result: list, future: Optional[torch.futures.Future] = None):
        _Work.__init__(self)
        self._path, self._watched, self._result, self._future = path, watched, result, future
        #: Collectives issued just before this one that it stands for (a coalesced call,
        #: :func:`smddp.comm.algorithms.derived.each`): their errors are its own.
        self.covers = ()

    def wait(self, timeout=None) -> bool:
        """Make the calling thread's current stream wait for the collective; the host does not wait.

        As torch's NCCL ``Work.wait()``, and as there the tensors the collective holds are let go
        now (the caller's stream orders their reuse after it). With a ``timeout`` the host does wait,
        at most that long, for the GPU to finish it (as torch's does with one).

        Raises:
            WaitTimeout: ``timeout`` passed before the GPU finished it (it stays in flight).
            CollectiveTimeout, CollectiveError: the communicator failed (a deadline passed, NCCL
                reported an error), in a mode where failures raise (``SMDDP_NCCL_ASYNC_ERROR_HANDLING``).
        """
        path = self._path
        owner = path.owner
        error = self.exception() if self.covers else owner.failure
        if error is not None:
            raise error
        watched = self._watched
        if watched is None:  # captured on the capturing stream: ordered already
            return True
        event = watched[EVENT]
        if timeout is not None:
            limit = _seconds(timeout)
            if limit is not None:
                stop = time.monotonic() + limit
                while not event.query():
                    if owner.failure is not None:  # the watchdog gave up on it (or on one before it)
                        raise owner.failure
                    if time.monotonic() > stop:
                        raise WaitTimeout(f"{watched[OP_NAME]} (sequence number {watched[SEQ]}) did not complete "
                                          f"within the {limit:g} s this wait() allowed on rank {owner.rank}; it "
                                          f"is still in flight")
                    time.sleep(1e-4)
                owner.raise_failure()
        path.wait_event(event, path._current()[1])
        watched[HELD] = ()  # torch's unstash: the caller's stream now orders their reuse
        return True

    synchronize = wait

    def block_current_stream(self) -> None:
        """Make the calling thread's current stream wait for the collective (torch's name for it)."""
        self.wait()

    def is_completed(self) -> bool:
        """True once the GPU has finished the collective (as torch's NCCL ``Work``), or it failed."""
        watched = self._watched
        return self._path.owner.failure is not None or watched is None or watched[EVENT].query()

    def is_success(self) -> bool:
        """True once the GPU has finished the collective and the communicator has not failed."""
        return self.is_completed() and self._path.owner.failure is None

    def exception(self) -> Optional[BaseException]:
        """The communicator's failure, if it has one (first, that of a collective it :attr:`covers`)."""
        for work in self.covers:
            error = work.exception()
            if error is not None:
                return error
        return self._path.owner.failure

    def get_future(self) -> torch.futures.Future:
        """The collective's CUDA-aware future, complete since it was enqueued: ``wait()`` and
        ``then()`` make the waiting stream wait on its event, the host does not.

        Made at the first call (DDP's reducer asks at once), on the collective's stream: its event
        is recorded there then, after the collective (and after any collective enqueued there
        since, which a reader then waits for too).
        """
        future = self._future
        if future is None:
            future = self._future = self._path.completed(self._result, self._watched[STREAM])
        return future

    def result(self) -> list:
        """The output tensors."""
        return self._result


class _Group:
    """The collectives of one thread's coalesced call, launched as one NCCL group
    (:meth:`DirectPath.begin_group`; NCCL's groups are per thread).

    Attributes:
        depth: coalesced calls begun and not ended (a callback's within another's).
        stream: the key of the stream the open group's collectives run on; None while none is open.
        raw: that stream.
        event: recorded after the group's launch; every collective's record and Work get it.
        records: the watchdog's records of the open group's collectives.
    """

    __slots__ = ("depth", "stream", "raw", "event", "records")

    def __init__(self):
        self.depth, self.stream, self.raw, self.event, self.records = 1, None, None, None, []


class DirectPath:
    """The collectives of one group's NCCL communicator that need nothing from the engine.

    Args:
        owner: the group's NCCL communicator (:class:`~smddp.comm.backends.nccl.NCCLCommunicator`).
        lane: its NCCL communicator on its device (:class:`~smddp.comm.backends.nccl.lane.Lane`).
    """

    def __init__(self, owner, lane):
        #: The communicator; the calling thread's current stream on the device (asked cheaply).
        self.owner, self.streams = owner, lane.streams
        self._lane, self.watch, self.nccl = lane, owner.watch, owner.nccl
        # Bound once: an attribute lookup less each, on the path of every collective
        self._free, self._watch_start, self._current = self.watch.free, self.watch.start, self.streams.current
        # The calling thread's current stream, asked as _current() asks it, inlined in start()
        streams = self.streams
        self._ask, self._known, self._stream_of = streams.ask, streams.known, streams.stream_of
        self._cuda, self._capturing = streams.index, streams.capturing
        self.device = lane.device
        # get_device(): the CUDA index, -1 on the CPU (one C call; torch.device objects are made per read)
        self._index = -1 if lane.device.type == "cpu" else lane.device.index
        # The dtypes NCCL has a type for (bfloat16 from NCCL 2.10); those sent converted (bool,
        # complex, float8) take the general path. AVERAGE is NCCL's own from 2.10, else not here.
        self._dtypes = {dtype: code for dtype, code in owner.dtype_codes.items() if dtype in owner.dtypes}
        self._ops = {op: code for op, code in owner.op_codes.items() if code is not None}
        #: ``record_event(event, stream)`` and ``wait_event(event, stream)``: CUDA's, one C call each.
        self.record_event, self.wait_event = _compat.record_event, _compat.wait_event
        self._side = lane.side
        if self._side is not None:
            self._side_key = self.streams.key_of(self._side)
            self._ready = lane.ready  # the group's stream waits for the caller's on it
        self._future = _compat.device_future
        # Without PyWorkHolder, C++ (DDP's reducer) would keep only a StreamWork's C++ half.
        self._python_work = _compat.PY_WORK_HOLDER
        #: Thread id to the coalesced call it is starting (:meth:`begin_group`).
        self._groups: Dict[int, _Group] = {}

    #: What a collective returns when the path does not take the call (nothing was sent).
    REFUSED = NotImplemented

    #: The collectives the path takes, by the name of CuPy's NCCL call (:meth:`start`'s ``kind``).
    ALL_REDUCE, BROADCAST, ALL_GATHER, REDUCE_SCATTER = _ALL_REDUCE, _BROADCAST, _ALL_GATHER, _REDUCE_SCATTER

    def start(self, kind: str, output: torch.Tensor, input: Optional[torch.Tensor], arg, async_op: bool,
              result: Optional[list], seq: int, name: str):
        """Enqueue one NCCL collective (see the module docstring for the streams), if the path takes it.

        ``kind`` and its arguments:

        - :attr:`ALL_REDUCE`: ``output`` reduced in place by the reduction ``arg`` (an :class:`Op`);
        - :attr:`BROADCAST`: rank ``arg``'s ``output`` copied into ``output``;
        - :attr:`ALL_GATHER`: every rank's ``input`` gathered into ``output`` (``size * input.numel()``);
        - :attr:`REDUCE_SCATTER`: ``input`` (``size * output.numel()``) reduced by ``arg``, this
          rank's slice into ``output``.

        The path takes contiguous tensors on its device, of a dtype (and a reduction) NCCL has
        natively. The caller has checked the arguments (the engine's checks: sizes, one dtype and
        one device), numbers the collective (``seq``) and holds the engine's start lock. One
        method for the four, not one each: every Python call is on the host's path of every
        collective (``benchmarks/nccl_host_cost.py``).

        Returns:
            :attr:`REFUSED` (nothing sent: the general path's), a :class:`StreamWork` if ``async_op``
            (``result()`` gives ``result``, by default ``[output]``), else None.

        Raises:
            CollectiveError: NCCL refused the call (raised at the call; nothing was enqueued), or
                the communicator has failed.
            CollectiveTimeout: the communicator has failed by a passed deadline.
        """
        dtype = self._dtypes.get(output.dtype)
        if dtype is None or output.get_device() != self._index or not output.is_contiguous():
            return self.REFUSED
        if kind is _ALL_REDUCE or kind is _REDUCE_SCATTER:
            code = self._ops.get(arg)
            if code is None:
                return self.REFUSED
        if kind is _ALL_REDUCE or kind is _BROADCAST:
            count = output.numel()
        else:  # an input and an output, of one dtype and device (the engine checked)
            if not input.is_contiguous():
                return self.REFUSED
            count = input.numel() if kind is _ALL_GATHER else output.numel()
        # torch.profiler's view, as the engine's general path gives it (events.name_of's name)
        profiled = _enter("smddp:" + name.split(" (", 1)[0], output if input is None else input) if _profiling() \
            else None
        lane = self._lane
        lane.busy = True  # before reading lane.comm: see Lane.busy
        try:
            comm = lane.comm
            if comm is None:
                raise self.owner.refusal()
            key = self._ask(self._cuda)  # self._current(), inline
            current = self._known.get(key)
            if current is None:
                current = self._stream_of(key)
            if self._capturing():
                return self._captured(comm, kind, output, input, arg, count, async_op, result, current, seq, name)
            side = self._side if async_op else None
            if side is None:  # the caller's stream: the allocator orders reuse there, nothing held
                stream, raw = key, current
                watched = self._watch_start(seq, name, (), key)
            else:
                stream, raw = self._side_key, side
                ready = self._ready
                self.record_event(ready, current)
                self.wait_event(ready, side)
                watched = self._watch_start(seq, name, (output,) if input is None else (output, input), stream)
            try:
                comm.check_async_error()  # NCCL's asynchronous error (a peer died) fails this call
            except Exception as exc:  # noqa: BLE001 - CuPy's NcclError, or the call an abort ended
                raise self.owner.give_up(seq, name, exc) from exc
            groups = self._groups
            group = groups.get(_thread_id()) if groups else None
            if group is not None:
                self._join_group(group, stream, raw)
            handle = raw.cuda_stream
            try:
                if count:  # NCCL's calls, spelled out: no argument tuple, no lookup by name
                    if kind is _ALL_REDUCE:
                        ptr = output.data_ptr()
                        comm.allReduce(ptr, ptr, count, dtype, code, handle)
                    elif kind is _BROADCAST:
                        ptr = output.data_ptr()
                        comm.broadcast(ptr, ptr, count, dtype, arg, handle)
                    elif kind is _ALL_GATHER:
                        comm.allGather(input.data_ptr(), output.data_ptr(), count, dtype, handle)
                    else:
                        comm.reduceScatter(input.data_ptr(), output.data_ptr(), count, dtype, code, handle)
            except Exception as exc:  # noqa: BLE001 - CuPy's NcclError, or the call an abort ended
                raise self._refused(comm, exc, watched, raw, seq, name) from exc
            if group is None:
                free = self._free  # the watchdog's pool (Watchdog.event, inline)
                event = free.pop() if free else self.watch.event()
                self.record_event(event, raw)
                watched[EVENT] = event
            else:
                group.records.append(watched)  # its event once the group is launched
        finally:
            lane.busy = False
            if profiled is not None:
                _exit(profiled)
        if not async_op:
            return None
        work = StreamWork(self, watched, [output] if result is None else result)
        if self._python_work or group is not None:
            return work
        return _compat.work_from_future(work.get_future())

    def _captured(self, comm, kind, output, input, arg, count, async_op, result, current, seq, name):
        """:meth:`start` during a CUDA graph capture: on the capturing stream, not watched (its event
        would not be a real one), the future completed there now. Called with the lane busy."""
        try:
            comm.check_async_error()
            if count:
                handle = current.cuda_stream
                dtype = self._dtypes[output.dtype]
                if kind is _ALL_REDUCE:
                    ptr = output.data_ptr()
                    comm.allReduce(ptr, ptr, count, dtype, self._ops[arg], handle)
                elif kind is _BROADCAST:
                    ptr = output.data_ptr()
                    comm.broadcast(ptr, ptr, count, dtype, arg, handle)
                elif kind is _ALL_GATHER:
                    comm.allGather(input.data_ptr(), output.data_ptr(), count, dtype, handle)
                else:
                    comm.reduceScatter(input.data_ptr(), output.data_ptr(), count, dtype, self._ops[arg], handle)
        except Exception as exc:  # noqa: BLE001 - CuPy's NcclError
            owner = self.owner
            if owner.failure is not None:
                raise owner.failure from exc
            raise CollectiveError(self._refusal_words(name, seq, exc)) from exc
        if not async_op:
            return None
        result = [output] if result is None else result
        future = self._future(self.device)
        future.set_result(result)
        return StreamWork(self, None, result, future)

    def _refused(self, comm, exc: BaseException, watched, stream, seq: int, name: str) -> BaseException:
        """The error for an NCCL call that raised: the communicator's failure if it has one (an abort
        ended the call, a peer died), else NCCL's refusal of this call, raised at the call as torch's
        NCCL group raises it. The call's record completes after what is queued on ``stream``."""
        owner = self.owner
        if owner.failure is not None:  # as any failure: the error-handling mode acts (an abort finishes)
            return owner.give_up(seq, name, exc)
        try:
            comm.check_async_error()
        except Exception as failure:  # noqa: BLE001 - the communicator's asynchronous error
            return owner.give_up(seq, name, failure)
        event = self.watch.event()
        self.record_event(event, stream)  # nothing was enqueued: the record is done with the stream
        watched[HELD] = ()
        watched[EVENT] = event
        return CollectiveError(self._refusal_words(name, seq, exc))

    def _refusal_words(self, name: str, seq: int, exc: BaseException) -> str:
        owner = self.owner
        return (f"NCCL refused {name} (sequence number {seq}) on rank {owner.rank} ({self.device}): {exc}. "
                f"It was not enqueued and the NCCL communicator is still usable (the error is raised at the "
                f"call, as by torch's NCCL group); the other ranks may be waiting in this collective. Set "
                f"NCCL_DEBUG=WARN to see NCCL's own report")

    # ------------------------------------------------------------------ coalesced calls
    def coalescing(self) -> bool:
        """True while a thread's coalesced call is open on this path (:meth:`begin_group`)."""
        return bool(self._groups)

    def begin_group(self) -> None:
        """Start a coalesced call in this thread: its collectives on this path, until :meth:`end_group`,
        are one NCCL group, launched together (torch's NCCL group's coalesced collectives are one)."""
        group = self._groups.get(_thread_id())
        if group is None:
            self._groups[_thread_id()] = _Group()
        else:
            group.depth += 1

    def end_group(self) -> None:
        """End this thread's coalesced call: launch its collectives (the outermost call's end does);
        call under the engine's start lock (no other NCCL call between).

        Raises:
            CollectiveError: NCCL refused the group (nothing of it was enqueued).
        """
        group = self._groups.get(_thread_id())
        if group is None:
            return
        group.depth -= 1
        if group.depth:
            return
        del self._groups[_thread_id()]
        if group.stream is not None:
            self._launch(group)

    def flush(self) -> None:
        """Launch what the calling thread's coalesced call has started so far (the general path calls
        this before its own NCCL calls, which must come after them)."""
        group = self._groups.get(_thread_id())
        if group is not None and group.stream is not None:
            self._launch(group)

    def _join_group(self, group: _Group, stream, raw) -> None:
        """Open ``group``'s NCCL group on ``stream``, unless it is open there (one open on another
        stream is launched first)."""
        if group.stream != stream:
            if group.stream is not None:
                self._launch(group)
            self.nccl.groupStart()
            group.stream, group.raw, group.event = stream, raw, self.watch.event()

    def _launch(self, group: _Group) -> None:
        """``ncclGroupEnd()``: the open group's collectives, one launch; then its event, for every record."""
        records, event, raw = group.records, group.event, group.raw
        group.stream, group.raw, group.event, group.records = None, None, None, []
        lane = self._lane
        lane.busy = True
        try:
            try:
                self.nccl.groupEnd()
            except Exception as exc:  # noqa: BLE001 - CuPy's NcclError
                error = self.owner.failure or CollectiveError(
                    self._refusal_words(f"a coalesced call of {len(records)} collectives", records[-1].seq
                                        if records else 0, exc))
            else:
                error = None
            self.record_event(event, raw)
            for watched in records:
                if error is not None:
                    watched[HELD] = ()
                watched[EVENT] = event
        finally:
            lane.busy = False
        if error is not None:
            raise error

    def completed(self, result: list, stream) -> torch.futures.Future:
        """A CUDA-aware future with ``result``, completed on ``stream`` (the key of the collective's
        stream: the future's event goes there)."""
        future = self._future(self.device)
        streams = self.streams
        key = streams.current()[0]
        if key == stream:
            future.set_result(result)
            return future
        streams.make_current(stream)
        try:
            future.set_result(result)
        finally:
            streams.make_current(key)
        return future
