"""The ``nccl`` backend: NCCL through CuPy's bindings (``cupy.cuda.nccl``), on CUDA tensors.

The default on CUDA machines. How it runs:

- Start-up: the CUDA device is set from the local rank (or ``ctx.device``) *before* the
  NCCL communicator is created, because NCCL binds a communicator to the current device.
  Rank 0 creates NCCL's unique id and sends it with an MPI broadcast when an MPI launcher
  started the job (and mpi4py is there), else through the job's torch store.
- Calls: each collective passes ``tensor.data_ptr()`` and the CUDA stream it runs on to
  NCCL, which enqueues the work and returns at once. By default that stream is torch's
  current stream, so a kernel the user queued before the collective is seen by it and
  a kernel queued after sees its result, without any host synchronisation.
  ``SMDDP_NCCL_STREAM=side`` runs collectives on one side stream instead (ordered after
  the current stream with an event), which lets torch's DDP overlap gradient reduction
  with backward, as torch's own NCCL group does.
- Completion: a collective's :class:`Pending` is stream-aware, with the contract of
  torch's NCCL ``Work.wait()``: once ``test()`` returns True, every kernel the caller
  queues afterwards on its current stream runs after the collective. ``test()`` returns
  True at once; if the caller's current stream is not the one the collective ran on, it
  first makes that stream wait on the collective's CUDA event, and so does every later
  wait on the handle (the caller may wait from another stream). The host does not block
  (``query()`` and ``synchronize()`` on the Pending are there for code that must).
  ``barrier()`` does block the host until every rank arrived, as torch's NCCL barrier does.
- Deadlines: every operation is watched, from before its NCCL call until the CUDA event
  recorded after it completes, by the communicator's watchdog thread
  (:mod:`smddp.comm.backends.nccl_watch`), against the job's timeout (``SMDDP_TIMEOUT``,
  ``init_process_group(timeout=...)``). When one passes, the engine's stall report names
  the ranks that never arrived, the communicator is aborted (``ncclCommAbort``: stalled
  kernels and calls end) and the next call or wait raises
  :class:`~smddp.errors.CollectiveTimeout`. An asynchronous NCCL error (a peer died) takes
  the same path and raises :class:`~smddp.errors.CollectiveError`.
- Teardown: a last barrier under the same deadline, then ``destroy()``; a communicator
  that failed, or whose barrier does not complete, is aborted, so no rank hangs in teardown.
"""

from __future__ import annotations

import math
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from smddp import knobs
from smddp.comm.backends.devices import check_device, pick_device, with_cpu_companion
from smddp.comm.backends.nccl_cupy import NCCL_2_10, load_nccl, nccl_dtypes, nccl_ops
from smddp.comm.backends.nccl_uid import next_generation, share_unique_id
from smddp.comm.backends.nccl_watch import Watchdog, Watched
from smddp.comm.base import Communicator, Context, Op, Pending, average
from smddp.comm.engine.handle import poll
from smddp.errors import BackendUnavailableError, CollectiveError, CollectiveTimeout, InvalidArgumentError

__all__ = ["NCCL_2_10", "NCCLCommunicator", "all_to_all_plan", "load_nccl", "nccl_dtypes", "nccl_ops",
           "share_unique_id", "stream_mode"]

#: Environment variable choosing the stream collectives run on: ``current`` or ``side``.
STREAM_ENV = "SMDDP_NCCL_STREAM"


# ---------------------------------------------------------------------------- all_to_all plan
def all_to_all_plan(
    rank: int, size: int, output_counts: Sequence[int], input_counts: Sequence[int]
) -> Tuple[List[Tuple[str, int, int, int]], Optional[Tuple[int, int, int]]]:
    """The point-to-point calls of one ``all_to_all_single``, with offsets in elements.

    Args:
        rank: this rank.
        size: the world size.
        output_counts: elements to receive from each rank.
        input_counts: elements to send to each rank.

    Returns:
        ``(calls, own)``: ``calls`` is a list of ``("send" | "recv", peer, offset, count)``
        for every other peer with a non-zero count; ``own`` is ``(output_offset,
        input_offset, count)`` for this rank's own slice, or None when it is empty.

    Raises:
        InvalidArgumentError: the counts are not one per rank, or this rank's own send and
            receive counts differ.
    """
    if len(output_counts) != size or len(input_counts) != size:
        raise InvalidArgumentError(
            f"all_to_all_single: need {size} counts each way, got {len(input_counts)} and {len(output_counts)}"
        )
    if output_counts[rank] != input_counts[rank]:
        raise InvalidArgumentError(
            f"all_to_all_single: rank {rank} sends {input_counts[rank]} elements to itself but expects "
            f"{output_counts[rank]}"
        )
    calls: List[Tuple[str, int, int, int]] = []
    own = None
    in_offset = out_offset = 0
    for peer in range(size):
        send, recv = int(input_counts[peer]), int(output_counts[peer])
        if peer == rank:
            if send:
                own = (out_offset, in_offset, send)
        else:
            if send:
                calls.append(("send", peer, in_offset, send))
            if recv:
                calls.append(("recv", peer, out_offset, recv))
        in_offset += send
        out_offset += recv
    return calls, own


def stream_mode(env=None) -> str:
    """``"current"`` (default) or ``"side"``, from ``SMDDP_NCCL_STREAM``.

    Raises:
        InvalidArgumentError: another value.
    """
    value = knobs.value(STREAM_ENV, env).lower()
    if value not in ("current", "side"):
        raise InvalidArgumentError(f"{STREAM_ENV}={value!r}: use 'current' (default) or 'side'")
    return value


# ---------------------------------------------------------------------------- completion
class StreamOrdered(Pending):
    """An operation enqueued on a CUDA stream: done for every kernel queued after it.

    Attributes:
        event: the CUDA event recorded right after the operation.
    """

    __slots__ = ("_owner", "_stream", "event")

    def __init__(self, owner: NCCLCommunicator, stream, event):
        self._owner, self._stream, self.event = owner, stream, event

    def test(self) -> bool:
        # No stream is ordered here: the engine's progress thread tests too, and ordering its
        # stream would serialise the caller's work behind the collective. Waits order.
        self._owner.check()
        return True

    def waited(self) -> None:
        self._owner._live()  # raises the communicator's failure, if any
        self.order_current_stream()

    def queue_after(self, action) -> bool:
        with torch.cuda.stream(self._stream):
            action()
        self.event.record(self._stream)  # waits (and the watchdog) now cover the action too
        return True

    def order_current_stream(self) -> None:
        """Make the caller's current stream wait for the operation, if it ran on another one.

        The host does not wait.
        """
        current = torch.cuda.current_stream(self._stream.device)
        if current.cuda_stream != self._stream.cuda_stream:
            current.wait_event(self.event)

    def query(self) -> bool:
        """True once the GPU has finished the operation (the host does not wait).

        Raises:
            CollectiveTimeout: the communicator's watchdog gave up on an operation.
            CollectiveError: NCCL reported an error.
        """
        self._owner.check()
        return self.event.query()

    def synchronize(self) -> None:
        """Block the host until the GPU has finished the operation, within its deadline.

        Raises:
            CollectiveTimeout: it (or an operation before it) did not complete in time.
            CollectiveError: NCCL reported an error.
        """
        # No deadline of its own: the watchdog ends a stalled operation, and query() raises.
        poll(self.query, math.inf)


class HostPolled(StreamOrdered):
    """An operation whose ``test()`` is True only once the GPU finished it (barrier)."""

    __slots__ = ()

    def test(self) -> bool:
        return self.query()


# ---------------------------------------------------------------------------- communicator
class NCCLCommunicator(Communicator):
    """Collectives on CUDA tensors through NCCL, called with CuPy's bindings.

    Attributes:
        device: this rank's CUDA device.
        nccl_version: NCCL's runtime version code (``22703`` is 2.27.3).
        stream_mode: ``"current"`` or ``"side"`` (see ``SMDDP_NCCL_STREAM``).
    """

    name = "nccl"
    device_types = ("cuda",)

    @classmethod
    def build(cls, ctx: Context) -> Dict[str, Communicator]:
        """This communicator for CUDA tensors and a CPU communicator (mpi, gloo or local) for CPU ones."""
        return with_cpu_companion("cuda", cls, ctx)

    def __init__(self, ctx: Context, unique_id_key: Optional[str] = None):
        """Set this rank's CUDA device and join the job's NCCL communicator.

        ``unique_id_key``: the store key of the unique id (subgroups; see :func:`share_unique_id`).

        Raises:
            BackendUnavailableError: no CUDA device, CuPy or NCCL missing (the message says
                what to install), or no way to share the unique id.
        """
        super().__init__(ctx)
        if not torch.cuda.is_available():
            raise BackendUnavailableError(
                f"the 'nccl' backend needs a CUDA GPU and torch {torch.__version__} sees none "
                f"(CUDA build: {torch.version.cuda or 'no'}); use 'gloo' or 'mpi' for CPU tensors"
            )
        self.stream_mode = stream_mode()
        self._nccl = load_nccl()
        self.device = pick_device(ctx, "cuda")
        torch.cuda.set_device(self.device)
        _use_cupy_device(self.device.index)
        self.nccl_version = int(self._nccl.get_version())
        self._dtype_codes = nccl_dtypes(self._nccl)
        self._op_codes = nccl_ops(self._nccl, self.nccl_version)
        if self.nccl_version < NCCL_2_10:
            self.dtypes = frozenset(self.dtypes - {torch.bfloat16})
        uid = share_unique_id(self._nccl, ctx.topology, ctx.store, next_generation(), key=unique_id_key)
        self._comm: Any = self._nccl.NcclCommunicator(self.size, uid, self.rank)
        # The first failure (a deadline passed, an NCCL error): raised by every later call and wait.
        self._error: Optional[BaseException] = None
        self._abort_lock = threading.Lock()
        self._watch = Watchdog(ctx.timeout.total_seconds(), self._expired, self._poll_async_error,
                               name=f"smddp-nccl-watchdog-{self.rank}")
        self._barrier_buf = torch.zeros(1, dtype=torch.float32, device=self.device)
        self._side = torch.cuda.Stream(self.device) if self.stream_mode == "side" else None

    # ------------------------------------------------------------------ failures
    def _live(self):
        if self._error is not None:
            raise self._error
        comm = self._comm
        if comm is None:
            raise CollectiveError("the NCCL communicator was closed")
        return comm

    def check(self) -> None:
        """Raise the communicator's failure, if any: a deadline that passed or NCCL's asynchronous error.

        Raises:
            CollectiveTimeout: an operation did not complete within the timeout (the
                communicator was aborted).
            CollectiveError: NCCL reported an error (a peer died, a network failure); the
                communicator was aborted.
        """
        comm = self._live()
        try:
            comm.check_async_error()
        except Exception as exc:  # noqa: BLE001 - CuPy's NcclError
            raise self._failed(exc, "an operation in flight") from exc

    def _record(self, error: BaseException) -> BaseException:
        """Make ``error`` the communicator's failure unless it has one; return the one it has."""
        with self._abort_lock:
            if self._error is None:
                self._error = error
            return self._error

    def _failed(self, exc: BaseException, what: str) -> BaseException:
        """The error ``exc`` (from NCCL) is this communicator's failure: record it once, abort."""
        error = self._record(CollectiveError(
            f"NCCL reported an error on rank {self.rank} ({self.device}) in {what}: {exc}. The NCCL "
            f"communicator was aborted; set NCCL_DEBUG=WARN to see NCCL's own report"))
        self.abort()
        return error

    def _poll_async_error(self) -> None:
        comm = self._comm
        if comm is not None:
            comm.check_async_error()

    def _expired(self, watched: Watched, error: Optional[BaseException]) -> None:
        """The watchdog gave up on ``watched``: record why, then abort (the one abort path)."""
        if error is not None:
            self._failed(error, f"{watched.op_name} (sequence number {watched.seq})")
            return
        if self._error is None:  # the engine's report asks the other ranks: not under the lock
            hook = self.on_timeout
            self._record(hook(watched.seq, watched.op_name) if hook is not None else CollectiveTimeout(
                f"{watched.op_name} (sequence number {watched.seq}) did not complete within "
                f"{self._watch.timeout:g} s on rank {self.rank} of {self.size}; the NCCL communicator "
                f"was aborted"))
        self.abort()

    # ------------------------------------------------------------------ plumbing
    def _stream(self, *tensors: torch.Tensor):
        """The stream to enqueue on, ordered after everything queued on the current stream."""
        current = torch.cuda.current_stream(self.device)
        if self._side is None:
            return current
        self._side.wait_stream(current)
        for tensor in tensors:
            # the caching allocator must not reuse these until the side stream is done
            tensor.record_stream(self._side)
        return self._side

    def _enqueue(self, seq: int, op_name: str, stream, call: Callable[[Any], None],
                 pending: type = StreamOrdered) -> StreamOrdered:
        """Run ``call(comm)``, which enqueues an operation on ``stream``, under the operation's deadline."""
        comm = self._live()
        watched = self._watch.start(seq, op_name)
        try:
            call(comm)
        except Exception as exc:  # noqa: BLE001 - CuPy's NcclError, or the call an abort ended
            raise self._failed(exc, f"{op_name} (sequence number {seq})") from exc
        event = torch.cuda.Event()
        event.record(stream)
        watched.event = event
        return pending(self, stream, event)

    def _dtype(self, tensor: torch.Tensor) -> int:
        check_device(tensor, self.device, self.name)
        return self._dtype_codes[tensor.dtype]

    def _reduce_code(self, op: Op) -> Tuple[int, bool]:
        """NCCL's code for ``op``, and whether AVERAGE must divide the sum afterwards (NCCL < 2.10)."""
        code = self._op_codes[op]
        return (self._op_codes[Op.SUM], True) if code is None else (code, False)

    # ------------------------------------------------------------------ collectives
    def all_reduce(self, tensor: torch.Tensor, op: Op, tag: int) -> Pending:
        dtype = self._dtype(tensor)
        code, divide = self._reduce_code(op)
        stream = self._stream(tensor)

        def call(comm) -> None:
            if tensor.numel():
                ptr = tensor.data_ptr()
                comm.allReduce(ptr, ptr, tensor.numel(), dtype, code, stream.cuda_stream)
                if divide:
                    with torch.cuda.stream(stream):
                        average(tensor, self.size)

        return self._enqueue(tag, "all_reduce", stream, call)

    def broadcast(self, tensor: torch.Tensor, src: int, tag: int) -> Pending:
        dtype = self._dtype(tensor)
        stream = self._stream(tensor)

        def call(comm) -> None:
            if tensor.numel():
                ptr = tensor.data_ptr()
                comm.broadcast(ptr, ptr, tensor.numel(), dtype, src, stream.cuda_stream)

        return self._enqueue(tag, "broadcast", stream, call)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, tag: int) -> Pending:
        dtype = self._dtype(input)
        self._dtype(output)
        stream = self._stream(output, input)

        def call(comm) -> None:
            if input.numel():
                comm.allGather(input.data_ptr(), output.data_ptr(), input.numel(), dtype, stream.cuda_stream)

        return self._enqueue(tag, "all_gather", stream, call)

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_counts: Sequence[int],
        input_counts: Sequence[int],
        tag: int,
    ) -> Pending:
        dtype = self._dtype(input)
        self._dtype(output)
        calls, own = all_to_all_plan(self.rank, self.size, output_counts, input_counts)
        stream = self._stream(output, input)

        def call(comm) -> None:
            if own is not None:
                out_offset, in_offset, count = own
                with torch.cuda.stream(stream):
                    output[out_offset:out_offset + count].copy_(input[in_offset:in_offset + count])
            if not calls:
                return
            itemsize = input.element_size()
            send_base, recv_base, handle = input.data_ptr(), output.data_ptr(), stream.cuda_stream
            self._nccl.groupStart()
            try:
                for kind, peer, offset, count in calls:
                    if kind == "send":
                        comm.send(send_base + offset * itemsize, count, dtype, peer, handle)
                    else:
                        comm.recv(recv_base + offset * itemsize, count, dtype, peer, handle)
            finally:
                self._nccl.groupEnd()

        return self._enqueue(tag, "all_to_all_single", stream, call)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: Op, tag: int) -> Pending:
        # NCCL reduces half precision in the dtype, as torch's NCCL group does (moving float32
        # copies would double the bytes on the wire): the one exception to comm.base.HALF.
        dtype = self._dtype(input)
        self._dtype(output)
        code, divide = self._reduce_code(op)
        stream = self._stream(output, input)

        def call(comm) -> None:
            if output.numel():
                comm.reduceScatter(input.data_ptr(), output.data_ptr(), output.numel(), dtype, code,
                                   stream.cuda_stream)
                if divide:
                    with torch.cuda.stream(stream):
                        average(output, self.size)

        return self._enqueue(tag, "reduce_scatter", stream, call)

    def barrier(self, tag: int) -> Pending:
        # The host waits here, as for torch's NCCL barrier: a one-element all_reduce after
        # everything queued so far, on the current stream and (side mode) the side stream.
        stream = self._stream()
        return self._enqueue(tag, "barrier", stream, lambda comm: self._sum_one(comm, stream), HostPolled)

    def _sum_one(self, comm, stream) -> None:
        ptr = self._barrier_buf.data_ptr()
        comm.allReduce(ptr, ptr, 1, self._dtype_codes[torch.float32], self._op_codes[Op.SUM], stream.cuda_stream)

    # ------------------------------------------------------------------ teardown
    def abort(self) -> None:
        """Abort the NCCL communicator at once (``ncclCommAbort``): operations in flight end.

        Every failure ends here: a deadline that passed, an NCCL error, a teardown that
        could not complete. Later calls raise the failure, or say the communicator was closed.
        """
        self._watch.stop()
        with self._abort_lock:
            comm, self._comm = self._comm, None
        if comm is not None:
            comm.abort()

    def close(self) -> None:
        """Wait for every rank (a last barrier, within the job's timeout), then destroy.

        A communicator that failed, or whose operations (the barrier included) do not
        complete in time, is aborted instead, so teardown never hangs.
        """
        if self._comm is None:
            self._watch.stop()
            return
        self.on_timeout = None  # the job's stall report has closed already
        try:
            stream = self._stream()
            self._enqueue(0, "barrier (destroy_process_group)", stream, lambda comm: self._sum_one(comm, stream))
            clean = self._watch.drain() and self._error is None
        except CollectiveError:
            clean = False
        if not clean:
            self.abort()
            return
        self._watch.stop()
        with self._abort_lock:
            comm, self._comm = self._comm, None
        if comm is not None:
            comm.destroy()


def _use_cupy_device(index: int) -> None:
    """Make ``index`` CuPy's current device too (CuPy may carry its own CUDA runtime)."""
    try:
        from cupy.cuda import runtime
    except ImportError:
        return
    runtime.setDevice(index)
