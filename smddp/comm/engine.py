"""Runs collectives over communicators: order, checks, handles, timeouts.

Every collective, whether it comes from smddp's own functions or from
``torch.distributed`` through the ``"smddp"`` process group, passes through one
:class:`Engine`. It

- checks arguments that every backend would reject, before any communication;
- numbers each collective (the sequence number names it in errors, and tags point-to-point
  traffic so concurrent operations never mix);
- makes buffers contiguous and copies results back into non-contiguous tensors;
- routes each tensor to the communicator of its device (a CPU communicator serves CPU
  tensors on a GPU job);
- waits with a deadline, so a collective that does not complete raises
  :class:`~smddp.errors.CollectiveTimeout` instead of hanging, after which the job is
  broken and further collectives fail at once;
- progresses asynchronous operations on one background thread, so their futures
  complete while the caller computes (torch's DDP overlaps backward with this);
- owns every asynchronous operation until it completes, and completes a group's
  collectives in issue order: dropping a handle never changes a result.

Thread model (docs/architecture.md has the whole of it): any thread may start a collective
(numbering and starting are one step, under ``_start_lock``); operations in flight are
tested under the engine's lock by the progress thread and by threads that wait; a
synchronous operation with nothing in flight is tested by its caller alone. Threads thus
call the library concurrently: the ``mpi`` backend requires ``MPI_THREAD_MULTIPLE`` and
checks it at init. Callbacks run outside the lock, in the thread that completed the
operation.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence

import torch

from smddp import _excepthook
from smddp.comm import debug as _debug
from smddp.comm import stall as _stall
from smddp.comm.base import DONE, Communicator, Op, Pending, Then
from smddp.errors import (
    BackendUnavailableError,
    CollectiveError,
    CollectiveTimeout,
    InvalidArgumentError,
    InvalidTypeError,
)

# Busy-poll this many times before yielding the CPU while waiting: small collectives
# finish within it, and a stalled peer does not cost a whole core for long.
_HOT_POLLS = 4000
_WARM_POLLS = 40000
# A Pending with ``block(seconds)`` (a library that completes on its own threads, like gloo)
# is slept on in slices of this many seconds instead of polled: polling takes the CPU from
# the very threads doing the work.
_BLOCK_SLICE = 0.5

# How errors name an all-reduce started inside autograd's backward (DDP's gradient buckets).
_BACKWARD_ALL_REDUCE = "all_reduce (during backward: DDP gradients)"


class Handle:
    """A collective in flight: ``wait()`` and ``is_completed()``, like torch's Work.

    The engine holds every handle (and so its Pending and every buffer the Pending keeps)
    until the operation completes: dropping a handle changes nothing.
    """

    __slots__ = ("_engine", "seq", "op_name", "_pending", "_finished", "_done", "_error",
                 "_callbacks", "deadline", "ordered")

    def __init__(self, engine: Engine, seq: int, op_name: str, pending: Pending, ordered: bool = True):
        self._engine = engine
        self.seq = seq
        self.op_name = op_name
        self._pending = pending
        self._finished = False  # the Pending has completed (or failed): guarded by the engine's lock
        self._done = False  # ... and every collective issued before this one is done
        self._error: Optional[BaseException] = None
        self._callbacks: Optional[List[Callable[[Handle], None]]] = []
        self.deadline = time.monotonic() + engine.timeout
        #: Collectives complete in issue order; point-to-point messages (two ranks) do not.
        self.ordered = ordered

    def is_completed(self) -> bool:
        """Make progress; True once the operation has finished (or failed)."""
        if not self._done:
            self._engine._poll()
        return self._done

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Block until the operation (and every collective issued before it) completes.

        Args:
            timeout: seconds to wait at most; default the process group's timeout.

        Returns:
            True.

        Raises:
            CollectiveTimeout: it did not complete in time (the job is then broken).
            CollectiveError: it failed.
        """
        if timeout is not None:
            self.deadline = min(self.deadline, time.monotonic() + timeout)
        block = getattr(self._pending, "block", None)
        polls = 0
        try:
            while not self.is_completed():
                polls += 1
                if block is not None and not self._finished:
                    block(min(_BLOCK_SLICE, max(0.0, self.deadline - time.monotonic())))
                elif polls > _HOT_POLLS:
                    time.sleep(0 if polls < _WARM_POLLS else 0.0005)
        except KeyboardInterrupt:
            self._engine._interrupted(self.seq, self.op_name)
            raise
        if self._error is not None:
            raise self._error
        self._pending.waited()
        return True

    def order_current_stream(self) -> None:
        """Make the calling thread's current CUDA stream wait for a stream-ordered operation.

        Nothing for an operation that completes on the host. The host does not wait.

        Raises:
            CollectiveError: the operation's communicator has failed.
        """
        self._pending.waited()

    def exception(self) -> Optional[BaseException]:
        """The error the operation ended with, if any."""
        return self._error

    def add_done_callback(self, callback: Callable[[Handle], None]) -> None:
        """Call ``callback(handle)`` once the operation has finished, from any thread.

        A callback that raises fails this operation only: the error is reported on stderr
        and :meth:`wait` raises it.
        """
        with self._engine._cv:
            if not self._done and self._callbacks is not None:
                self._callbacks.append(callback)
                return
        self._engine._call_back(self, [callback])

    def _advance(self, now: float) -> None:
        """Test the Pending once; fail it past its deadline. Called under the engine's lock."""
        try:
            if self._pending.test():
                self._finished = True
                return
        except Exception as exc:  # noqa: BLE001 - surfaced by wait()
            self._finish_failed(self._engine._fail(exc, self))
            return
        if now > self.deadline:
            self._finish_failed(self._engine._fail(self._engine._timeout(self.seq, self.op_name), self))

    def _finish_failed(self, error: BaseException) -> None:
        self._error = error
        self._finished = True
        # The library may still hold the buffers' addresses: they live as long as the engine.
        self._engine._abandoned.append(self._pending)


class Engine:
    """The collectives of one job over one communicator per device type.

    Args:
        comms: device type (``"cpu"``, ``"cuda"``, ``"xpu"``) to communicator; the first is
            the job's primary backend.
        timeout: seconds a collective may take before :class:`CollectiveTimeout`.
        store: the job's torch ``Store``; with it, a timed-out rank asks the others where
            they are and names the ones that never arrived (:mod:`smddp.comm.stall`).
    """

    def __init__(self, comms: Dict[str, Communicator], timeout: float, store=None):
        if not comms:
            raise ValueError("an engine needs at least one communicator")
        self.comms = dict(comms)
        for comm in self.comms.values():
            comm.on_timeout = self._stalled  # a communicator that watches its own deadlines (nccl)
        self.primary = next(iter(self.comms.values()))
        self.rank = self.primary.rank
        self.size = self.primary.size
        self.timeout = float(timeout)
        self.seq = 0
        self._broken: Optional[BaseException] = None
        self._closed = False
        # Every asynchronous operation started and not yet done, in issue order. The engine,
        # not the caller's handle, owns them: see _poll. One lock guards them and their
        # handles' state, and lets one thread at a time test Pendings.
        self._inflight: List[Handle] = []
        self._cv = threading.Condition()
        # Pendings that failed or timed out while the library may still hold their buffers.
        self._abandoned: List[Pending] = []
        self._thread: Optional[threading.Thread] = None
        self._start_lock = threading.Lock()
        self._cpu_comm = self.comms.get("cpu")  # tensor.is_cpu is 10x cheaper than tensor.device.type
        # What this rank is doing, for the ranks that time out waiting for it.
        self._last_op = ""  # the name of collective number self.seq
        self._last_start = 0.0  # time.monotonic() when the latest synchronous one started
        self._done_seq = 0  # the latest synchronous collective that completed
        self._last_handle: Optional[Handle] = None  # the latest asynchronous one
        self._end_note: Optional[dict] = None  # set when the script ends
        self._statuses: Optional[dict] = None  # the other ranks' answers, asked once
        self._report_lock = threading.Lock()
        #: SMDDP_DEBUG=1: compares every collective across ranks first; None (no cost) when off.
        self._debug = _debug.Checker(self, self.comms.get("cpu", self.primary)) if _debug.enabled() else None
        self._channel: Optional[_stall.StoreChannel] = None
        if self.size > 1:
            self._channel = self._open_channel(store)
            _excepthook.watch(self)

    # ------------------------------------------------------------------ subgroups
    #: For a subgroup: its name and its members' global ranks (group rank i is global_ranks[i]).
    group_name: str = ""
    global_ranks: Optional[List[int]] = None

    def describe_group(self, name: str, global_ranks: Sequence[int]) -> None:
        """Make this a subgroup's engine: errors name global ranks and the group ``name``."""
        self.group_name, self.global_ranks = name, list(global_ranks)

    def global_rank(self, rank: int) -> int:
        """The global rank of this group's ``rank``."""
        return rank if self.global_ranks is None else self.global_ranks[rank]

    def _who(self) -> str:
        if self.global_ranks is None:
            return f"rank {self.rank} of {self.size}"
        return (f"rank {self.global_rank(self.rank)} (rank {self.rank} of the {self.size} in process group "
                f"{self.group_name!r}, global ranks {_stall.ranks_text(self.global_ranks)})")

    # ------------------------------------------------------------------ state
    @property
    def backend(self) -> str:
        """Name of the primary communicator's backend."""
        return self.primary.name

    def _check_usable(self) -> None:
        if self._closed:
            raise CollectiveError("the process group was destroyed; call init_process_group() again")
        if self._broken is not None:
            # A timeout noticed after the call that stalled (nccl's watchdog) is raised as one.
            kind = CollectiveTimeout if isinstance(self._broken, CollectiveTimeout) else CollectiveError
            raise kind(
                f"the job is broken after an earlier failure and cannot run more collectives: "
                f"{self._broken}"
            ) from self._broken

    def _fail(self, exc: BaseException, handle: Handle) -> BaseException:
        """``exc`` as the CollectiveError that ``handle`` ends with; the job is broken by it."""
        if not isinstance(exc, CollectiveError):
            # A peer that died or left shows here first (gloo: "connection closed"): say where the others are.
            report = self._stall_report(handle.seq, handle.op_name, stalled=False) if self._broken is None else ""
            wrapped = CollectiveError(
                f"{handle.op_name} (sequence number {handle.seq}) failed on {self._who()}: {exc}{report}"
            )
            wrapped.__cause__ = exc
            exc = wrapped
        if self._broken is None:
            self._broken = exc
        return exc

    def _timeout(self, seq: int, op_name: str) -> CollectiveTimeout:
        return CollectiveTimeout(
            f"{op_name} (sequence number {seq}) did not complete within {self.timeout:g} s on "
            f"{self._who()}.{self._stall_report(seq, op_name)} "
            f"The job is now broken: further collectives fail at once (the timeout is set by "
            f"SMDDP_TIMEOUT or init_process_group(timeout=...))."
        )

    def _stalled(self, seq: int, op_name: str) -> CollectiveTimeout:
        """The timeout error for ``seq``, the job marked broken by it."""
        error = self._timeout(seq, op_name)
        if self._broken is None:
            self._broken = error
        return error

    def _interrupted(self, seq: int, op_name: str) -> None:
        if self._broken is None:
            self._broken = CollectiveError(
                f"{op_name} (sequence number {seq}) was interrupted on rank {self.rank}; the ranks are "
                f"no longer in step"
            )

    # ------------------------------------------------------------------ where every rank is
    def _open_channel(self, store) -> Optional[_stall.StoreChannel]:
        if store is None:
            return None
        try:
            channel = _stall.StoreChannel(store, self.rank, self.size)
            channel.serve(self.status)
        except Exception as exc:  # noqa: BLE001 - a store without clone() or queues
            print(f"smddp: rank {self.rank}: timeouts will not name the stalled ranks: {exc}", file=sys.stderr)
            return None
        return channel

    def status(self) -> _stall.Status:
        """Where this rank is: its latest collective, whether it finished, how long ago it started."""
        seq, op_name, handle = self.seq, self._last_op, self._last_handle
        if handle is not None and handle.seq == seq:
            done, started = handle._done, handle.deadline - self.timeout
        else:
            done, started = self._done_seq >= seq, self._last_start
        state = "broken" if self._broken is not None else "running"
        found = {"rank": self.rank, "seq": seq, "op": op_name, "done": bool(done), "state": state,
                 "age": round(time.monotonic() - started, 3) if seq else 0.0}
        if self._end_note is not None:
            found.update(self._end_note)
        return found

    def _stall_report(self, seq: int, op_name: str, stalled: bool = True) -> str:
        if self._channel is None:
            return ""
        with self._report_lock:
            if self._statuses is None:
                try:
                    self._statuses = self._channel.query()
                except Exception as exc:  # noqa: BLE001 - the report is best effort
                    return f" (could not ask the other ranks where they are: {exc})"
        statuses = {self.global_rank(rank): st for rank, st in self._statuses.items()}
        text = _stall.describe(statuses, seq, op_name, stalled)
        return " " + text if text else ""

    def at_exit(self, failure: Optional[str] = None) -> None:
        """The interpreter is exiting (called by :mod:`smddp._excepthook`).

        A broken job ends at once (under MPI, every rank). Otherwise this rank leaves a note
        for ranks that may still wait for it and, under MPI, waits (answering their
        questions) until every rank has ended, as ``MPI_Finalize`` would.

        Args:
            failure: the uncaught exception that ends the script, if any.
        """
        if self._broken is not None:
            print(f"smddp: rank {self.rank} is exiting with the job broken ({type(self._broken).__name__}); "
                  f"ending the job now rather than waiting for a collective that will never complete",
                  file=sys.stderr)
            _excepthook.abort_job(1)
        if self._closed or self._channel is None:
            return
        self._end_note = {"state": "failed", "error": failure} if failure else {"state": "exiting"}
        try:
            self._channel.note_end(self.status())
            # Long enough for a rank still in a collective to time out and ask this one.
            wait = self.timeout + 2 * _stall.ANSWER_WAIT + 5
            if _excepthook.mpi_running() and not failure and not self._channel.wait_all_ended(wait):
                print(f"smddp: rank {self.rank}: other ranks have not reached the end of their script within "
                      f"{wait:g} s", file=sys.stderr)
        finally:
            # Stop the responder now: a thread that wakes up during interpreter shutdown
            # (when rank 0's store goes away) aborts the process.
            self._channel.close()

    # ------------------------------------------------------------------ helpers
    def _comm_for(self, *tensors: torch.Tensor) -> Communicator:
        if len(tensors) == 1 and isinstance(tensors[0], torch.Tensor):
            # The hot path (one tensor): a few attribute reads.
            tensor = tensors[0]
            comm = self._cpu_comm if tensor.is_cpu else self.comms.get(tensor.device.type)
            if comm is not None and tensors[0].dtype in comm.dtypes:
                return comm
        device = tensors[0].device
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                raise InvalidTypeError(f"expected a torch.Tensor, got {type(t).__name__}")
            if t.device != device:
                raise InvalidArgumentError(f"tensors are on different devices: {device} and {t.device}")
        comm = self.comms.get(device.type)
        if comm is None:
            raise BackendUnavailableError(
                f"the {self.backend!r} backend does not serve {device.type} tensors "
                f"(this job serves: {', '.join(sorted(self.comms))})"
            )
        dtype = tensors[0].dtype
        for t in tensors:
            if t.dtype != dtype:
                raise InvalidTypeError(f"tensors have different dtypes: {dtype} and {t.dtype}")
        if dtype not in comm.dtypes:
            names = ", ".join(sorted(str(d).replace("torch.", "") for d in comm.dtypes))
            raise InvalidTypeError(f"dtype {dtype} is not supported by the {comm.name} backend; use one of: {names}")
        return comm

    def _start(
        self, op_name: str, start: Callable[[int], Pending], async_op: bool, check=None
    ) -> Optional[Handle]:
        """Number and start a collective; wait for it here unless ``async_op``.

        ``check`` (built only under ``SMDDP_DEBUG``) describes the call for
        :meth:`smddp.comm.debug.Checker.check`, which compares it across ranks first.

        Returns:
            A :class:`Handle` for an asynchronous operation, None once a synchronous one is done.
        """
        # Ranks must start collectives in the same order: numbering and starting happen
        # together, under one lock, whichever thread calls.
        with self._start_lock:
            self._check_usable()
            self.seq += 1
            seq = self.seq
            self._last_op = op_name
            if check is not None:
                self._last_start = time.monotonic()
                self._debug.check(seq, op_name, *check)
            try:
                pending = start(seq)
            except (CollectiveError, InvalidArgumentError, InvalidTypeError):
                raise
            except Exception as exc:  # noqa: BLE001 - a library error becomes a CollectiveError
                raise self._fail(exc, Handle(self, seq, op_name, DONE)) from exc
            handle = None
            if async_op or self._inflight:
                # A synchronous collective behind asynchronous ones completes after them.
                handle = self._track(Handle(self, seq, op_name, pending))
        if async_op:
            self._last_handle = handle
            return handle
        self._last_start = time.monotonic()
        if handle is not None:
            handle.wait()
        else:
            self._wait_inline(seq, op_name, pending)
        self._done_seq = seq
        return None

    def _wait_inline(self, seq: int, op_name: str, pending: Pending) -> None:
        """Wait for a synchronous collective, nothing else in flight, in the caller's thread.

        The one wait loop without a handle: the hot path of synchronous collectives.
        """
        deadline = time.monotonic() + self.timeout
        block = getattr(pending, "block", None)
        polls = 0
        try:
            while not pending.test():
                polls += 1
                if block is not None or polls > _HOT_POLLS:
                    if time.monotonic() > deadline:
                        self._abandoned.append(pending)
                        raise self._stalled(seq, op_name)
                    if block is not None:
                        block(min(_BLOCK_SLICE, max(0.0, deadline - time.monotonic())))
                    else:
                        time.sleep(0 if polls < _WARM_POLLS else 0.0005)
        except CollectiveError:
            raise
        except KeyboardInterrupt:
            self._interrupted(seq, op_name)
            raise
        except Exception as exc:  # noqa: BLE001 - a library error becomes a CollectiveError
            raise self._fail(exc, Handle(self, seq, op_name, DONE)) from exc
        pending.waited()  # a stream-ordered operation orders the caller's stream

    @staticmethod
    def _inplace(tensor: torch.Tensor):
        """A contiguous buffer for ``tensor`` and what to do once the operation is done."""
        if tensor.is_contiguous():
            # Communicators also finish with torch in-place ops (AVERAGE's divide, the copy
            # back from a bfloat16 upcast), which autograd refuses on a leaf that requires grad.
            return (tensor.detach() if tensor.requires_grad else tensor), None
        target = tensor.detach()
        buf = target.contiguous()
        return buf, lambda: target.copy_(buf)

    # ------------------------------------------------------------------ collectives
    def all_reduce(
        self, tensor: torch.Tensor, op: Op, async_op: bool = False, backward: bool = False
    ) -> Optional[Handle]:
        """Reduce ``tensor`` over all ranks, in place.

        ``backward``: the call comes from inside autograd's backward (DDP's gradient buckets);
        errors then name the uneven-batches case.
        """
        comm = self._comm_for(tensor)
        buf, after = self._inplace(tensor)

        def start(seq: int) -> Pending:
            pending = comm.all_reduce(buf, op, seq)
            return Then(pending, after) if after else pending

        check = None if self._debug is None else ("all_reduce", op, tensor, None, backward)
        return self._start(_BACKWARD_ALL_REDUCE if backward else "all_reduce", start, async_op, check)

    def broadcast(self, tensor: torch.Tensor, src: int, async_op: bool = False) -> Optional[Handle]:
        """Copy rank ``src``'s ``tensor`` into ``tensor`` on every rank."""
        comm = self._comm_for(tensor)
        self._check_rank(src, "src")
        buf, after = self._inplace(tensor)

        def start(seq: int) -> Pending:
            pending = comm.broadcast(buf, src, seq)
            return Then(pending, after) if after else pending

        check = None if self._debug is None else ("broadcast", None, tensor, src)
        return self._start("broadcast", start, async_op, check)

    def all_gather(
        self, tensor_list: Sequence[torch.Tensor], tensor: torch.Tensor, async_op: bool = False
    ) -> Optional[Handle]:
        """Gather every rank's ``tensor`` into ``tensor_list`` (rank order)."""
        if not isinstance(tensor_list, (list, tuple)):
            raise InvalidTypeError(f"tensor_list must be a list of tensors, got {type(tensor_list).__name__}")
        comm = self._comm_for(tensor, *tensor_list)
        self._check_per_rank(tensor_list, tensor, "all_gather", "tensor_list", "input")
        src = tensor.detach().contiguous()
        flat = torch.empty(self.size * src.numel(), dtype=src.dtype, device=src.device)

        def scatter_back() -> None:
            for i, out in enumerate(tensor_list):
                out.detach().copy_(flat[i * src.numel():(i + 1) * src.numel()].view(out.shape))

        return self._start(
            "all_gather", lambda seq: Then(comm.all_gather(flat, src.view(-1), seq), scatter_back),
            async_op, None if self._debug is None else ("all_gather", None, tensor),
        )

    def all_gather_into_tensor(
        self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False
    ) -> Optional[Handle]:
        """Gather every rank's ``input`` into ``output`` (``size * input.numel()`` elements)."""
        comm = self._comm_for(output, input)
        if output.numel() != self.size * input.numel():
            raise InvalidArgumentError(
                f"all_gather_into_tensor: output has {output.numel()} elements; it needs "
                f"{self.size} x {input.numel()}"
            )
        buf, after = self._inplace(output)
        src = input.detach().contiguous()

        def start(seq: int) -> Pending:
            pending = comm.all_gather(buf.view(-1), src.view(-1), seq)
            return Then(pending, after) if after else pending

        check = None if self._debug is None else ("all_gather", None, input)
        return self._start("all_gather_into_tensor", start, async_op, check)

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: Optional[Sequence[int]] = None,
        input_split_sizes: Optional[Sequence[int]] = None,
        async_op: bool = False,
    ) -> Optional[Handle]:
        """Scatter slices of ``input`` (along dim 0) to all ranks, gather theirs into ``output``."""
        comm = self._comm_for(output, input)
        out_counts = self._split_counts(output, output_split_sizes, "output")
        in_counts = self._split_counts(input, input_split_sizes, "input")
        buf, after = self._inplace(output)
        src = input.detach().contiguous()

        def start(seq: int) -> Pending:
            pending = comm.all_to_all_single(buf.view(-1), src.view(-1), out_counts, in_counts, seq)
            return Then(pending, after) if after else pending

        check = None if self._debug is None else (
            "all_to_all_single", None, input, None, False, (in_counts, out_counts))
        return self._start("all_to_all_single", start, async_op, check)

    def barrier(self, async_op: bool = False) -> Optional[Handle]:
        """Complete once every rank has entered the barrier."""
        return self._start("barrier", self.primary.barrier, async_op, None if self._debug is None else ("barrier",))

    # ------------------------------------------------------------------ validation
    def _check_per_rank(
        self, tensors: Sequence[torch.Tensor], reference: torch.Tensor, op: str, what: str, other: str
    ) -> None:
        """``tensors`` holds one tensor per rank, each with ``reference``'s number of elements."""
        if len(tensors) != self.size:
            raise InvalidArgumentError(f"{op}: {what} has {len(tensors)} tensors; it needs one per rank ({self.size})")
        for i, t in enumerate(tensors):
            if t.numel() != reference.numel():
                raise InvalidArgumentError(
                    f"{op}: {what}[{i}] has shape {tuple(t.shape)}, the {other} has shape "
                    f"{tuple(reference.shape)}: they must have the same number of elements"
                )

    def _check_rank(self, rank, what: str) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int):
            raise InvalidTypeError(f"{what} must be an int rank, got {type(rank).__name__}")
        if not 0 <= rank < self.size:
            raise InvalidArgumentError(f"{what}={rank} is not a rank of this job (0..{self.size - 1})")

    def _split_counts(self, tensor: torch.Tensor, splits: Optional[Sequence[int]], what: str) -> List[int]:
        rows = tensor.shape[0] if tensor.dim() > 0 else 1
        row_numel = tensor.numel() // rows if rows else 0
        if splits is None or len(splits) == 0:
            if rows % self.size:
                raise InvalidArgumentError(
                    f"all_to_all_single: {what} has {rows} rows along dim 0, not divisible by the "
                    f"world size {self.size}; pass {what}_split_sizes"
                )
            return [rows // self.size * row_numel] * self.size
        splits = list(splits)
        if len(splits) != self.size or any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in splits):
            raise InvalidArgumentError(
                f"all_to_all_single: {what}_split_sizes must be {self.size} non-negative ints, got {splits}"
            )
        if sum(splits) != rows:
            raise InvalidArgumentError(
                f"all_to_all_single: {what}_split_sizes {splits} add up to {sum(splits)}, but {what} has "
                f"{rows} rows along dim 0"
            )
        return [s * row_numel for s in splits]

    # ------------------------------------------------------------------ progress
    def _track(self, handle: Handle) -> Handle:
        """Own ``handle`` until it completes; the progress thread advances it meanwhile."""
        with self._cv:
            self._inflight.append(handle)
            if self._thread is None:
                self._thread = threading.Thread(target=self._progress, name="smddp-progress", daemon=True)
                self._thread.start()
            self._cv.notify()
        return handle

    def _poll(self) -> None:
        """Advance every operation in flight once; complete them in issue order.

        Every Pending is tested on each pass, so a ring whose handle nobody holds keeps
        posting its stages. A collective is done once its Pending is and every collective
        issued before it is done; once one fails, the collectives after it fail too (the ranks
        are no longer in step). Callbacks run after the lock is released, in issue order.
        """
        finished: List[Handle] = []
        with self._cv:
            if not self._inflight:
                return
            now = time.monotonic()
            keep: List[Handle] = []
            blocked: Optional[Handle] = None  # the earliest collective not yet done
            failed: Optional[Handle] = None  # the earliest collective that failed
            for handle in self._inflight:
                if not handle._finished:
                    if failed is not None and handle.ordered:
                        handle._finish_failed(CollectiveError(
                            f"{handle.op_name} (sequence number {handle.seq}) was cancelled on rank "
                            f"{self.rank}: {failed.op_name} (sequence number {failed.seq}), issued "
                            f"before it, failed"))
                    else:
                        handle._advance(now)
                if not handle.ordered or blocked is None:
                    if handle._finished:
                        if handle.ordered and handle._error is not None and failed is None:
                            failed = handle
                        if handle._callbacks:
                            finished.append(handle)  # done once its callbacks have run
                        else:
                            handle._done = True
                        continue
                    if handle.ordered:
                        blocked = handle
                keep.append(handle)
            self._inflight = keep
            callbacks = []
            for handle in finished:
                callbacks.append(handle._callbacks)
                handle._callbacks = None  # completing: a callback added now runs at once
        for handle, calls in zip(finished, callbacks):
            self._call_back(handle, calls)
            # Done only now: a wait() that returns has seen a raising callback's error.
            handle._done = True

    def _call_back(self, handle: Handle, callbacks: List[Callable[[Handle], None]]) -> None:
        for callback in callbacks:
            try:
                callback(handle)
            except Exception as exc:  # noqa: BLE001 - fails this operation, not the progress thread
                error = CollectiveError(
                    f"a done-callback of {handle.op_name} (sequence number {handle.seq}) raised on rank "
                    f"{self.rank}: {type(exc).__name__}: {exc}"
                )
                error.__cause__ = exc
                print(f"smddp: {error}", file=sys.stderr)
                if handle._error is None:
                    handle._error = error

    def _progress(self) -> None:
        """The progress thread: advance operations in flight while the caller computes."""
        while True:
            with self._cv:
                while not self._inflight and not self._closed:
                    self._cv.wait()
                if self._closed and not self._inflight:
                    return
            self._poll()
            time.sleep(2e-5)

    def _drain(self) -> bool:
        """Wait for every operation in flight, each within its deadline; True if all completed."""
        while True:
            with self._cv:
                if not self._inflight:
                    return not self._abandoned
                last = self._inflight[-1]
            try:
                last.wait()
            except CollectiveError as exc:
                print(f"smddp: rank {self.rank}: at teardown: {exc}", file=sys.stderr)

    def close(self) -> None:
        """Drain operations in flight, stop the progress thread, then close every communicator.

        Operations still in flight complete first (each within the timeout); the progress
        thread is stopped and joined; communicators are freed only if no library may still
        hold a buffer of a failed operation.
        """
        if self._closed:
            return
        clean = self._broken is None and self._drain()
        with self._cv:
            self._closed = True
            self._abandoned.extend(handle._pending for handle in self._inflight)
            self._inflight.clear()
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self._channel is not None:
            if self._broken is None:
                self._end_note = {"state": "closed"}
                try:
                    self._channel.note_end(self.status())
                except Exception:  # noqa: BLE001 - the store may already be gone
                    pass
            self._channel.close()
        if self._broken is None:
            _excepthook.forget(self)  # a broken engine still ends the job at exit
        if not clean:
            return  # freeing a communicator under a request still in flight is undefined
        closed = set()
        for comm in self.comms.values():
            if id(comm) not in closed:
                closed.add(id(comm))
                comm.close()
