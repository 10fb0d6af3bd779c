"""A collective in flight (:class:`Handle`), which is torch's ``Work``, and how a thread waits.

The :class:`~smddp.comm.engine.Engine` creates one handle per asynchronous operation and owns
it until it completes. The handle is the operation as every caller holds it: smddp's own
functions, ``torch.distributed`` (the ``"smddp"`` ProcessGroup returns it as its ``Work``),
DDP's reducer and any C++ that keeps it after Python has dropped it. One object per operation,
as gloo's ``AsyncWork`` is.

A handle is a Python subclass of torch's ``PythonCallbackWork`` where torch has it (2.10 and
later; else of torch's ``Work``). When the operation completes, the engine *settles* the
handle: it completes the C++ future that C++ reads (``getFuture()``: DDP's reducer) with the
result, and marks the C++ half completed (``isCompleted()``), whoever waits or polls, and
whether or not Python still holds the handle. C++ that waits on it (``wait()``) calls back into
this module's wait loop, which needs nothing but the engine. Torch's ``PythonCallbackWork``
has no C++ ``result()``: C++ reads the result through the future, as DDP's reducer does.

A handle waits through :func:`smddp.comm.waiting.poll`, smddp's one wait loop.
"""

from __future__ import annotations

import math
import sys
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Callable, List, Optional, Sequence

import torch

from smddp import _compat
from smddp.comm.base import DONE, Pending
from smddp.comm.waiting import poll
from smddp.errors import WaitTimeout

if TYPE_CHECKING:
    from smddp.comm.engine import Engine

__all__ = ["DETACHABLE", "Handle"]

#: torch's C++ Work whose ``wait()`` calls a Python function (torch >= 2.10), or None.
_CallbackWork = _compat.PythonCallbackWork

#: True where a handle keeps working in C++ once Python has dropped it (torch's
#: ``PythonCallbackWork`` exists). Elsewhere C++ reaches a handle's methods only while its
#: Python object lives: a C++ caller of the group (DDP's reducer) gets it kept alive by torch,
#: but C++ that Python hands a handle to and then drops (DDP's ``join()``) would wait forever.
DETACHABLE = _CallbackWork is not None

_WorkBase = _CallbackWork or torch.distributed.Work
_cpp_future = _WorkBase.get_future  # the C++ half's own future (PythonCallbackWork's)
_cpp_wait = _WorkBase.wait
_NO_TIMEOUT = timedelta(0)

def _seconds(timeout) -> Optional[float]:
    """A ``wait()`` timeout in seconds: None for none (torch's ``timedelta(0)`` means none)."""
    if timeout is None:
        return None
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    return seconds if seconds > 0 else None


def _settled(timeout) -> bool:  # noqa: ARG001 - torch passes the wait's timeout
    """The C++ ``wait()`` of a handle that completed as it started: nothing to wait for."""
    return True


class _Waiter:
    """What a handle's C++ ``wait()`` calls (torch's ``PythonCallbackWork`` callback).

    It refers to the handle only while the operation is in flight, when the engine holds the
    handle anyway: settling clears the reference (C++ holds this object, so a reference kept
    would make a cycle Python cannot collect) and keeps the operation's error instead.
    """

    __slots__ = ("handle", "error")

    def __init__(self, handle: Handle):
        self.handle: Optional[Handle] = handle
        self.error: Optional[BaseException] = None

    def __call__(self, timeout) -> bool:
        """Wait for the operation (at most ``timeout``); False if that passed first."""
        handle = self.handle
        if handle is not None:
            try:
                handle.wait(timeout)
            except WaitTimeout:
                # Not completed yet: an error here would make torch finish the C++ half with it.
                return False
            except BaseException as exc:
                handle._complete_cpp_future(exc)
                raise
            # Before torch marks the C++ half completed (and its future, with no value, if
            # the engine has not settled it yet: a race with the thread that completed it).
            handle._complete_cpp_future(None)
        elif self.error is not None:
            raise self.error
        return True


class Handle(_WorkBase):
    """A collective in flight: torch's ``Work`` (``wait``, ``is_completed``, ``get_future``, ...).

    The engine holds every handle (and so its Pending and every buffer the Pending keeps)
    until the operation completes: dropping a handle changes nothing.

    Args:
        engine: the engine that runs the operation.
        seq: its sequence number.
        op_name: its name in errors and stall reports.
        pending: the communicator's operation.
        ordered: False for point-to-point messages, which complete on their own.
        result: what ``result()`` and the future give: the operation's output tensors.
        done: the operation completed as it started: the handle is born settled.
    """

    __slots__ = ("_engine", "seq", "op_name", "_pending", "_finished", "_done", "_error",
                 "_callbacks", "deadline", "ordered", "covers", "_result", "_waiter", "_future",
                 "source", "_settled", "chained", "start")

    def __init__(self, engine: Engine, seq: int, op_name: str, pending: Pending, ordered: bool = True,
                 result: Sequence = (), done: bool = False):
        # The base's __init__ named, not super()'s lookup: on the path of every collective.
        # A handle born done sets only what is read of a done one (the hot path of torch's
        # asynchronous calls); the rest is read only while in flight, or through getattr.
        self._engine = engine
        self.seq = seq
        self.op_name = op_name
        self._pending = pending
        self._done = done  # the operation and every collective issued before it are done
        self._error: Optional[BaseException] = None
        #: Collectives issued just before this one that it stands for (a coalesced call,
        #: :func:`smddp.comm.algorithms.derived.each`): done when it is, their errors first.
        self.covers: Sequence[Handle] = ()
        self._result = result if result.__class__ is list else list(result)
        #: What C++ sees of it is complete, its future's callbacks have returned (see InFlight._settle).
        self._settled = done
        if done:
            if _CallbackWork is not None:
                _CallbackWork.__init__(self, _settled)
                # Settled as it is made: the C++ future holds the result, the C++ half is completed.
                _cpp_future(self).set_result(self._result)
                _cpp_wait(self, _NO_TIMEOUT)
            else:
                _WorkBase.__init__(self)
            return
        if _CallbackWork is not None:
            self._waiter: Optional[_Waiter] = _Waiter(self)
            _CallbackWork.__init__(self, self._waiter)
        else:
            _WorkBase.__init__(self)
            self._waiter = None
        self._finished = False  # the Pending has completed (or failed): guarded by engine.flight.lock
        self._callbacks: Optional[List[Callable[[Handle], None]]] = []
        self.deadline = time.monotonic() + engine.timeout
        #: Collectives complete in issue order; point-to-point messages (two ranks) do not.
        self.ordered = ordered
        #: Python asked for its future before it settled: its callbacks may start collectives,
        #: which come right after it on every rank (:meth:`Engine.chain <smddp.comm.engine.Engine.chain>`).
        self.chained = False
        #: A collective that waits to start (see :meth:`Engine.run <smddp.comm.engine.Engine.run>`):
        #: ``(start, args, check)``; None once started.
        self.start = None

    # ------------------------------------------------------------------ torch's Work
    def is_completed(self) -> bool:
        """Make progress; True once the operation has finished (or failed)."""
        if not self._done:
            self._engine.flight.poll()
        return self._done

    def wait(self, timeout=None) -> bool:
        """Block until the operation (and every collective issued before it) completes.

        Args:
            timeout: at most this long (a ``timedelta`` or seconds; ``None`` or zero: no
                limit but the process group's timeout). When it passes first, the operation
                stays in flight and a later ``wait()`` may still see it complete.

        Returns:
            True.

        Raises:
            WaitTimeout: ``timeout`` passed before the operation completed.
            CollectiveTimeout: it did not complete within the process group's timeout (the
                job is then broken).
            CollectiveError: it failed.
        """
        if not self._done:  # most small collectives are done as they start
            limit = _seconds(timeout)
            stop = self.deadline if limit is None else min(self.deadline, time.monotonic() + limit)
            block = self._block if getattr(self._pending, "block", None) is not None else None
            try:
                engine = self._engine  # a peer that ended before this collective is found at once
                if not poll(self.is_completed, stop, block,
                            watch=lambda: engine.look_for_ended(self.seq, self.op_name)):
                    if stop < self.deadline:
                        raise WaitTimeout(
                            f"{self.op_name} (sequence number {self.seq}) did not complete within the "
                            f"{limit:g} s this wait() allowed on rank {self._engine.rank}; it is still in "
                            f"flight")
                    # The handle fails itself at its deadline (see advance); past it, it
                    # completes once the collectives issued before it have.
                    poll(self.is_completed, math.inf)
            except KeyboardInterrupt:
                self._engine.interrupted(self.seq, self.op_name)
                raise
        error = self.exception() if self.covers else self._error
        if error is not None:
            raise error
        if self._pending is not DONE:
            self._pending.waited()
        return True

    def is_success(self) -> bool:
        """True once the operation has completed without an error."""
        return self.is_completed() and self.exception() is None

    def exception(self) -> Optional[BaseException]:
        """The error the operation ended with, if any (the first of :attr:`covers` and its own)."""
        for work in self.covers:  # a Handle, or a direct path's Work (comm.base.Communicator.direct)
            error = work.exception()
            if error is not None:
                return error
        return self._error

    def result(self) -> List[torch.Tensor]:
        """The operation's output tensors (valid once it completed)."""
        return self._result

    def get_future(self) -> torch.futures.Future:
        """A future completed with :meth:`result` when the operation completes (raising its error).

        CUDA tensors get a CUDA-aware future, as torch's NCCL ``Work`` gives: it completes when
        the operation is enqueued, with an event recorded after it, so its value is ready for
        every kernel queued after ``wait()`` or in ``then()`` callbacks.
        """
        if getattr(self, "_future", None) is None:
            devices = sorted({t.device for t in self._tensors() if t.is_cuda}, key=str)
            if _CallbackWork is not None and not devices:
                # The C++ half's future, which the engine completes (an error as a _Failed value:
                # see _settle_cpp); raising it from a then() makes it a C++ error once, safely.
                self._future = _cpp_future(self).then(_value_or_raise)
            else:
                self._future = self._own_future(devices)
            if not self._settled:
                self._engine.chain(self)
        return self._future

    def completion(self) -> torch.futures.Future:
        """A future that completes when the handle settles (the profiler's event ends on it)."""
        return _cpp_future(self) if _CallbackWork is not None else self.get_future()

    def _source_rank(self) -> int:
        """A receive's sender (torch's ``recv(src=None)``; set by the receive as ``source``)."""
        self.wait()
        return self.source()

    # ------------------------------------------------------------------ its state, read by the engine
    @property
    def done(self) -> bool:
        """It and every collective issued before it are done, and its done-callbacks have run."""
        return self._done

    @property
    def finished(self) -> bool:
        """Its own operation has completed or failed (those issued before it may not have yet)."""
        return self._finished

    @property
    def error(self) -> Optional[BaseException]:
        """Its own error, None while it has none (:meth:`exception` gives :attr:`covers`' first)."""
        return self._error

    @property
    def pending(self) -> Pending:
        """The communicator's operation (its ``query``, if it has one: a stream-ordered operation)."""
        return self._pending

    @property
    def settled(self) -> bool:
        """What C++ sees of it is complete and its future's callbacks have returned."""
        return self._settled

    # ------------------------------------------------------------------ engine side
    def order_current_stream(self) -> None:
        """Make the calling thread's current CUDA stream wait for a stream-ordered operation.

        Nothing for an operation that completes on the host. The host does not wait.

        Raises:
            CollectiveError: the operation's communicator has failed.
        """
        self._pending.waited()

    def add_done_callback(self, callback: Callable[[Handle], None]) -> None:
        """Call ``callback(handle)`` once the operation has finished, from any thread.

        A callback that raises fails this operation only: the error is reported on stderr
        and :meth:`wait` raises it.
        """
        flight = self._engine.flight
        with flight.lock:
            if not self._done and self._callbacks is not None:
                self._callbacks.append(callback)
                return
        flight.call_back(self, [callback])

    def settle(self) -> None:
        """The operation is done: complete what C++ sees of it (future, completion, error).

        Called once by the engine's work in flight (:mod:`smddp.comm.engine.progress`), outside its lock,
        after the done-callbacks.
        """
        if _CallbackWork is None:
            return
        try:
            self._settle_cpp(self.exception())
        except Exception as exc:  # noqa: BLE001 - never the progress thread's end
            print(f"smddp: settling {self.op_name} (sequence number {self.seq}) failed: {exc!r}", file=sys.stderr)

    def _complete_cpp_future(self, error: Optional[BaseException]) -> None:
        """Complete the C++ half's future with the result (or ``error``), unless it is already."""
        future = _cpp_future(self)
        if not future.done():
            try:
                # An error travels as a value: a Python error that C++ raised from the future (and
                # so from every reader of it) would be raised twice from C++, which ends the process.
                future.set_result(self._result if error is None else _FailedForCpp(error))
            except RuntimeError:  # a C++ wait() in another thread completed it first
                pass

    def _settle_cpp(self, error: Optional[BaseException]) -> None:
        self._complete_cpp_future(error)
        waiter = self._waiter
        if waiter is not None:
            waiter.handle, waiter.error = None, error
        try:
            _cpp_wait(self, _NO_TIMEOUT)  # torch's: calls the waiter, then marks the C++ half completed
        except Exception:  # noqa: BLE001 - the operation's own error, which wait() raises
            pass

    def _tensors(self):
        for item in self._result:
            if isinstance(item, torch.Tensor):
                yield item
            elif isinstance(item, (list, tuple)):
                yield from (t for t in item if isinstance(t, torch.Tensor))

    def _own_future(self, devices) -> torch.futures.Future:
        """A Python future completed by a done-callback (CUDA results; torch without ``PythonCallbackWork``)."""
        future = torch.futures.Future(devices=devices) if devices else torch.futures.Future()
        result = self._result

        def complete(handle: Handle) -> None:
            error = handle.exception()
            if error is None and devices:
                try:
                    # A pool stream, not the completing thread's current one: that may be
                    # the caller's own, which must not wait for the collective.
                    with torch.cuda.stream(torch.cuda.Stream(devices[0])):
                        handle.order_current_stream()
                        future.set_result(result)
                    return
                except Exception as exc:  # noqa: BLE001 - the communicator failed since
                    error = exc
            future.set_result(result if error is None else _Failed(error))

        # Future.set_exception() completes the future with the exception *as its value*,
        # which C++ consumers (DDP's reducer) read as tensors and crash on; an error
        # raised in a then() callback is a real error that they rethrow.
        self.add_done_callback(complete)
        return future.then(_value_or_raise)

    # ------------------------------------------------------------------ transitions the engine makes
    def began(self, pending: Pending) -> None:
        """A collective that waited to start has started: ``pending`` is its operation."""
        self._pending = pending

    def failed_to_start(self, error: BaseException) -> None:
        """Its start failed part-way: done with ``error``; nothing of the library's is left to test."""
        self._pending = DONE
        self._error = error
        self._finished = True

    def never_started(self, error: Optional[BaseException]) -> None:
        """It waited to start and never will (the group was closed or broken, or its deadline passed):
        finished, with ``error``."""
        self._error = error
        self._finished = True

    def mark_settled(self) -> None:
        """What C++ sees of it is complete and its future's callbacks have returned (under the
        engine's start lock)."""
        self._settled = True

    def cancel(self, error: BaseException) -> None:
        """A collective issued before it failed and left the ranks out of step: it fails with ``error``
        (a finished one too: its success no longer counts). Under ``engine.flight.lock``."""
        if self._finished:
            self._error = error
        else:
            self._finish_failed(error)

    def take_callbacks(self) -> List[Callable[[Handle], None]]:
        """Its done-callbacks, to run now it has finished; a callback added from now on runs at once.
        Under ``engine.flight.lock``."""
        callbacks, self._callbacks = self._callbacks, None
        return callbacks

    def callback_failed(self, error: BaseException) -> None:
        """A done-callback raised: the operation fails with ``error`` unless it had failed already."""
        if self._error is None:
            self._error = error

    def mark_done(self) -> None:
        """It and every collective issued before it are done, and its done-callbacks have run."""
        self._done = True

    def abandon(self, error: BaseException) -> None:
        """Its group is destroyed with it in flight: done, with its own error or else ``error``, and
        settled, so that a wait on it (from C++ too) raises instead of waiting for ever."""
        self._error = self._error or error
        self._finished = self._done = True
        self.settle()

    def _block(self, seconds: float) -> None:
        if self._finished:
            # Only the collectives issued before this one are left: is_completed advances them.
            time.sleep(0)
        else:
            self._pending.block(seconds)

    def advance(self, now: float) -> None:
        """Test the Pending once; fail it past its deadline. Under the lock of the work in flight."""
        try:
            if self._pending.test():
                self._finished = True
                return
        except Exception as exc:  # noqa: BLE001 - surfaced by wait()
            self._finish_failed(self._engine.failure(exc, self))
            return
        if now > self.deadline:
            self._finish_failed(self._engine.stalled(self.seq, self.op_name))

    def _finish_failed(self, error: BaseException) -> None:
        self._error = error
        self._finished = True
        # The library may still hold the buffers' addresses: they live as long as the engine.
        self._engine.flight.hold(self._pending)


class _Failed:
    """The value a handle's future carries when the operation failed."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException):
        self.error = error


class _FailedForCpp(_Failed):
    """The value of the C++ half's own future when the operation failed (:meth:`Handle._complete_cpp_future`).

    C++ reads that future's value itself: DDP's reducer without a communication hook takes the
    bucket's tensors from it (``parseCppCommHookResult``), by pickling a Python value
    (``torch._jit_internal._extract_tensors``). Pickling this one raises the error, so ``backward()``
    raises it, where a value without tensors ended the process (a segmentation fault in the
    reducer). A CUDA-aware future pickles its value as it is completed: it gets a :class:`_Failed`.
    """

    __slots__ = ()

    def __reduce__(self):
        raise self.error


def _value_or_raise(future: torch.futures.Future):
    value = future.value()
    if isinstance(value, _Failed):
        raise value.error
    return value
