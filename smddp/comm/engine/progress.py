"""The engine's work in flight: owned, advanced, completed in issue order, drained.

:class:`InFlight` is a part that :class:`~smddp.comm.engine.Engine` holds (``engine.flight``) and
that owns its state: every asynchronous operation until it completes (the list in flight), the
pass that completes them in issue order and runs their callbacks, the operations whose device has
still to finish them, what a failed operation leaves held, help from a thread about to wait
(:meth:`InFlight.finish`), and the drain at teardown. One progress thread per process
(:class:`Service`) passes over the work in flight of every engine that has some, and one set of
completion threads (:mod:`smddp.comm.engine.completer`) completes it: a group adds no thread of its
own (jobs make hundreds of groups).
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
#: At most this long between polls when only devices' operations are left (see Service._run).
_DEVICE_POLL_MAX = 2e-4
_yield_cpu = getattr(os, "sched_yield", None) or (lambda: time.sleep(0))
#: Seconds an operation waits, on the progress thread alone, before the thread asks whether a rank of
#: its group has ended (and again each time this long passes).
LOOK_AFTER = 1.0


class Service:
    """The process's one progress thread: it advances the work in flight of every engine.

    An engine's work in flight (:class:`InFlight`, a "work" here) joins when it has some
    (:meth:`wake`, after it appended under its own lock); the thread passes over the works that
    have joined, each under its own lock, and lets one go once it has nothing in flight or on a
    device, checked under the service's lock, so that a work that starts an operation meanwhile is
    never left out. Lock order: the service's, then a work's; a work never holds its own while it
    calls in here.
    """

    def __init__(self):
        self._cv = threading.Condition()
        self._works: List[InFlight] = []
        self._current: Optional[InFlight] = None  # the work the thread is passing over now
        self._thread: Optional[threading.Thread] = None
        self._open = 0  # works made (engines) and not yet closed: the thread ends once none is left

    def attach(self, work: InFlight) -> None:
        """``work`` is made (an engine): the thread, once started, lives until every work attached is closed."""
        with self._cv:
            self._open += 1

    def wake(self, work: InFlight) -> None:
        """``work`` has operations in flight: pass over it until it has none (starting the thread at first)."""
        with self._cv:
            if work not in self._works:
                self._works.append(work)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="smddp-progress", daemon=True)
                self._thread.start()
            self._cv.notify_all()

    def forget(self, work: InFlight) -> None:
        """Stop passing over ``work`` (closing, once): returns once the thread is not inside it, and,
        if it was the last one open, once the thread has ended (a destroyed group leaves no thread)."""
        with self._cv:
            if work in self._works:
                self._works.remove(work)
            while self._current is work:
                self._cv.wait(1.0)
            self._open = max(0, self._open - 1)
            ending = self._thread if self._open == 0 and not self._works else None
            if ending is not None:
                self._thread = None
                self._cv.notify_all()
        if ending is not None and ending is not threading.current_thread():
            ending.join(5.0)
        if ending is not None:
            COMPLETER.trim()  # and the idle completion threads

    def serves(self, work: InFlight) -> bool:
        """True while the thread passes over ``work``."""
        with self._cv:
            return work in self._works

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
                    if self._works:
                        break
                    self._cv.wait()
                    pause = _HOST_POLL
                works = list(self._works)
            backing_off = True
            for work in works:
                with self._cv:
                    if work not in self._works:
                        continue
                    self._current = work
                failed = False
                try:
                    device_only = work.advance()
                except Exception:  # one engine's fault must not stop every group's progress
                    failed, device_only = True, True
                    print(f"smddp: the progress thread let go of an engine's work that raised (its waits still "
                          f"advance it):\n{traceback.format_exc()}", file=sys.stderr)
                finally:
                    with self._cv:
                        self._current = None
                        # forget() may have let it go while the thread was inside it
                        if work in self._works and (failed or work.idle()):
                            self._works.remove(work)
                        self._cv.notify_all()
                backing_off = backing_off and device_only
            pause = min(2 * pause, _DEVICE_POLL_MAX) if backing_off else _HOST_POLL
            time.sleep(pause)


#: The process's progress thread, which every engine shares.
SERVICE = Service()


class InFlight:
    """The engine's work in flight: every asynchronous operation, owned until done, completed in issue order.

    A part that :class:`~smddp.comm.engine.Engine` holds (``engine.flight``), with state of its own:

    - :attr:`handles`, the operations in flight, in issue order;
    - the operations done for the host whose device has still to finish them (the list on the device,
      see :meth:`settle`);
    - what is held for as long as the engine lives (:meth:`hold`): the Pendings of operations that
      failed, timed out or were interrupted while the library may still hold their buffers;
    - the lock that guards them and their handles' state (:attr:`lock`);
    - its link to the process's progress thread (:data:`SERVICE`) and the completion threads
      (:attr:`completer`).

    The engine starts operations and hands them over (:meth:`track`); the progress thread, and any
    thread about to wait (:meth:`poll`, :meth:`finish`), advance them; :meth:`drain` and
    :meth:`close` end them at teardown.

    Args:
        rank: the engine's rank, named in errors.
        settled: called with each handle once what C++ sees of it has completed
            (:meth:`Engine.settled <smddp.comm.engine.Engine.settled>`), outside the lock.
        completed: called after a pass has completed operations (the engine forgets the caller's
            latest Work once it is done).
        waiting: the engine's collectives waiting to start (its queue, which it alone changes):
            :meth:`drain` waits for them too.
        expire: ``expire(now)`` fails those of ``waiting`` past their deadline; each pass calls it
            while any waits.
        look: ``look(seq, op_name)`` raises :class:`~smddp.errors.CollectiveError` if a rank of the group
            ended before collective ``seq`` (:meth:`Health.look_for_ended
            <smddp.comm.engine.health.Health.look_for_ended>`); the progress thread asks it once the oldest
            collective in flight has waited :data:`LOOK_AFTER` seconds, and each :data:`LOOK_AFTER` after.
    """

    def __init__(self, rank: int, settled: Callable[[Handle], None], completed: Callable[[], None],
                 waiting: Deque[Handle], expire: Callable[[float], None],
                 look: Optional[Callable[[int, str], None]] = None):
        self.rank = rank
        #: Every asynchronous operation started and not yet done, in issue order. A pass of
        #: :meth:`poll` replaces the list rather than change it, so a reader without the lock (the
        #: engine's direct-path gate) sees one whole list.
        self.handles: List[Handle] = []
        #: Guards :attr:`handles`, the list on the device and the state of their handles, and lets one
        #: thread at a time test Pendings (a handle adds its done-callbacks under it).
        self.lock = threading.Condition()
        #: The process's completion threads, which every engine shares.
        self.completer: Completer = COMPLETER
        self._on_device: List[Handle] = []  # done for the host; their device has still to finish them
        self._held: List[object] = []  # kept alive as long as the engine (hold)
        self._settled = settled
        self._completed = completed
        self._waiting = waiting
        self._expire = expire
        self._look = look
        self._oldest = 0  # the sequence number of the oldest collective in flight at the last pass
        self._next_look = 0.0  # when the progress thread asks look() about it
        SERVICE.attach(self)  # the process's progress thread lives while an engine is open

    def track(self, handle: Handle) -> Handle:
        """Own ``handle`` until it completes; the process's progress thread advances it meanwhile."""
        with self.lock:
            self.handles.append(handle)
            self.lock.notify()
        SERVICE.wake(self)
        return handle

    def hold(self, thing: object) -> None:
        """Keep ``thing`` alive as long as the engine: the Pending of an operation that failed, timed
        out or was interrupted, whose library may still write into its buffers (or the error of a
        start that failed part-way, whose traceback's frames hold them)."""
        self._held.append(thing)

    def idle(self) -> bool:
        """Nothing in flight or on a device here (the progress thread may let it go)."""
        with self.lock:
            return not self.handles and not self._on_device

    def poll(self, inline: bool = True) -> None:
        """Advance every operation in flight once; complete them in issue order.

        Every Pending is tested on each pass, so a ring whose handle nobody holds keeps
        posting its stages. A collective is done once its Pending is and every collective
        issued before it is done; once one fails, the collectives after it fail too (the ranks
        are no longer in step), unless it failed by a mismatch, which every rank saw. Callbacks
        run after the lock is released, in issue order; then each handle is settled (what C++
        sees of it completes: :meth:`_settle`).

        ``inline``: the calling thread runs the callbacks and settles (a thread about to wait);
        the progress thread passes False and hands them to the completion threads
        (:mod:`smddp.comm.engine.completer`), so that a callback that waits never stops it.
        """
        if self._waiting:
            self._expire(time.monotonic())
        finished: List[Handle] = []
        callbacks: List[List[Callable[[Handle], None]]] = []
        settled: List[Handle] = []  # done, no callbacks to run
        with self.lock:
            if not self.handles:
                return
            now = time.monotonic()
            keep: List[Handle] = []
            blocked: Optional[Handle] = None  # the earliest collective not yet done
            failed: Optional[Handle] = None  # the earliest that failed and left the ranks out of step
            for handle in self.handles:
                if failed is not None and handle.ordered and handle.error is None:
                    # Also one whose own Pending finished first (a library's requests may
                    # complete out of order): after `failed` the ranks are out of step.
                    cancelled = CollectiveError(
                        f"{handle.op_name} (sequence number {handle.seq}) was cancelled on rank "
                        f"{self.rank}: {failed.op_name} (sequence number {failed.seq}), issued "
                        f"before it, failed: {failed.error}")
                    cancelled.__cause__ = failed.error
                    handle.cancel(cancelled)
                elif not handle.finished:
                    handle.advance(now)
                if not handle.ordered or blocked is None:
                    if handle.finished:
                        error = handle.error
                        # A mismatch leaves the ranks in step: what follows it runs.
                        if (handle.ordered and error is not None and failed is None
                                and not isinstance(error, CollectiveMismatchError)):
                            failed = handle
                        calls = handle.take_callbacks()
                        if calls:
                            finished.append(handle)  # done once its callbacks have run
                            callbacks.append(calls)
                        else:
                            handle.mark_done()
                            settled.append(handle)
                        continue
                    if handle.ordered:
                        blocked = handle
                keep.append(handle)
            self.handles = keep
        if not finished and not settled:
            return
        if inline:
            with completion():
                self._complete(finished, callbacks, settled)
        else:
            self.completer.submit(lambda: self._complete(finished, callbacks, settled))

    def _complete(self, finished: List[Handle], callbacks: list, settled: List[Handle]) -> None:
        """Run the done-callbacks of ``finished`` and settle every handle, in issue order."""
        for handle, calls in zip(finished, callbacks):
            self.call_back(handle, calls)
            # Done only now: a wait() that returns has seen a raising callback's error.
            handle.mark_done()
            self._settle(handle)
        for handle in settled:
            self._settle(handle)
        self._completed()

    def _settle(self, handle: Handle) -> None:
        """Complete what C++ sees of ``handle``, done: its future and its completion.

        A stream-ordered operation (NCCL) is done as it is enqueued, and its C++ future carries no
        CUDA events for a reader's stream to wait on: that half is settled once the device has
        finished the operation, which the progress thread polls (:meth:`_settle_on_device`).
        """
        if handle.pending.query is None:
            handle.settle()
            self._settled(handle)
            return
        with self.lock:
            self._on_device.append(handle)
            self.lock.notify()

    def _settle_on_device(self) -> List[Handle]:
        """The stream-ordered handles whose device has finished them, taken off the list on the device.

        The caller (the progress thread) has them settled (:meth:`Handle.settle`) off its own thread.
        """
        with self.lock:
            waiting, self._on_device = self._on_device, []
        later, finished = [], []
        for handle in waiting:
            try:
                done = handle.pending.query()
            except Exception:  # noqa: BLE001 - the communicator failed: its waits raise that
                done = True
            (finished if done else later).append(handle)
        if later:
            with self.lock:
                self._on_device[:0] = later
        return finished

    def _settle_all(self, handles: List[Handle]) -> None:
        """Settle stream-ordered ``handles`` that their device has finished (a completion job)."""
        for handle in handles:
            handle.settle()
            self._settled(handle)

    def on_stream(self) -> bool:
        """True while a stream-ordered operation is in flight (a device communicator's: an engine has
        one per device type, and only a device's is stream-ordered). Reads :attr:`handles` without
        the lock: a pass replaces the list, never changes it."""
        for handle in self.handles:
            if handle.pending.query is not None:
                return True
        return False

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
            if not poll(handle.is_completed, give_up, getattr(handle.pending, "block", None), _yield_cpu):
                return False
        return True

    def call_back(self, handle: Handle, callbacks: List[Callable[[Handle], None]]) -> None:
        """Run ``handle``'s done-``callbacks``; one that raises fails the operation, reported on stderr."""
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

    def advance(self) -> bool:
        """One pass of the progress thread over this work; True if only stream-ordered operations,
        waiting for their device, are left (the thread may back off)."""
        self.poll(inline=False)
        handles = self.handles
        if handles and self._look is not None:
            self._look_for_ended(handles[0])
        settled = self._settle_on_device() if self._on_device else ()
        if settled:
            self.completer.submit(lambda settled=settled: self._settle_all(settled))
        return bool(self._on_device) and not self.handles and not settled

    def _look_for_ended(self, oldest: Handle) -> None:
        """Fail ``oldest`` now if a rank of the group ended before it (it would never complete).

        A caller's own wait looks once a second (:func:`smddp.comm.waiting.poll`'s ``watch``); an
        operation that only C++ waits for (DDP's reducer without smddp's hook, a future's ``wait()``)
        is completed by the progress thread, which looks for it: once the oldest collective in flight
        has waited :data:`LOOK_AFTER` seconds, and each :data:`LOOK_AFTER` after (one store read).
        Those after it fail in issue order at the next pass.
        """
        if not oldest.ordered:
            return
        now = time.monotonic()
        if oldest.seq != self._oldest:  # its number, not the handle: a done Work is let go (C++ may keep it)
            self._oldest, self._next_look = oldest.seq, now + LOOK_AFTER
            return
        if now < self._next_look:
            return
        self._next_look = now + LOOK_AFTER
        try:
            self._look(oldest.seq, oldest.op_name)
        except CollectiveError as exc:
            with self.lock:
                if not oldest.finished:
                    oldest.cancel(exc)

    def drain(self) -> bool:
        """Wait for every operation in flight or waiting to start, each within its deadline;
        True if all completed and nothing is held (:meth:`hold`)."""
        while True:
            with self.lock:
                if not self.handles and not self._waiting:
                    return not self._held
                last = self.handles[-1] if self.handles else self._waiting[-1]
            try:
                last.wait()
            except CollectiveError as exc:
                print(f"smddp: rank {self.rank}: at teardown: {exc}", file=sys.stderr)

    def close(self, never_started: Sequence[Handle], error: Callable[[Handle], BaseException]) -> None:
        """Let go of the work (the engine closes, after :meth:`drain`).

        Every operation still in flight, and ``never_started`` (collectives that waited to start),
        ends with its own error or else ``error(handle)``, settled, so that a wait on it (from C++
        too) raises instead of waiting for ever; the Pendings of those in flight are held. Then the
        progress thread lets this go, and what waited for its device is settled (the communicators
        are drained or failed: nothing to wait for).
        """
        with self.lock:
            abandoned, self.handles = self.handles, []
            self._held.extend(handle.pending for handle in abandoned)
            self.lock.notify_all()
        for handle in [*abandoned, *never_started]:
            handle.abandon(error(handle))
        SERVICE.forget(self)  # the process's progress thread is not inside this from now on
        with self.lock:
            on_device, self._on_device = self._on_device, []
        for handle in on_device:
            handle.settle()
