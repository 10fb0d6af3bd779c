"""The engine's operations in flight: owned, advanced, completed in issue order, drained.

:class:`Progress` is the part of :class:`~smddp.comm.engine.Engine` that keeps every
asynchronous operation until it completes: the list in flight, the pass that completes them in
issue order and runs their callbacks, help from a thread about to wait (:meth:`Progress.finish`),
and the drain at teardown. One progress thread per process (:class:`Service`) tests the operations
in flight of every engine that has some, and one set of completion threads
(:mod:`smddp.comm.engine.completer`) completes them: a group adds no thread of its own (jobs make
hundreds of groups).
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from typing import Callable, Deque, List, Optional, Sequence

from smddp.comm.engine.completer import COMPLETER, Completer, completion
from smddp.comm.engine.handle import Handle
from smddp.comm.waiting import poll
from smddp.errors import CollectiveError, CollectiveMismatchError

#: Seconds between the progress thread's polls of operations the host moves.
_HOST_POLL = 2e-5
#: At most this long between polls when only devices' operations are left (see _progress).
_DEVICE_POLL_MAX = 2e-4
_yield_cpu = getattr(os, "sched_yield", None) or (lambda: time.sleep(0))


class Service:
    """The process's one progress thread: it advances the operations in flight of every engine.

    An engine with work joins (:meth:`wake`, after it appended under its own lock); the thread
    passes over the engines that have joined, each under its own lock, and lets an engine go once
    it has nothing in flight or on a device, checked under the service's lock, so that an engine
    that starts an operation meanwhile is never left out. Lock order: the service's, then an
    engine's; an engine never holds its own while it calls in here.
    """

    def __init__(self):
        self._cv = threading.Condition()
        self._engines: List[Progress] = []
        self._current: Optional[Progress] = None  # the engine the thread is passing over now
        self._thread: Optional[threading.Thread] = None
        self._open = 0  # engines made and not yet closed: the thread ends once none is left

    def attach(self, engine: Progress) -> None:
        """``engine`` is made: the thread, once started, lives until every engine attached is closed."""
        with self._cv:
            self._open += 1

    def wake(self, engine: Progress) -> None:
        """``engine`` has work in flight: pass over it until it has none (starting the thread at first)."""
        with self._cv:
            if engine not in self._engines:
                self._engines.append(engine)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="smddp-progress", daemon=True)
                self._thread.start()
            self._cv.notify_all()

    def forget(self, engine: Progress) -> None:
        """Stop passing over ``engine`` (closing, once): returns once the thread is not inside it, and,
        if it was the last engine open, once the thread has ended (a destroyed group leaves no thread)."""
        with self._cv:
            if engine in self._engines:
                self._engines.remove(engine)
            while self._current is engine:
                self._cv.wait(1.0)
            self._open = max(0, self._open - 1)
            ending = self._thread if self._open == 0 and not self._engines else None
            if ending is not None:
                self._thread = None
                self._cv.notify_all()
        if ending is not None and ending is not threading.current_thread():
            ending.join(5.0)
        if ending is not None:
            COMPLETER.trim()  # and the idle completion threads

    def serves(self, engine: Progress) -> bool:
        """True while the thread passes over ``engine``."""
        with self._cv:
            return engine in self._engines

    def _run(self) -> None:
        """Advance every engine's operations in flight while the callers compute.

        Operations the host still moves are polled every 20 us. Once only stream-ordered ones
        are left (waiting for their device to finish them, to settle what C++ sees), the polls
        back off to ``_DEVICE_POLL_MAX``: a GPU step keeps several in flight for its whole
        backward, and each poll takes the GIL from the thread launching its kernels.
        """
        pause = _HOST_POLL
        me = threading.current_thread()
        while True:
            with self._cv:
                while True:
                    if self._thread is not me:  # the last engine closed (forget): end
                        return
                    if self._engines:
                        break
                    self._cv.wait()
                    pause = _HOST_POLL
                engines = list(self._engines)
            backing_off = True
            for engine in engines:
                with self._cv:
                    if engine not in self._engines:
                        continue
                    self._current = engine
                failed = False
                try:
                    device_only = engine._progress_once()
                except Exception:  # one engine's fault must not stop every group's progress
                    failed, device_only = True, True
                    print(f"smddp: the progress thread let go of an engine that raised (its waits still "
                          f"advance it):\n{traceback.format_exc()}", file=sys.stderr)
                finally:
                    with self._cv:
                        self._current = None
                        # forget() may have let it go while the thread was inside it
                        if engine in self._engines and (failed or engine._idle()):
                            self._engines.remove(engine)
                        self._cv.notify_all()
                backing_off = backing_off and device_only
            pause = min(2 * pause, _DEVICE_POLL_MAX) if backing_off else _HOST_POLL
            time.sleep(pause)


#: The process's progress thread, which every engine shares.
SERVICE = Service()


class Progress:
    """Operations in flight of an engine; :class:`~smddp.comm.engine.Engine` inherits it."""

    rank: int
    _closed: bool
    _cv: threading.Condition
    _inflight: List[Handle]
    _on_device: List[Handle]
    _abandoned: List[object]
    _last_handle: Optional[Handle]
    _done_seq: int
    _completer: Completer
    _deferred: Deque[Handle]

    def _track(self, handle: Handle) -> Handle:
        """Own ``handle`` until it completes; the process's progress thread advances it meanwhile."""
        with self._cv:
            self._inflight.append(handle)
            self._cv.notify()
        SERVICE.wake(self)
        return handle

    def _idle(self) -> bool:
        """Nothing in flight or on a device here (the progress thread may let it go)."""
        with self._cv:
            return not self._inflight and not self._on_device

    def _poll(self, inline: bool = True) -> None:
        """Advance every operation in flight once; complete them in issue order.

        Every Pending is tested on each pass, so a ring whose handle nobody holds keeps
        posting its stages. A collective is done once its Pending is and every collective
        issued before it is done; once one fails, the collectives after it fail too (the ranks
        are no longer in step), unless it failed by a mismatch, which every rank saw. Callbacks
        run after the lock is released, in issue order; then each handle is settled (what C++
        sees of it completes: :meth:`_settle`).

        ``inline``: the calling thread runs the callbacks and settles (a thread about to wait);
        the progress thread passes False and hands them to the engine's completion threads
        (:mod:`smddp.comm.engine.completer`), so that a callback that waits never stops it.
        """
        if self._deferred:
            self._expire_deferred(time.monotonic())
        finished: List[Handle] = []
        settled: List[Handle] = []  # done, no callbacks to run
        with self._cv:
            if not self._inflight:
                return
            now = time.monotonic()
            keep: List[Handle] = []
            blocked: Optional[Handle] = None  # the earliest collective not yet done
            failed: Optional[Handle] = None  # the earliest that failed and left the ranks out of step
            for handle in self._inflight:
                if failed is not None and handle.ordered and handle._error is None:
                    # Also one whose own Pending finished first (a library's requests may
                    # complete out of order): after `failed` the ranks are out of step.
                    cancelled = CollectiveError(
                        f"{handle.op_name} (sequence number {handle.seq}) was cancelled on rank "
                        f"{self.rank}: {failed.op_name} (sequence number {failed.seq}), issued "
                        f"before it, failed: {failed._error}")
                    cancelled.__cause__ = failed._error
                    handle.cancel(cancelled)
                elif not handle._finished:
                    handle._advance(now)
                if not handle.ordered or blocked is None:
                    if handle._finished:
                        error = handle._error
                        # A mismatch leaves the ranks in step: what follows it runs.
                        if (handle.ordered and error is not None and failed is None
                                and not isinstance(error, CollectiveMismatchError)):
                            failed = handle
                        if handle._callbacks:
                            finished.append(handle)  # done once its callbacks have run
                        else:
                            handle.mark_done()
                            settled.append(handle)
                        continue
                    if handle.ordered:
                        blocked = handle
                keep.append(handle)
            self._inflight = keep
            callbacks = [handle.take_callbacks() for handle in finished]
        if not finished and not settled:
            return
        if inline:
            with completion():
                self._complete(finished, callbacks, settled)
        else:
            self._completer.submit(lambda: self._complete(finished, callbacks, settled))

    def _complete(self, finished: List[Handle], callbacks: list, settled: List[Handle]) -> None:
        """Run the done-callbacks of ``finished`` and settle every handle, in issue order."""
        for handle, calls in zip(finished, callbacks):
            self._call_back(handle, calls)
            # Done only now: a wait() that returns has seen a raising callback's error.
            handle.mark_done()
            self._settle(handle)
        for handle in settled:
            self._settle(handle)
        latest = self._last_handle
        if latest is not None and latest._done and self._last_handle is latest:
            self._last_handle, self._done_seq = None, max(self._done_seq, latest.seq)  # forget the caller's Work

    def _settle(self, handle: Handle) -> None:
        """Complete what C++ sees of ``handle``, done: its future and its completion.

        A stream-ordered operation (NCCL) is done as it is enqueued, and its C++ future carries no
        CUDA events for a reader's stream to wait on: that half is settled once the device has
        finished the operation, which the progress thread polls (:meth:`_settle_on_device`).
        """
        if handle._pending.query is None:
            handle._settle()
            self.settled(handle)
            return
        with self._cv:
            self._on_device.append(handle)
            self._cv.notify()

    def _settle_on_device(self) -> List[Handle]:
        """The stream-ordered handles whose device has finished them, taken off the list on the device.

        The caller (the progress thread) has them settled (:meth:`Handle._settle`) off its own thread.
        """
        with self._cv:
            waiting, self._on_device = self._on_device, []
        later, finished = [], []
        for handle in waiting:
            try:
                done = handle._pending.query()
            except Exception:  # noqa: BLE001 - the communicator failed: its waits raise that
                done = True
            (finished if done else later).append(handle)
        if later:
            with self._cv:
                self._on_device[:0] = later
        return finished

    def _settle_all(self, handles: List[Handle]) -> None:
        """Settle stream-ordered ``handles`` that their device has finished (a completion job)."""
        for handle in handles:
            handle._settle()
            self.settled(handle)

    def finish(self, handles: Sequence[Handle], seconds: float) -> bool:
        """Help ``handles`` complete in this thread for at most ``seconds``; True if all did.

        For a caller that is about to block on them anyway (DDP's reducer at the end of
        backward): a communicator that moves data only while a thread calls into it
        (:attr:`~smddp.comm.base.Communicator.progresses_in_caller`) otherwise waits for the
        progress thread's wake-ups, whole scheduler slices on a busy CPU. The thread yields
        the CPU between tests; an operation that completes on a thread of its own is slept
        on instead. Past ``seconds`` the progress thread completes the rest as usual.
        """
        give_up = time.monotonic() + seconds
        for handle in handles:
            if not poll(handle.is_completed, give_up, getattr(handle._pending, "block", None), _yield_cpu):
                return False
        return True

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
                handle.callback_failed(error)

    def _progress_once(self) -> bool:
        """One pass of the progress thread over this engine; True if only stream-ordered operations,
        waiting for their device, are left (the thread may back off)."""
        self._poll(inline=False)
        settled = self._settle_on_device() if self._on_device else ()
        if settled:
            self._completer.submit(lambda settled=settled: self._settle_all(settled))
        return bool(self._on_device) and not self._inflight and not settled

    def _drain(self) -> bool:
        """Wait for every operation in flight or waiting to start, each within its deadline;
        True if all completed."""
        while True:
            with self._cv:
                if not self._inflight and not self._deferred:
                    return not self._abandoned
                last = self._inflight[-1] if self._inflight else self._deferred[-1]
            try:
                last.wait()
            except CollectiveError as exc:
                print(f"smddp: rank {self.rank}: at teardown: {exc}", file=sys.stderr)
