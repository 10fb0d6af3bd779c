"""The direct path of NCCL collectives: enqueued on a stream, nothing for the engine to track.

What torch's NCCL group does with an all-reduce, a broadcast, an all-gather into one tensor and a
reduce-scatter of one tensor (DDP's, FSDP2's and tensor parallelism's collectives), at the host
cost of a few Python calls:

- A synchronous call (torch >= 2.8 passes ``asyncOp=False``; smddp's v1 API) runs NCCL on the
  caller's current stream and hands back nothing: no stream waits on another, no Pending, no
  handle, no tensor held (the caching allocator orders reuse on that stream).
- An asynchronous call runs NCCL on the group's own stream, after a cached event made that stream
  wait for the caller's, and hands back a :class:`StreamWork` whose future is CUDA-aware and
  complete as the collective is enqueued (its event recorded on the group's stream): DDP's
  reducer, ``wait()`` and ``then`` callbacks make streams wait on it, and the host never does.
  The tensors are held until the stream is done with them (the watchdog's record).
- Every operation is watched against its deadline from before its NCCL call
  (:mod:`~smddp.comm.backends.nccl.watchdog`); one enqueued during a CUDA graph capture is not
  (its event would not be a real one) and runs on the capturing stream, so that replaying the
  graph replays it and no other stream joins the capture.

:class:`DirectPath` looks up what it needs once, when the group's communicator is made: the
communicator, the device and its index, the codes of the dtypes and reductions NCCL has, the
group's stream and its key, the watchdog. The engine takes it whenever it can (the tensors on the
device, contiguous, a dtype and reduction NCCL has natively, and no operation of the general path
in flight, no ``SMDDP_DEBUG``, no profiler); everything else takes the general path
(:mod:`smddp.comm.backends.nccl`).
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Optional

import torch

from smddp import _compat
from smddp.errors import WaitTimeout

_Work = torch.distributed.Work
_ALL_REDUCE, _BROADCAST, _ALL_GATHER, _REDUCE_SCATTER = "allReduce", "broadcast", "allGather", "reduceScatter"


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
        event: the CUDA event recorded after it, or None (enqueued during a graph capture).
        result: the output tensors.
        name: the collective's name, for errors.
        seq: its sequence number, for errors.
        future: its CUDA-aware future, if made already (a captured collective's).
    """

    __slots__ = ("_path", "_event", "_result", "_name", "_seq", "_future", "covers")

    def __init__(self, path: DirectPath, event, result: list, name: str, seq: int,
                 future: Optional[torch.futures.Future] = None):
        _Work.__init__(self)
        self._path, self._event, self._result, self._name, self._seq = path, event, result, name, seq
        self._future = future
        #: Collectives issued just before this one that it stands for (a coalesced call,
        #: :func:`smddp.comm.algorithms.derived.each`): their errors are its own.
        self.covers = ()

    def wait(self, timeout=None) -> bool:
        """Make the calling thread's current stream wait for the collective; the host does not wait.

        As torch's NCCL ``Work.wait()``. With a ``timeout`` the host does wait, at most that long, for
        the GPU to finish it (as torch's does with one).

        Raises:
            WaitTimeout: ``timeout`` passed before the GPU finished it (it stays in flight).
            CollectiveTimeout, CollectiveError: the communicator failed (a deadline passed, NCCL
                reported an error), in a mode where failures raise (``SMDDP_NCCL_ASYNC_ERROR_HANDLING``).
        """
        owner = self._path.owner
        error = self.exception() if self.covers else owner._error
        if error is not None:
            raise error
        event = self._event
        if event is None:  # captured on the capturing stream: ordered already
            return True
        if timeout is not None:
            limit = _seconds(timeout)
            if limit is not None:
                stop = time.monotonic() + limit
                while not event.query():
                    if owner._error is not None:  # the watchdog gave up on it (or on one before it)
                        raise owner._error
                    if time.monotonic() > stop:
                        raise WaitTimeout(f"{self._name} (sequence number {self._seq}) did not complete within "
                                          f"the {limit:g} s this wait() allowed on rank {owner.rank}; it is "
                                          f"still in flight")
                    time.sleep(1e-4)
                owner.raise_failure()
        self._path.streams.current()[1].wait_event(event)
        return True

    synchronize = wait

    def block_current_stream(self) -> None:
        """Make the calling thread's current stream wait for the collective (torch's name for it)."""
        self.wait()

    def is_completed(self) -> bool:
        """True once the GPU has finished the collective (as torch's NCCL ``Work``), or it failed."""
        event = self._event
        return self._path.owner._error is not None or event is None or event.query()

    def is_success(self) -> bool:
        """True once the GPU has finished the collective and the communicator has not failed."""
        return self.is_completed() and self._path.owner._error is None

    def exception(self) -> Optional[BaseException]:
        """The communicator's failure, if it has one (first, that of a collective it :attr:`covers`)."""
        for work in self.covers:
            error = work.exception()
            if error is not None:
                return error
        return self._path.owner._error

    def get_future(self) -> torch.futures.Future:
        """The collective's CUDA-aware future, complete since it was enqueued: ``wait()`` and
        ``then()`` make the waiting stream wait on its event, the host does not.

        Made at the first call (DDP's reducer asks at once): its event is recorded on the
        group's stream then, after the collective (and after any collective enqueued there since,
        which a reader then waits for too).
        """
        future = self._future
        if future is None:
            future = self._future = self._path.completed(self._result)
        return future

    def result(self) -> list:
        """The output tensors."""
        return self._result


class DirectPath:
    """The collectives of one group's NCCL communicator that need nothing from the engine.

    Args:
        owner: the group's NCCL communicator (:class:`~smddp.comm.backends.nccl.NCCLCommunicator`).
        lane: its NCCL communicator on its device (:class:`~smddp.comm.backends.nccl.lane.Lane`).
    """

    def __init__(self, owner, lane):
        #: The communicator; the calling thread's current stream on the device (asked cheaply).
        self.owner, self.streams = owner, lane.streams
        self._lane, self._watch = lane, owner._watch
        self.device = lane.device
        # get_device(): the CUDA index, -1 on the CPU (one C call; torch.device objects are made per read)
        self._index = -1 if lane.device.type == "cpu" else lane.device.index
        # The dtypes NCCL has a type for (bfloat16 from NCCL 2.10); those sent converted (bool,
        # complex, float8) take the general path. AVERAGE is NCCL's own from 2.10, else not here.
        self._dtypes = {dtype: code for dtype, code in owner._dtype_codes.items() if dtype in owner.dtypes}
        self._ops = {op: code for op, code in owner._op_codes.items() if code is not None}
        self._side = lane.side
        if self._side is not None:
            self._side_key = self.streams.key_of(self._side)
            self._side_raw = self._side.cuda_stream
            with torch.cuda.device(lane.index):
                self._ready = torch.cuda.Event()  # the group's stream waits for the caller's on it
        self._future = _compat.device_future

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
            CollectiveError, CollectiveTimeout: the communicator failed, or NCCL refused the call.
        """
        dtype = self._dtypes.get(output.dtype)
        if dtype is None or output.get_device() != self._index or not output.is_contiguous():
            return self.REFUSED
        if kind is _ALL_REDUCE or kind is _REDUCE_SCATTER:
            code = self._ops.get(arg)
            if code is None:
                return self.REFUSED
        if kind is _ALL_REDUCE or kind is _BROADCAST:
            count, held = output.numel(), (output,)
        else:  # an input and an output, of one dtype and device (the engine checked)
            if not input.is_contiguous():
                return self.REFUSED
            count, held = (input.numel() if kind is _ALL_GATHER else output.numel()), (output, input)
        lane = self._lane
        lane.busy = True  # before reading lane.comm: see Lane.busy
        try:
            comm = lane.comm
            if comm is None:
                raise self.owner._refusal()
            streams = self.streams
            key, current = streams.current()
            capturing = streams.capturing()
            side = self._side if async_op and not capturing else None
            watched = None if capturing else (
                self._watch.start(seq, name, (), key) if side is None else
                self._watch.start(seq, name, held, self._side_key))
            try:
                comm.check_async_error()  # NCCL's asynchronous error (a peer died) fails this call
                if side is None:
                    stream = current.cuda_stream
                else:
                    ready = self._ready
                    ready.record(current)
                    side.wait_event(ready)
                    stream = self._side_raw
                if count:  # NCCL's calls, spelled out: no argument tuple, no lookup by name
                    if kind is _ALL_REDUCE:
                        ptr = output.data_ptr()
                        comm.allReduce(ptr, ptr, count, dtype, code, stream)
                    elif kind is _BROADCAST:
                        ptr = output.data_ptr()
                        comm.broadcast(ptr, ptr, count, dtype, arg, stream)
                    elif kind is _ALL_GATHER:
                        comm.allGather(input.data_ptr(), output.data_ptr(), count, dtype, stream)
                    else:
                        comm.reduceScatter(input.data_ptr(), output.data_ptr(), count, dtype, code, stream)
                if watched is not None:
                    if async_op:
                        event = torch.cuda.Event()  # the Work's own: never pooled
                    else:
                        event = self._watch.event()
                        watched.pooled = True
                    event.record(current if side is None else side)
                    watched.event = event
            except Exception as exc:  # noqa: BLE001 - CuPy's NcclError, or the call an abort ended
                raise self.owner._give_up(seq, name, exc) from exc
        finally:
            lane.busy = False
        if not async_op:
            return None
        if result is None:
            result = [output]
        if watched is None:  # captured: complete the future on the capturing stream now
            future = self._future(self.device)
            future.set_result(result)
            return StreamWork(self, None, result, name, seq, future)
        return StreamWork(self, watched.event, result, name, seq)

    def completed(self, result: list) -> torch.futures.Future:
        """A CUDA-aware future with ``result``, completed on the group's stream (its event goes there)."""
        future = self._future(self.device)
        side = self._side
        if side is None:
            future.set_result(result)
            return future
        streams = self.streams
        key = streams.current()[0]
        streams.make_current(self._side_key)
        try:
            future.set_result(result)
        finally:
            streams.make_current(key)
        return future
