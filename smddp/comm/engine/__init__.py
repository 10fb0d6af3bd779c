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

The engine holds two parts, each with its own state: its argument checks (:attr:`Engine.checks`,
:mod:`smddp.comm.engine.arguments`) and its work in flight (:attr:`Engine.flight`,
:mod:`smddp.comm.engine.progress`); it inherits its failure state and reports
(:mod:`smddp.comm.engine.health`). A caller's view of an operation in flight is a
:class:`~smddp.comm.engine.handle.Handle` (:mod:`smddp.comm.engine.handle`).

Thread model (docs/architecture.md has the whole of it): any thread may start a collective
(numbering and starting are one step, under ``_start_lock``); operations in flight are
tested under the lock of the engine's work in flight by the progress thread and by threads that wait; a
synchronous operation with nothing in flight is tested by its caller alone. Threads thus
call the library concurrently: the ``mpi`` backend requires ``MPI_THREAD_MULTIPLE`` and
checks it at init. Callbacks run outside the lock: in a thread that waited for the
operation, or on a completion thread (:mod:`smddp.comm.engine.completer`), never on the
progress thread.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from typing import Callable, Deque, Dict, Mapping, Optional, Sequence

import torch

from smddp.comm.base import DONE, Communicator, Failed, Pending, flat, then
from smddp.comm.engine import debug as _debug
from smddp.comm.engine import events as _events
from smddp.comm.engine.arguments import ArgumentChecks, check_writable
from smddp.comm.engine.completer import completing
from smddp.comm.engine.handle import Handle
from smddp.comm.engine.health import Health
from smddp.comm.engine.progress import InFlight
from smddp.comm.engine.stall import labelled
from smddp.comm.reduction import Op
from smddp.comm.waiting import poll
from smddp.errors import (
    CollectiveError,
    CollectiveMismatchError,
    CollectiveTimeout,
    InvalidArgumentError,
    InvalidTypeError,
)

__all__ = ["Engine", "Handle"]

_profiling = _events.active  # one C call: is torch's profiler recording in this thread
_monotonic = time.monotonic


class _Waiting(Pending):
    """The Pending of a collective waiting to start (:meth:`Engine.chain`): nothing to advance yet."""

    def test(self) -> bool:
        return False


_WAITING = _Waiting()

class Engine(Health):
    """The collectives of one job over one communicator per device type.

    Args:
        comms: device type (``"cpu"``, ``"cuda"``, ``"xpu"``) to communicator; the first is
            the job's primary backend.
        timeout: seconds a collective may take before :class:`CollectiveTimeout`.
        store: the job's torch ``Store``; with it, a timed-out rank asks the others where
            they are and names the ones that never arrived (:mod:`smddp.comm.engine.stall`).
        advice: a caller's label (see :meth:`all_reduce`) to a sentence for the user, added to
            a timeout or mismatch report that involves a collective with that label. Give
            every rank the same table: ``SMDDP_DEBUG``'s rows carry a label as its index here.
    """

    def __init__(self, comms: Dict[str, Communicator], timeout: float, store=None,
                 advice: Optional[Mapping[str, str]] = None):
        if not comms:
            raise ValueError("an engine needs at least one communicator")
        self.comms = dict(comms)
        for comm in self.comms.values():
            comm.on_timeout = self.stalled  # a communicator that watches its own deadlines (nccl)
        self.primary = next(iter(self.comms.values()))
        self.rank = self.primary.rank
        self.size = self.primary.size
        self.timeout = float(timeout)
        #: Label to advice (the ``advice`` argument); :attr:`labels` orders its labels.
        self.advice: Dict[str, str] = dict(advice or {})
        self.labels = tuple(self.advice)
        self.seq = 0
        self._closed = False
        self._start_lock = threading.Lock()
        # Collectives waiting for futures' callbacks to run first, and how many unsettled
        # futures Python holds (see chain()).
        self._deferred: Deque[Handle] = collections.deque()
        self._chained = 0
        #: Its work in flight: every asynchronous operation, owned until it completes (the engine, not
        #: the caller's handle, owns it), completed in issue order by the process's progress thread.
        self.flight = InFlight(self.rank, self.settled, self._forget_done_work, self._deferred,
                               self._expire_deferred, self.look_for_ended)
        #: The argument checks every collective makes before anything is sent.
        self.checks = ArgumentChecks(self.rank, self.size, self.comms, self.primary.name)
        self._cpu_comm = self.comms.get("cpu")  # for all_reduce's inline check
        self._cuda_comm = self.comms.get("cuda")
        #: SMDDP_DEBUG=1: compares every collective across ranks first; None (no cost) when off.
        self._debug = _debug.DebugComparison(self, self.comms.get("cpu", self.primary)) if _debug.enabled() else None
        self._init_health(store)

    # ------------------------------------------------------------------ state
    @property
    def backend(self) -> str:
        """Name of the primary communicator's backend."""
        return self.primary.name

    @property
    def debugging(self) -> bool:
        """True under ``SMDDP_DEBUG``: :meth:`run` then compares each collective across ranks first."""
        return self._debug is not None

    # ------------------------------------------------------------------ starting and waiting
    def run(
        self, op_name: str, start: Callable[..., Pending], async_op: bool = True, check=None, args: tuple = (),
        inputs: Sequence[torch.Tensor] = (), result: Sequence = (), profile: bool = True,
    ) -> Optional[Handle]:
        """Number and start a collective (``start(*args, seq)``); wait for it here unless ``async_op``.

        The one way a collective runs: the engine's own and those built on a communicator's
        (:mod:`smddp.comm.algorithms.derived`) are all numbered, ordered, timed and owned
        here. Check the arguments (:attr:`checks`) before calling: nothing may raise an
        argument error once ``start`` has sent anything.

        Args:
            op_name: the collective's name in errors and stall reports.
            start: starts the operation on a communicator; ``seq`` is its sequence number.
            async_op: return a :class:`Handle` at once instead of waiting here.
            check: under ``SMDDP_DEBUG`` (:attr:`debugging`), the call described for
                :meth:`smddp.comm.engine.debug.DebugComparison.check`, which compares it across ranks
                first; None otherwise.
            args: passed to ``start`` before ``seq``.
            inputs: the tensors the collective reads: the shapes torch's profiler records
                (:mod:`smddp.comm.engine.events`) while it is active.
            result: the output tensors the handle's ``result()`` and future give.
            profile: False where the caller records the collective's profiler event itself.

        Returns:
            A :class:`Handle` for an asynchronous operation, None once a synchronous one is done.
        """
        if profile and _profiling():
            return _events.profiled(self, op_name, start, async_op, check, args, inputs, result)
        # Ranks must start collectives in the same order: numbering and starting happen
        # together, under one lock, whichever thread calls. acquire() and release(): cheaper
        # than `with`, on the path of every small collective.
        self._start_lock.acquire()
        try:
            if self._closed or self._broken is not None:
                self._check_usable()
            if self._chained and not completing():
                # A future's callbacks that may start collectives have not run yet: this one
                # starts after them (see chain()).
                handle = Handle(self, 0, op_name, _WAITING, result=result)
                handle.start = (start, args, check)
                self._deferred.append(handle)
                pending = None
            else:
                self.seq = seq = self.seq + 1
                self._last_op = op_name
                if check is not None:
                    self._last_start = time.monotonic()
                    self._debug.check(seq, op_name, *check)
                try:
                    pending = start(*args, seq)
                except CollectiveMismatchError as exc:
                    if not async_op:
                        raise
                    # A plane may see a mismatch as one rank starts and as another completes:
                    # an asynchronous call reports it from wait() on every rank alike.
                    pending = Failed(exc)
                except CollectiveTimeout as exc:
                    # A plane's set-up at the group's first collective waited for a host-mate that did
                    # not come (hostmates): this collective's timeout, with the stall report.
                    raise self.stalled(seq, op_name, str(exc).rstrip(".")) from exc
                except (CollectiveError, InvalidArgumentError, InvalidTypeError):
                    raise
                except Exception as exc:  # noqa: BLE001 - a library error becomes a CollectiveError
                    # A start that failed part-way may have posted requests (a ring's receive into
                    # its scratch): the error's traceback holds the frames that hold their buffers.
                    self.flight.hold(exc)
                    raise self.failure(exc, Handle(self, seq, op_name, DONE, done=True)) from exc
                handle = None
                if self.flight.handles:
                    # A collective behind asynchronous ones completes after them.
                    handle = self.flight.track(Handle(self, seq, op_name, pending, result=result))
                elif async_op:
                    # Completed as it started, nothing before it in flight: born done, and no
                    # thread need ever test it (most small collectives, torch's API's too).
                    done = pending is DONE
                    handle = Handle(self, seq, op_name, pending, result=result, done=done)
                    if not done:
                        self.flight.track(handle)
        finally:
            self._start_lock.release()
        if async_op:
            # The handle is the caller's Work, which the engine must not keep alive once it
            # is done: _forget_done_work forgets it as it completes.
            if handle.done:
                self._last_handle, self._done_seq = None, seq
            else:
                self._last_handle = handle
            return handle
        self._last_start = time.monotonic()
        if handle is not None:
            handle.wait()
            seq = handle.seq
        elif pending is not DONE:  # DONE: the communicator completed it as it started it
            self._wait_inline(seq, op_name, pending)
        self._done_seq = seq
        return None

    # ------------------------------------------------------------------ callbacks that start collectives
    def chain(self, handle: Handle) -> None:
        """Python took ``handle``'s future before it settled: what its callbacks start comes next.

        torch's NCCL group completes a future as its collective is enqueued, in the caller's
        thread, so a ``then`` callback that starts a collective (torch's PowerSGD hook) starts it
        right after its parent, before the caller's next one, on every rank. Here a future
        completes on whichever thread finds its operation done, at a time that differs from rank
        to rank; so until ``handle`` has settled (its callbacks have returned), a collective that
        another thread starts waits to start, and is numbered after the collectives the callbacks
        start (:func:`~smddp.comm.engine.completer.completing` tells them apart). Every rank then
        numbers them alike. Collectives whose future only C++ reads (DDP's reducer without a
        Python hook) never wait.
        """
        with self._start_lock:
            if not handle.settled and not handle.chained:
                handle.chained = True
                if handle.start is None:  # started; one still waiting counts once it starts
                    self._chained += 1

    def settled(self, handle: Handle) -> None:
        """``handle`` has settled (what C++ sees of it, its future's callbacks): release what waits on it."""
        with self._start_lock:
            handle.mark_settled()
            if handle.chained:
                self._chained -= 1
                if not self._chained and self._deferred:
                    self._start_deferred()

    def _start_deferred(self) -> None:
        """Start the collectives that waited for callbacks, in the order they were called
        (under ``_start_lock``), until one whose own future Python holds is unsettled."""
        while self._deferred and not self._chained:
            handle = self._deferred.popleft()
            start, args, check = handle.start
            handle.start = None
            if self._closed or self._broken is not None:
                error = None
                try:
                    self._check_usable()
                except CollectiveError as exc:
                    error = exc
                handle.never_started(error)
                self.flight.track(handle)
                continue
            self.seq = seq = handle.seq = self.seq + 1
            self._last_op = handle.op_name
            try:
                if check is not None:
                    self._debug.check(seq, handle.op_name, *check)
                handle.began(start(*args, seq))
            except CollectiveMismatchError as exc:
                handle.began(Failed(exc))
            except Exception as exc:  # noqa: BLE001 - fails this collective, as a start that failed part-way
                self.flight.hold(exc)
                handle.failed_to_start(self.failure(exc, handle))
            self.flight.track(handle)
            if handle.chained and not handle.settled:
                self._chained += 1

    def _expire_deferred(self, now: float) -> None:
        """Fail the collectives that waited past their deadline to start (callbacks that never returned)."""
        if not self._deferred or now <= self._deferred[0].deadline:
            return
        with self._start_lock:
            while self._deferred and now > self._deferred[0].deadline:
                handle = self._deferred.popleft()
                handle.start = None
                error = CollectiveTimeout(
                    f"{handle.op_name} could not start within {self.timeout:g} s on {self._who()}: it waits for "
                    f"the callbacks of an earlier collective's future (a then() callback), which have not "
                    f"returned. The job is now broken: further collectives fail at once.")
                if self._broken is None:
                    self._broken = error
                handle.never_started(error)
                self.flight.track(handle)

    def _forget_done_work(self) -> None:
        """Operations have completed (a pass of :attr:`flight`): once the caller's latest Work is done,
        the engine no longer keeps it (the record of where this rank is counts it)."""
        latest = self._last_handle
        if latest is not None and latest.done and self._last_handle is latest:
            self._last_handle, self._done_seq = None, max(self._done_seq, latest.seq)

    def direct_path(self, comm: Communicator):
        """``comm``'s direct path (:attr:`Communicator.direct`) if a collective may take it now, else None.

        A stream-ordered communicator's direct path enqueues a collective with nothing for the
        engine to own (:mod:`smddp.comm.backends.nccl.direct`): taken unless that communicator's
        general path has work in flight (its collectives complete in issue order), a future's
        callbacks may still start collectives (:meth:`chain`: every rank numbers them first), or
        ``SMDDP_DEBUG`` compares each collective first. An operation of another communicator in
        flight (an asynchronous CPU all-reduce of a metric) does not turn it off, nor does torch's
        profiler: the path records the collective's event itself. torch's NCCL group's rules apply
        from there: the collective is done for the host once it is enqueued.
        """
        direct = comm.direct
        if direct is not None and not self._chained and self._debug is None and (
                not self.flight.handles or not self.flight.on_stream()):
            return direct
        return None

    def finish(self, handles: Sequence[Handle], seconds: float) -> bool:
        """Help ``handles`` complete in this thread for at most ``seconds``; True if all did
        (:meth:`InFlight.finish <smddp.comm.engine.progress.InFlight.finish>`: DDP's reducer at the end
        of backward)."""
        return self.flight.finish(handles, seconds)

    @contextlib.contextmanager
    def coalesced(self):
        """Start the collectives of one coalesced call in this block (torch's ``*_coalesced``):
        those a direct path takes go to its library as one grouped launch (NCCL's
        ``ncclGroupStart``/``ncclGroupEnd``), at the end of the block, in the calling thread.
        """
        paths = []
        for comm in self.comms.values():
            direct = comm.direct
            if direct is not None and direct not in paths:
                direct.begin_group()
                paths.append(direct)
        try:
            yield
        finally:
            if paths:
                with self._start_lock:  # the launch is a call into the library, as a start is
                    for direct in paths:
                        direct.end_group()

    def start_direct(self, direct, kind: str, output: torch.Tensor, input: Optional[torch.Tensor], arg,
                     async_op: bool, result: Optional[Sequence], op_name: str):
        """Number and start a collective on a direct path (:meth:`direct_path`): ``direct.start(kind,
        output, input, arg, async_op, result, seq, op_name)``.

        Returns what that returns: a ``Work``, None (synchronous), or the path's ``REFUSED``,
        having sent nothing and taken no number (the general path then numbers it).
        """
        self._start_lock.acquire()
        try:
            if self._closed or self._broken is not None:
                self._check_usable()
            # Numbered before the call: a rank blocked inside NCCL's (its first with a peer)
            # tells the others it is in this collective.
            last_op, self._last_start = self._last_op, time.monotonic()
            self.seq = seq = self.seq + 1
            self._last_op = op_name
            work = direct.start(kind, output, input, arg, async_op, result, seq, op_name)
            if work is direct.REFUSED:  # nothing was sent
                self.seq, self._last_op = seq - 1, last_op
        finally:
            self._start_lock.release()
        if work is not direct.REFUSED:
            self._done_seq = seq
        return work

    def _wait_inline(self, seq: int, op_name: str, pending: Pending) -> None:
        """Wait for a synchronous collective, nothing else in flight, in the caller's thread.

        The hot path of synchronous collectives: no handle, no lock.
        """
        try:
            if not poll(pending.test, time.monotonic() + self.timeout, getattr(pending, "block", None),
                        watch=lambda: self.look_for_ended(seq, op_name)):
                raise self.stalled(seq, op_name)
        except BaseException as exc:
            # Failed, timed out or interrupted: the library may still hold the addresses of its
            # buffers (another request of the same stage), so they live as long as the engine.
            # A mismatch is the exception: no data moved and the ranks are in step.
            if not isinstance(exc, CollectiveMismatchError):
                self.flight.hold(pending)
            if isinstance(exc, KeyboardInterrupt):
                self.interrupted(seq, op_name)
            if isinstance(exc, CollectiveError) or not isinstance(exc, Exception):
                raise
            # A library error becomes a CollectiveError.
            raise self.failure(exc, Handle(self, seq, op_name, DONE, done=True)) from exc
        pending.waited()  # a stream-ordered operation orders the caller's stream

    # ------------------------------------------------------------------ collectives
    def all_reduce(
        self, tensor: torch.Tensor, op: Op, async_op: bool = False, label: Optional[str] = None,
        result: Optional[Sequence] = None,
    ) -> Optional[Handle]:
        """Reduce ``tensor`` over all ranks, in place.

        ``label``: what the caller does with it, named in errors and stall reports as
        ``all_reduce (<label>)``; a label in the engine's ``advice`` adds that advice to them.
        ``result``: what the handle's ``result()`` gives (default ``[tensor]``).
        """
        # The hot path inlines checks.comm_for's common case (a CPU tensor of a dtype the CPU
        # communicator takes): through that call a world-of-one v1 all_reduce took about 250 ns
        # more (timeit, alternated with this version, 2-core AMD EPYC VM), some 4% of a 4 KB
        # all-reduce on the shared-memory plane.
        comm = self._cpu_comm if tensor.is_cpu else self._cuda_comm if tensor.is_cuda else None
        direct = None if comm is None else comm.direct
        # The direct path checks the dtype itself (a tensor it refuses goes on to the checks below)
        if direct is not None and not self._chained and self._debug is None and (
                not self.flight.handles or not self.flight.on_stream()):
            # self.direct_path(comm) and self.start_direct(...), inline: the host's path of every
            # all-reduce on a GPU, where each Python call is a tenth of what the group adds
            # (benchmarks/nccl_host_cost.py)
            name = "all_reduce" if label is None else labelled("all_reduce", label)
            lock = self._start_lock
            lock.acquire()
            try:
                if self._closed or self._broken is not None:
                    self._check_usable()
                last_op, self._last_start = self._last_op, _monotonic()
                self.seq = seq = self.seq + 1
                self._last_op = name
                work = direct.start(direct.ALL_REDUCE, tensor, None, op, async_op, result, seq, name)
                if work is direct.REFUSED:  # nothing was sent
                    self.seq, self._last_op = seq - 1, last_op
            finally:
                lock.release()
            if work is not direct.REFUSED:
                self._done_seq = seq
                return work
        if comm is None or tensor.dtype not in comm.dtypes:
            comm = self.checks.comm_for(tensor)
        check = None if self._debug is None else ("all_reduce", op, tensor, None, label)
        name = "all_reduce" if label is None else labelled("all_reduce", label)
        inputs = [tensor]
        if result is None:
            result = inputs
        if tensor.is_contiguous() and not tensor.requires_grad:  # checks.buffer's common case, inline
            return self.run(name, comm.all_reduce, async_op, check, (tensor, op), inputs, result)
        buf, after = self.checks.buffer(tensor, "all_reduce")

        def start(seq: int) -> Pending:
            pending = comm.all_reduce(buf, op, seq)
            return then(pending, after)

        return self.run(name, start, async_op, check, (), inputs, result)

    def broadcast(self, tensor: torch.Tensor, src: int, async_op: bool = False) -> Optional[Handle]:
        """Copy rank ``src``'s ``tensor`` into ``tensor`` on every rank."""
        comm = self.checks.comm_for(tensor)
        self.checks.rank_arg(src, "src")
        direct = self.direct_path(comm)
        if direct is not None:
            work = self.start_direct(direct, direct.BROADCAST, tensor, None, src, async_op, None, "broadcast")
            if work is not direct.REFUSED:
                return work
        buf, after = self.checks.buffer(tensor, "broadcast")

        def start(seq: int) -> Pending:
            pending = comm.broadcast(buf, src, seq)
            return then(pending, after)

        check = None if self._debug is None else ("broadcast", None, tensor, src)
        inputs = [tensor]
        return self.run("broadcast", start, async_op, check, (), inputs, inputs)

    def all_gather(
        self, tensor_list: Sequence[torch.Tensor], tensor: torch.Tensor, async_op: bool = False,
        result: Optional[Sequence] = None,
    ) -> Optional[Handle]:
        """Gather every rank's ``tensor`` into ``tensor_list`` (rank order); ``result()``: ``tensor_list``."""
        if not isinstance(tensor_list, (list, tuple)):
            raise InvalidTypeError(f"tensor_list must be a list of tensors, got {type(tensor_list).__name__}")
        comm = self.checks.comm_for(tensor, *tensor_list)
        self.checks.per_rank(tensor_list, tensor, "all_gather", "tensor_list", "input")
        for i, out in enumerate(tensor_list):
            if not out.is_contiguous():
                check_writable(out, "all_gather", f"tensor_list[{i}]")
        src = flat(tensor)
        gathered = src.new_empty(self.size * src.numel())

        def scatter_back() -> None:
            # chunk(), and view_as() only where an output is not 1-D: each tensor torch builds
            # costs about a microsecond, so as few as one per output.
            for out, part in zip(tensor_list, gathered.chunk(self.size)):
                (out.detach() if out.requires_grad else out).copy_(part if out.dim() == 1 else part.view_as(out))

        return self.run(
            "all_gather", lambda seq: then(comm.all_gather(gathered, src, seq), scatter_back),
            async_op, None if self._debug is None else ("all_gather", None, tensor), (), (tensor,),
            tensor_list if result is None else result,
        )

    def all_gather_into_tensor(
        self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False, result: Optional[Sequence] = None,
    ) -> Optional[Handle]:
        """Gather every rank's ``input`` into ``output`` (``size * input.numel()`` elements)."""
        comm = self.checks.comm_for(output, input)
        if output.numel() != self.size * input.numel():
            raise InvalidArgumentError(
                f"all_gather_into_tensor: output has {output.numel()} elements; it needs "
                f"{self.size} x {input.numel()}"
            )
        direct = self.direct_path(comm)
        if direct is not None:
            work = self.start_direct(direct, direct.ALL_GATHER, output, input, None, async_op, result,
                                     "all_gather_into_tensor")
            if work is not direct.REFUSED:
                return work
        buf, after = self.checks.buffer(output, "all_gather_into_tensor", "output")
        out, src = buf.flatten(), flat(input)  # buf is contiguous: flatten() is a view of it

        def start(seq: int) -> Pending:
            return then(comm.all_gather(out, src, seq), after)

        check = None if self._debug is None else ("all_gather", None, input)
        return self.run("all_gather_into_tensor", start, async_op, check, (), [input],
                        [output] if result is None else result)

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: Optional[Sequence[int]] = None,
        input_split_sizes: Optional[Sequence[int]] = None,
        async_op: bool = False,
    ) -> Optional[Handle]:
        """Scatter slices of ``input`` (along dim 0) to all ranks, gather theirs into ``output``."""
        comm = self.checks.comm_for(output, input)
        out_counts = self.checks.split_counts(output, output_split_sizes, "output")
        in_counts = self.checks.split_counts(input, input_split_sizes, "input")
        self.checks.self_split(out_counts, in_counts, "all_to_all_single")
        buf, after = self.checks.buffer(output, "all_to_all_single", "output")
        out, src = buf.flatten(), flat(input)  # buf is contiguous: flatten() is a view of it

        def start(seq: int) -> Pending:
            return then(comm.all_to_all_single(out, src, out_counts, in_counts, seq), after)

        check = None if self._debug is None else (
            "all_to_all_single", None, input, None, False, (in_counts, out_counts))
        return self.run("all_to_all_single", start, async_op, check, (), [input], [output])

    def barrier(self, async_op: bool = False) -> Optional[Handle]:
        """Complete once every rank has entered the barrier."""
        return self.run("barrier", self.primary.barrier, async_op, None if self._debug is None else ("barrier",))

    def message(self, op_name: str, start: Callable[[], Pending], result: Sequence = ()) -> Handle:
        """Start a point-to-point operation (``start()``) and own it until it completes.

        A message involves two ranks: it takes no sequence number (it is named by the latest
        collective), and completes on its own, not in the collectives' issue order.
        """
        self._check_usable()
        return self.flight.track(Handle(self, self.seq, op_name, start(), ordered=False, result=result))

    def close(self) -> None:
        """Drain operations in flight, leave the progress thread, then close every communicator.

        Operations still in flight complete first (each within the timeout); the process's
        progress thread lets this engine go; communicators are freed only if no library may still
        hold a buffer of a failed operation. A closed engine holds no reference its communicators
        hold back, so that a destroyed group's threads and connections end as torch lets go of it,
        not at a garbage collection.
        """
        if self._closed:
            return
        clean = self._broken is None and self.flight.drain()
        with self._start_lock:
            never_started = list(self._deferred)
            self._deferred.clear()
        self._closed = True
        rank = self.rank
        self.flight.close(never_started, lambda handle: CollectiveError(
            f"{handle.op_name} (sequence number {handle.seq}) was still in flight on rank {rank} "
            f"when its process group was destroyed"))
        self._close_health()
        for comm in self.comms.values():
            comm.on_timeout = None  # its reference back to this engine (a cycle)
        if not clean:
            return  # freeing a communicator under a request still in flight is undefined
        closed = set()
        for comm in self.comms.values():
            if id(comm) not in closed:
                closed.add(id(comm))
                comm.close()
