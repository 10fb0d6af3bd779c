"""The ``nccl`` backend: NCCL through CuPy's bindings (``cupy.cuda.nccl``), on CUDA tensors.

The opt-in on CUDA (``SMDDP_BACKEND=nccl``; the default is torch's own NCCL group, ``torch-nccl``).
It does what torch's ProcessGroupNCCL does:

- Device: ``init_process_group(device_id=...)``, else the current device the process set,
  else the local rank (:func:`~smddp.comm.backends.devices.pick_device`); a tensor on another
  device is refused before anything is sent.
- Communicator: none at ``init_process_group``. The group's first collective makes it
  (:mod:`smddp.comm.backends.nccl.lane`): the unique id goes through the group's own store,
  ``ncclCommInitRank`` runs on a thread that sets the device, and both are held to the
  group's timeout. A first collective inside a CUDA graph capture is refused (run one before
  capturing): neither can be captured.
- Streams: by default (``SMDDP_NCCL_STREAM=side``) each group has a stream of its own, which
  waits for the caller's current stream by an event before each collective, so DDP's
  bucket all-reduces overlap backward. ``current`` enqueues on the caller's current stream.
- Memory: every tensor a collective's stream reads or writes (its buffers, the steps queued
  after it such as copies back into a non-contiguous tensor or a list) is held until the
  CUDA event recorded after it completes (:mod:`smddp.comm.backends.nccl.watchdog`), or on the
  direct path until ``wait()`` orders the caller's stream after it (torch's unstash), so the
  caching allocator never reuses memory NCCL still uses. Events come from the watchdog's pool.
- Completion: a collective's :class:`Pending` is stream-ordered, with the contract of torch's
  NCCL ``Work.wait()``: ``test()`` is True at once and every wait makes the waiting thread's
  current stream wait on the collective's event; the host does not block (``query()`` and
  ``synchronize()`` are there for code that must). ``barrier()`` blocks the host until every
  rank arrived, as torch's NCCL barrier does.
- dtypes: those NCCL has, plus bool, complex and float8 as torch's NCCL group sends them
  (:func:`~smddp.comm.backends.nccl.bindings.on_the_wire`); int16 is refused, as there.
- Deadlines: a watchdog thread holds every operation, from before its NCCL call, to the group's
  timeout. A deadline that passes or NCCL's asynchronous error is handled as
  ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` would (:mod:`smddp.comm.backends.nccl.failures`; by default the
  process ends); an error NCCL returns from a call is raised at the call, as torch raises it.
- Point-to-point (``send``, ``recv``) is refused: on torch's NCCL group it would run on a second
  NCCL communicator beside this one (see :meth:`NCCLCommunicator.send`).
- Teardown: a last barrier under the same deadline, then ``destroy()``; a communicator that
  failed, or whose barrier does not complete, is aborted (never longer than the abort's grace).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from smddp import _compat, knobs
from smddp.comm.backends.devices import check_device, pick_device, with_cpu_companion
from smddp.comm.backends.nccl import failures
from smddp.comm.backends.nccl.bindings import CONVERTED, NCCL_2_10, load_nccl, nccl_dtypes, nccl_ops, on_the_wire
from smddp.comm.backends.nccl.direct import DirectPath
from smddp.comm.backends.nccl.lane import CreationTimeout, Lane, open_lane
from smddp.comm.backends.nccl.pending import Captured, HostPolled, StreamOrdered
from smddp.comm.backends.nccl.unique_id import UniqueIdTimeout, share_unique_id, unique_id_key
from smddp.comm.backends.nccl.watchdog import EVENT, HELD, OP_NAME, SEQ, Watchdog, Watched
from smddp.comm.base import Communicator, Context, Pending
from smddp.comm.reduction import Op, average
from smddp.errors import BackendUnavailableError, CollectiveError, CollectiveTimeout, InvalidArgumentError

__all__ = ["NCCL_2_10", "NCCLCommunicator", "all_to_all_plan", "cuda_index", "load_nccl", "nccl_dtypes",
           "nccl_ops", "share_unique_id", "stream_mode"]

#: Environment variable choosing the stream collectives run on: ``side`` or ``current``.
STREAM_ENV = "SMDDP_NCCL_STREAM"


def cuda_index(device: torch.device) -> int:
    """The CUDA index of the group's device (the seam the host-memory stand-in replaces)."""
    return device.index


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
    """``"side"`` (default: the group's own stream, as torch's) or ``"current"``, from ``SMDDP_NCCL_STREAM``.

    Raises:
        InvalidArgumentError: another value.
    """
    value = knobs.value(STREAM_ENV, env).lower()
    if value not in ("current", "side"):
        raise InvalidArgumentError(f"{STREAM_ENV}={value!r}: use 'side' (default) or 'current'")
    return value


# ---------------------------------------------------------------------------- communicator
class NCCLCommunicator(Communicator):
    """Collectives on CUDA tensors through NCCL, called with CuPy's bindings.

    Attributes:
        nccl_version: NCCL's runtime version code (``22703`` is 2.27.3).
        stream_mode: ``"side"`` or ``"current"`` (see ``SMDDP_NCCL_STREAM``).
        error_handling: what a failure does (``SMDDP_NCCL_ASYNC_ERROR_HANDLING``, 0 to 3).
    """

    name = "nccl"
    device_types = ("cuda",)
    dtypes = Communicator.dtypes | CONVERTED

    @classmethod
    def build(cls, ctx: Context) -> Dict[str, Communicator]:
        """This communicator for CUDA tensors and a CPU communicator (mpi, gloo or local) for CPU ones."""
        return with_cpu_companion("cuda", cls, ctx)

    def __init__(self, ctx: Context):
        """Check that NCCL can run here; the NCCL communicator is made by the first collective.

        Raises:
            BackendUnavailableError: no CUDA device, CuPy or NCCL missing (the message says
                what to install).
            InvalidArgumentError: ``ctx.device`` (``device_id``) is not a CUDA device here, or
                a knob has a value it does not take.
        """
        super().__init__(ctx)
        if not torch.cuda.is_available():
            raise BackendUnavailableError(
                f"the 'nccl' backend needs a CUDA GPU and torch {torch.__version__} sees none "
                f"(CUDA build: {torch.version.cuda or 'no'}); use 'gloo' or 'mpi' for CPU tensors"
            )
        self.stream_mode = stream_mode()
        self.error_handling = failures.error_handling()
        self.nccl = load_nccl()
        self.nccl_version = int(self.nccl.get_version())
        self.dtype_codes = nccl_dtypes(self.nccl)
        self.op_codes = nccl_ops(self.nccl, self.nccl_version)
        if self.nccl_version < NCCL_2_10:
            self.dtypes = frozenset(self.dtypes - {torch.bfloat16})
        self._ctx = ctx
        #: ``device_id``, as given (subgroups inherit it); ``_bound``: the device it names here.
        self.device_id = ctx.device
        self._bound = pick_device(ctx, "cuda") if ctx.device is not None else None  # checks device_id now
        self._lane: Optional[Lane] = None
        self._open_lock = threading.Lock()
        #: The first failure (a deadline passed, an NCCL error), or None: raised by every later call and wait.
        self.failure: Optional[BaseException] = None
        self._error_lock = threading.Lock()
        self._closing = False
        self.watch = Watchdog(ctx.timeout.total_seconds(), self._expired, self._poll_async_error,
                               name=f"smddp-nccl-watchdog-{self.rank}")

    @property
    def device(self) -> torch.device:
        """This rank's CUDA device for the group: the communicator's once made, else the one it would take."""
        lane = self._lane
        if lane is not None:
            return lane.device
        return self._bound if self._bound is not None else pick_device(self._ctx, "cuda")

    def subgroup(self, ranks: Sequence[int], ctx: Context) -> NCCLCommunicator:
        """An NCCL communicator over the group of global ``ranks`` (its own id, in its own store)."""
        device = ctx.device if ctx.device is not None else self.device_id
        return type(self)(dataclasses.replace(ctx, device=device))

    # ------------------------------------------------------------------ the communicator, at first use
    def _lane_for(self, seq: int, op_name: str, tensor: Optional[torch.Tensor] = None) -> Lane:
        lane = self._lane
        if lane is None:
            return self._open(seq, op_name, tensor)
        if tensor is not None and tensor.device != lane.device:
            check_device(tensor, lane.device, self.name)
        return lane

    def _open(self, seq: int, op_name: str, tensor: Optional[torch.Tensor]) -> Lane:
        """Make the group's NCCL communicator (every rank's first collective of the group does).

        Raises:
            CollectiveError: called during a CUDA graph capture (before anything is sent), or the
                communicator could not be made.
        """
        with self._open_lock:
            if self._lane is not None:
                return self._lane_for(seq, op_name, tensor)
            self.raise_failure()
            if torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing():  # no CUDA, no capture
                raise CollectiveError(
                    f"{op_name} is this group's first NCCL collective on rank {self.rank}, and it was called "
                    f"during a CUDA graph capture: the group's NCCL communicator would be created inside the "
                    f"capture (its unique id goes through the store and ncclCommInitRank cannot be captured). "
                    f"Run one collective on the group before capturing (a warm-up step, as for torch's NCCL "
                    f"group), then capture")
            device = self.device  # device_id, else the current device as set, else the local rank
            if tensor is not None:
                check_device(tensor, device, self.name)  # before anything is sent
            deadline = time.monotonic() + self.watch.timeout
            try:
                uid = share_unique_id(self.nccl, self._ctx.topology, self._ctx.store, key=unique_id_key(),
                                      deadline=deadline)
                lane = open_lane(self.nccl, self.size, self.rank, uid, device, cuda_index(device), deadline,
                                 self.stream_mode == "side")
            except (UniqueIdTimeout, CreationTimeout) as exc:
                raise self.give_up(seq, f"{op_name} (creating the NCCL communicator)") from exc
            except CollectiveError as exc:
                raise self._record(exc) from exc.__cause__
            except Exception as exc:  # noqa: BLE001 - the store failed: say so, as a collective's failure
                raise self._record(CollectiveError(
                    f"{op_name}: sharing NCCL's unique id through the group's store failed on rank {self.rank}: "
                    f"{exc}")) from exc
            self.watch.device = lane.index
            self.direct = DirectPath(self, lane)
            self._lane = lane
            return lane

    # ------------------------------------------------------------------ failures
    def raise_failure(self) -> None:
        """Raise the communicator's failure, if it has one."""
        if self.failure is not None:
            raise self.failure

    def refusal(self) -> BaseException:
        return self.failure or CollectiveError("the NCCL communicator was closed")

    def check(self) -> None:
        """Raise the communicator's failure, if any: a deadline that passed or NCCL's asynchronous error.

        Raises:
            CollectiveTimeout: an operation did not complete within the timeout.
            CollectiveError: NCCL reported an error (a peer died, a network failure).
        """
        self.raise_failure()
        lane = self._lane
        if lane is None:
            return
        failure = None
        with lane.calling(self.refusal) as comm:
            try:
                comm.check_async_error()
            except Exception as exc:  # noqa: BLE001 - CuPy's NcclError
                failure = exc
        if failure is not None:
            raise self.give_up(None, "an operation in flight", failure) from failure

    def _record(self, error: BaseException) -> BaseException:
        """Make ``error`` the communicator's failure unless it has one; return the one it has."""
        with self._error_lock:
            if self.failure is None:
                self.failure = error
            return self.failure

    def give_up(self, seq: Optional[int], op_name: str, nccl_error: Optional[BaseException] = None) -> BaseException:
        """Operation ``seq`` failed (NCCL's error) or passed its deadline (None): record why, then act
        as the error-handling mode says (abort, end the process, or neither). Returns the failure."""
        if nccl_error is not None:
            where = op_name if seq is None else f"{op_name} (sequence number {seq})"
            error = CollectiveError(
                f"NCCL reported an error on rank {self.rank} ({self.device}) in {where}: {nccl_error}. Set "
                f"NCCL_DEBUG=WARN to see NCCL's own report")
        elif self.failure is None:  # the engine's report asks the other ranks: not under a lock
            hook = None if self._closing else self.on_timeout
            error = hook(seq, op_name) if hook is not None else CollectiveTimeout(
                f"{op_name} (sequence number {seq}) did not complete within {self.watch.timeout:g} s on rank "
                f"{self.rank} of {self.size}")
        else:
            error = self.failure
        error = self._record(error)
        mode = failures.CLEAN_UP_ONLY if self._closing else self.error_handling
        if failures.aborts(mode):
            self.abort()
        else:
            self.watch.stop()
        if failures.ends_process(mode):
            failures.end_process(error, self.rank, mode)
        return error

    def _poll_async_error(self) -> None:
        lane = self._lane
        if lane is not None:
            with lane.calling(self.refusal) as comm:
                comm.check_async_error()

    def _expired(self, watched: Watched, error: Optional[BaseException]) -> None:
        """The watchdog gave up on ``watched`` (its deadline, or NCCL's ``error``)."""
        self.give_up(watched[SEQ], watched[OP_NAME], error)

    # ------------------------------------------------------------------ plumbing
    def _enqueue(self, lane: Lane, seq: int, op_name: str, stream, call: Callable[[Any, Any], None],
                 held: tuple, pending: type = StreamOrdered) -> Pending:
        """Run ``call(comm, stream)``, which enqueues an operation on ``stream``, under its deadline.

        During a CUDA graph capture (``stream`` is then the capturing one: :meth:`Lane.stream`)
        the operation is captured, not watched: what it returns completes on the host at once.
        """
        capturing = lane.streams.capturing()
        if capturing and pending is HostPolled:
            raise InvalidArgumentError(
                f"{op_name} cannot be captured in a CUDA graph: it blocks the host until every rank "
                f"arrived (as torch's NCCL barrier does); call it before or after the capture")
        direct = self.direct
        if direct is not None and direct.coalescing():
            direct.flush()  # a coalesced call's collectives on the direct path come first
        failure = refused = event = None
        with lane.calling(self.refusal) as comm:
            watched = None if capturing else self.watch.start(seq, op_name, held, lane.streams.key_of(stream))
            try:
                # NCCL's asynchronous error (a peer died) fails the next call, as it starts: the
                # watchdog polls it between calls, and tests of operations in flight do not.
                comm.check_async_error()
            except Exception as exc:  # noqa: BLE001 - CuPy's NcclError
                failure = exc
            else:
                with torch.cuda.device(lane.index):
                    try:
                        call(comm, stream)
                    except Exception as exc:  # noqa: BLE001 - NCCL refused the call, or an abort ended it
                        refused = exc
                    if not capturing:  # a captured operation's event would be a node of the graph
                        event = self.watch.event()
                        _compat.record_event(event, stream)
                        watched[EVENT] = event
        if failure is not None:
            raise self.give_up(seq, op_name, failure) from failure
        if refused is not None:
            raise self._refusal_at_call(seq, op_name, refused, watched) from refused
        if capturing:
            return Captured(self, lane, stream, None, None)
        return pending(self, lane, stream, event, watched)

    def _refusal_at_call(self, seq: int, op_name: str, exc: BaseException, watched: Optional[Watched]
                         ) -> BaseException:
        """The error for an operation whose NCCL call raised: the communicator's failure if it has one
        (an abort ended the call, a peer died), else the call's own error, raised at the call as torch's
        NCCL group raises it, with the communicator left as it was (its record is done)."""
        if self.failure is not None:  # as any failure: the error-handling mode acts (an abort finishes)
            return self.give_up(seq, op_name, exc)
        try:
            self.check()
        except CollectiveError as failure:
            return failure
        if watched is not None:
            watched[HELD] = ()
        return CollectiveError(
            f"NCCL refused {op_name} (sequence number {seq}) on rank {self.rank} ({self.device}): {exc}. It was "
            f"not enqueued and the NCCL communicator is still usable (the error is raised at the call, as by "
            f"torch's NCCL group); the other ranks may be waiting in this collective. Set NCCL_DEBUG=WARN to "
            f"see NCCL's own report")

    def _reduce_code(self, op: Op) -> Tuple[int, bool]:
        """NCCL's code for ``op``, and whether AVERAGE must divide the sum afterwards (NCCL < 2.10)."""
        code = self.op_codes[op]
        return (self.op_codes[Op.SUM], True) if code is None else (code, False)

    # ------------------------------------------------------------------ collectives
    def all_reduce(self, tensor: torch.Tensor, op: Op, tag: int) -> Pending:
        wire, op = on_the_wire(tensor, op, "all_reduce")
        dtype = self.dtype_codes[wire.dtype]
        code, divide = self._reduce_code(op)
        lane = self._lane_for(tag, "all_reduce", tensor)
        stream = lane.stream()

        def call(comm, stream) -> None:
            if wire.numel():
                ptr = wire.data_ptr()
                comm.allReduce(ptr, ptr, wire.numel(), dtype, code, stream.cuda_stream)
                if divide:
                    with torch.cuda.stream(stream):
                        average(wire, self.size)

        return self._enqueue(lane, tag, "all_reduce", stream, call, (tensor,))

    def broadcast(self, tensor: torch.Tensor, src: int, tag: int) -> Pending:
        wire, _ = on_the_wire(tensor, None, "broadcast")
        dtype = self.dtype_codes[wire.dtype]
        lane = self._lane_for(tag, "broadcast", tensor)
        stream = lane.stream()

        def call(comm, stream) -> None:
            if wire.numel():
                ptr = wire.data_ptr()
                comm.broadcast(ptr, ptr, wire.numel(), dtype, src, stream.cuda_stream)

        return self._enqueue(lane, tag, "broadcast", stream, call, (tensor,))

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, tag: int) -> Pending:
        wire_in, _ = on_the_wire(input, None, "all_gather")
        wire_out, _ = on_the_wire(output, None, "all_gather")
        dtype = self.dtype_codes[wire_in.dtype]
        lane = self._lane_for(tag, "all_gather", input)
        stream = lane.stream()

        def call(comm, stream) -> None:
            if wire_in.numel():
                comm.allGather(wire_in.data_ptr(), wire_out.data_ptr(), wire_in.numel(), dtype, stream.cuda_stream)

        return self._enqueue(lane, tag, "all_gather", stream, call, (output, input))

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_counts: Sequence[int],
        input_counts: Sequence[int],
        tag: int,
    ) -> Pending:
        wire_in, _ = on_the_wire(input, None, "all_to_all_single")
        wire_out, _ = on_the_wire(output, None, "all_to_all_single")
        dtype = self.dtype_codes[wire_in.dtype]
        calls, own = all_to_all_plan(self.rank, self.size, output_counts, input_counts)
        lane = self._lane_for(tag, "all_to_all_single", input)
        stream = lane.stream()
        per = wire_in.numel() // input.numel() if input.numel() else 1  # 2 for complex (real view)

        def call(comm, stream) -> None:
            if own is not None:
                out_offset, in_offset, count = own
                with torch.cuda.stream(stream):
                    output[out_offset:out_offset + count].copy_(input[in_offset:in_offset + count])
            if not calls:
                return
            itemsize = wire_in.element_size() * per
            send_base, recv_base, handle = wire_in.data_ptr(), wire_out.data_ptr(), stream.cuda_stream
            self.nccl.groupStart()
            try:
                for kind, peer, offset, count in calls:
                    if kind == "send":
                        comm.send(send_base + offset * itemsize, count * per, dtype, peer, handle)
                    else:
                        comm.recv(recv_base + offset * itemsize, count * per, dtype, peer, handle)
            finally:
                self.nccl.groupEnd()

        return self._enqueue(lane, tag, "all_to_all_single", stream, call, (output, input))

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: Op, tag: int) -> Pending:
        # NCCL reduces half precision in the dtype, as torch's NCCL group does (moving float32
        # copies would double the bytes on the wire): the one exception to comm.reduction.HALF.
        wire_in, wire_op = on_the_wire(input, op, "reduce_scatter")
        wire_out, _ = on_the_wire(output, op, "reduce_scatter")
        dtype = self.dtype_codes[wire_in.dtype]
        code, divide = self._reduce_code(wire_op)
        lane = self._lane_for(tag, "reduce_scatter", input)
        stream = lane.stream()

        def call(comm, stream) -> None:
            if wire_out.numel():
                comm.reduceScatter(wire_in.data_ptr(), wire_out.data_ptr(), wire_out.numel(), dtype, code,
                                   stream.cuda_stream)
                if divide:
                    with torch.cuda.stream(stream):
                        average(wire_out, self.size)

        return self._enqueue(lane, tag, "reduce_scatter", stream, call, (output, input))

    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> Pending:
        """Refused: the ``nccl`` backend has no point-to-point messages.

        torch's NCCL group would carry them (the group's torch-native backend) on NCCL communicators
        of its own, beside this one, from another copy of NCCL: kernels of two communicators on one
        GPU that wait on each other across ranks can hang a pipeline. One communicator would not do
        either: a ``send`` and a ``recv`` that torch's ``batch_isend_irecv`` hands a Python group one
        by one, launched one by one on one stream, wait on each other around a ring, where torch's
        NCCL group gives each pair of ranks its own communicator and stream.

        Raises:
            CollectiveError: always, saying what to use instead (not ``BackendUnavailableError``,
                which would send the message to torch's group).
        """
        raise self._no_point_to_point("send", tensor)

    def recv(self, tensor: torch.Tensor, src: Optional[int], tag: int) -> Pending:
        """Refused, as :meth:`send`.

        Raises:
            CollectiveError: always.
        """
        raise self._no_point_to_point("recv", tensor)

    def _no_point_to_point(self, what: str, tensor: torch.Tensor) -> CollectiveError:
        return CollectiveError(
            f"{what}: the 'nccl' backend (CuPy's NCCL) has no point-to-point messages, and does not hand them "
            f"to torch's NCCL group either: that would run a second NCCL communicator on {tensor.device} beside "
            f"this one, whose kernels can wait on each other across ranks and hang a pipeline. Use the default "
            f"CUDA backend (SMDDP_BACKEND unset: torch's NCCL group, whose collectives and point-to-point share "
            f"one NCCL), or send CPU tensors")

    def barrier(self, tag: int) -> Pending:
        # The host waits here, as for torch's NCCL barrier: a one-element all_reduce after
        # everything queued so far (on the group's stream, which waits for the current one).
        lane = self._lane_for(tag, "barrier")
        stream = lane.stream()
        return self._enqueue(lane, tag, "barrier", stream, self._sum_one(lane), (), HostPolled)

    def _sum_one(self, lane: Lane) -> Callable[[Any, Any], None]:
        ptr = lane.barrier_buf.data_ptr()
        codes = self.dtype_codes[torch.float32], self.op_codes[Op.SUM]
        return lambda comm, stream: comm.allReduce(ptr, ptr, 1, *codes, stream.cuda_stream)

    # ------------------------------------------------------------------ teardown
    def abort(self) -> None:
        """Abort the NCCL communicator (``ncclCommAbort``): operations in flight end.

        No call starts on it meanwhile. An abort that does not return within
        :data:`~smddp.comm.backends.nccl.failures.ABORT_GRACE` seconds ends the process.
        """
        self.watch.stop()
        lane = self._lane
        comm = lane.take() if lane is not None else None
        if comm is None:
            return
        grace = failures.ABORT_GRACE

        def stuck() -> None:
            failures.end_process(CollectiveError(
                f"ncclCommAbort did not return within {grace:g} s on rank {self.rank} ({self.device}); "
                f"ending the process so that the job does not hang"), self.rank, self.error_handling)

        failures.abort_within(comm, grace, stuck)

    def close(self) -> None:
        """Wait for every rank (a last barrier, within the job's timeout), then destroy.

        A communicator never made has nothing to free. One that failed, or whose operations
        (the barrier included) do not complete in time, is aborted instead.
        """
        lane = self._lane
        if lane is None or lane.comm is None:
            self.watch.stop()
            return
        self.on_timeout = None  # the job's stall report has closed already
        self._closing = True
        try:
            stream = lane.stream()
            self._enqueue(lane, 0, "barrier (destroy_process_group)", stream, self._sum_one(lane), ())
            clean = self.watch.drain() and self.failure is None
        except CollectiveError:
            clean = False
        if not clean:
            self.abort()
            return
        self.watch.stop()
        comm = lane.take()
        if comm is not None:
            comm.destroy()
