"""Deadlines for NCCL operations, which the host does not wait for.

An NCCL call returns once the operation is enqueued on a CUDA stream, and waiting on it
only orders the caller's stream after it (torch's NCCL ``Work.wait()`` does the same), so
a collective whose peer never arrives stalls the GPU, not the host. A :class:`Watchdog`,
one thread per communicator as in torch's ProcessGroupNCCL, polls the CUDA event recorded
after each operation against the operation's deadline. An operation is watched from
*before* its NCCL call: a call that blocks the host (NCCL connects to peers lazily, inside
the first operation with each) expires like a stalled kernel.

Each record (a list: :data:`SEQ` says what it holds) also holds every tensor the operation's
stream reads or writes (:data:`HELD`) until
its event completes, as torch's NCCL group stashes them: a tensor the caller drops meanwhile
is not handed back to the caching allocator while NCCL still uses its memory. An operation on
the caller's own current stream holds nothing: the allocator orders reuse on that stream. A
``wait()`` lets go earlier, as torch's unstashes: the caller's stream then waits for the
operation (:class:`~smddp.comm.backends.nccl.direct.StreamWork`). A look lets go of what every
completed record holds, on every stream, not only of the records before the oldest one in flight.

The callers' path takes no lock: a record is appended to a deque, which only the watchdog's
thread pops. The thread looks at the oldest records only: it takes the completed ones off in
order and reads the deadline of the oldest one left (a later operation started later, so its
deadline is later); it queries events holding no lock.

A look queries one event per stream, not one per operation: a record names its stream, and
the thread first asks the newest record of each stream; once that one is complete, every
record made before it on the same stream is too (a stream runs its work in order), and is
taken off unasked. This holds because callers make records and record their events one
operation at a time (the engine's start lock), so on one stream records are numbered in the
order their events were recorded. A record with no stream is asked itself. Thousands of small
collectives between two looks then cost the thread two queries, not thousands.

Every event comes from a pool (:meth:`Watchdog.event`), as torch's NCCL group takes its events
from a cache, and goes back to it once its record has completed and nothing else refers to it
(the collective's ``Work``, a general-path operation): the thread counts the references, as
torch's cache returns an event when the last shared pointer to it goes.

An operation enqueued during a CUDA graph capture is not watched (as torch's are not): its
event would not be a real one. The thread sets its CUDA capture mode to *relaxed* when it
starts (:func:`relax_capture_mode`), so that its queries of events recorded before a capture
never invalidate another thread's capture in torch's default (global) mode, where torch's own
watchdog makes the capture wait until it has nothing left to query.

The thread sets its CUDA device (:attr:`Watchdog.device`) before it looks at an event, so it
makes no CUDA context on another GPU.

On the first deadline that passes, or the first asynchronous error NCCL reports, the
watchdog calls ``expire(watched, error)`` once and stops: the communicator decides what
follows (:mod:`smddp.comm.backends.nccl.failures`).
"""

from __future__ import annotations

import collections
import ctypes
import itertools
import sys
import threading
import time
from typing import Any, Callable, Deque, Dict, List, Optional

import torch

#: Seconds between two looks at the operations in flight (torch's watchdog: 0.1 s).
POLL = 0.05
#: At most this many idle events are kept for reuse.
POOL = 4096
#: The shortest time between two looks, in seconds: while callers make records faster than
#: :data:`POOL` in :data:`POLL` (thousands of small collectives a second), the thread looks as often
#: as keeps half the pool's events coming back before the callers need them (:meth:`Watchdog._pause`).
BUSY_POLL = 0.002

_monotonic = time.monotonic


def _references(items: list) -> List[int]:
    """How many references each of ``items`` has, counted the same way for every caller."""
    return [sys.getrefcount(item) for item in items]


#: What :func:`_references` counts for an object that only its list refers to.
_UNSHARED = _references([object()])[0]

#: ``CU_STREAM_CAPTURE_MODE_RELAXED`` (cuda.h's ``CUstreamCaptureMode``).
_RELAXED = 2
_relaxed = threading.local()


def relax_capture_mode() -> bool:
    """Let the calling thread query CUDA events while another thread captures a CUDA graph.

    In CUDA's default (global) capture mode, an event query from any thread during a capture is
    an error that invalidates the capture; a thread in *relaxed* mode may query events (recorded
    outside any capture) meanwhile. Done once per thread, through the CUDA driver's
    ``cuThreadExchangeStreamCaptureMode`` (the driver is shared by every CUDA runtime in the
    process: torch's and CuPy's).

    Returns:
        True if the thread is in relaxed mode (False where no CUDA driver is found).
    """
    done = getattr(_relaxed, "done", None)
    if done is None:
        try:
            driver = ctypes.CDLL("libcuda.so.1")
            mode = ctypes.c_int(_RELAXED)
            done = driver.cuThreadExchangeStreamCaptureMode(ctypes.byref(mode)) == 0
        except (OSError, AttributeError):
            done = False
        _relaxed.done = done
    return done


#: The record of one NCCL operation under a deadline is a list, indexed by these (a list costs a
#: quarter of an object with these seven attributes, on the path of every NCCL call):
#:
#: - ``SEQ``: the collective's sequence number; ``OP_NAME``: what was called;
#: - ``DEADLINE``: ``time.monotonic()`` by which it must complete;
#: - ``EVENT``: the CUDA event recorded after it; None while its NCCL call has not returned;
#: - ``HELD``: what its stream uses (tensors, and the steps queued after it), kept until ``EVENT``
#:   completes or a wait orders the caller's stream after it;
#: - ``STREAM``: the key of the stream ``EVENT`` is recorded on (hashable), or None;
#: - ``N``: the record's number: records are numbered in the order they are made.
SEQ, OP_NAME, DEADLINE, EVENT, HELD, STREAM, N = range(7)
#: A record (see :data:`SEQ` and the rest).
Watched = list


def record(seq: int, op_name: str, deadline: float, held: Any = (), stream: Any = None, n: int = 0) -> Watched:
    """A record of an operation whose event is not recorded yet."""
    return [seq, op_name, deadline, None, held, stream, n]


class Watchdog:
    """Polls the operations of one NCCL communicator against their deadlines.

    Args:
        timeout: seconds each operation may take, from its start.
        expire: ``expire(watched, error)``, called once from the watchdog's thread: the
            deadline of ``watched`` passed (``error`` None) or ``check()`` raised ``error``.
        check: raises NCCL's asynchronous error, if any (a peer died).
        name: the thread's name.
    """

    def __init__(self, timeout: float, expire: Callable[[Watched, Optional[BaseException]], None],
                 check: Callable[[], None], name: str = "smddp-nccl-watchdog"):
        self.timeout = timeout
        self._expire, self._check, self._name = expire, check, name
        #: Operations in flight, oldest first: callers append, only the thread pops.
        self._inflight: Deque[Watched] = collections.deque()
        self._wake = threading.Event()
        self._idle = False
        self._passed = threading.Condition()  # notified after each look (drain() waits on it)
        self._start_lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None
        self._stopped = False
        self._expiring = False  # expire() is running: drain() waits for its abort to finish
        self.expired = False
        #: Events of completed operations, for :meth:`event`; those something may still refer to.
        self.free: List[Any] = []
        self._lent: List[Any] = []
        #: Stream key to the newest record made on that stream (see the module docstring).
        self._newest: Dict[Any, Watched] = {}
        self._numbers = itertools.count(1)
        self._taken = 0  # records the latest look took off
        #: The CUDA device index the thread sets before it looks at events (None: leave it).
        self.device: Optional[int] = None

    # ------------------------------------------------------------------ the callers' side
    def start(self, seq: int, op_name: str, held: Any = (), stream: Any = None) -> Watched:
        """Watch an operation about to be enqueued; set the record's :data:`EVENT` once it is.

        Make one operation's record and record its event before the next one's (the engine's
        start lock does).

        Args:
            seq: its sequence number.
            op_name: its name, for the error.
            held: what its stream uses, kept until its event completes.
            stream: the key of the stream its event will be recorded on (a look then asks only
                the newest record of that stream), or None (its own event is asked).

        Returns:
            The record; the operation counts as in flight until its event completes.
        """
        watched = [seq, op_name, _monotonic() + self.timeout, None, held, stream, next(self._numbers)]  # record()
        if stream is not None:  # _add(), inline
            self._newest[stream] = watched
        self._inflight.append(watched)
        if self._idle:
            self._wake.set()
        if self._thread is None:
            self._start_thread()
        return watched

    def follow(self, watched: Watched, event, held: Any) -> Watched:
        """Watch a step queued after ``watched`` on its stream (a copy back): same operation and
        deadline, ``event`` recorded after the step, ``held`` kept until then."""
        after = record(watched[SEQ], watched[OP_NAME], watched[DEADLINE], held, watched[STREAM], next(self._numbers))
        after[EVENT] = event
        self._add(after)
        return after

    def event(self):
        """A CUDA event to record after an operation, from the pool: give it to the operation's record,
        and the watchdog takes it back once the record has completed and nothing else refers to it."""
        free = self.free
        return free.pop() if free else torch.cuda.Event()

    def _add(self, watched: Watched) -> None:
        if watched[STREAM] is not None:
            self._newest[watched[STREAM]] = watched
        self._inflight.append(watched)
        if self._idle:
            self._wake.set()
        if self._thread is None:
            self._start_thread()

    def _start_thread(self) -> None:
        with self._start_lock:
            if self._thread is None and not self._stopped:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()

    def drain(self) -> bool:
        """Wait until every watched operation has completed or the watchdog gave up (and acted).

        Returns:
            True if they all completed (each within its deadline).
        """
        with self._passed:
            while (self._inflight and not self._stopped) or self._expiring:
                self._wake.set()
                self._passed.wait(POLL)
            return not self._inflight and not self.expired

    def stop(self) -> None:
        """Stop watching (the communicator is closed or aborted); join the thread unless called from it."""
        self._stopped = True
        self._wake.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(10.0)
        with self._passed:
            self._passed.notify_all()

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        if self.device is not None:
            torch.cuda.set_device(self.device)  # events are queried here: no context on GPU 0
        relax_capture_mode()
        inflight, empty = self._inflight, 0
        looked = time.monotonic()
        while not self._stopped:
            failed, error = self._look()
            if failed is not None:
                self.give_up(failed, error)
                return
            self._recycle()
            with self._passed:
                self._passed.notify_all()
            # Events that Works still hold are looked at again until they come back: no sleep meanwhile.
            # Nor while callers add records (the last look took some off), though each look finds none
            # left: a wake-up per sleep would cost a caller a microsecond every few small collectives.
            empty = 0 if inflight or self._lent or self._taken else empty + 1
            if empty < 2:
                # Callers do not wake the thread while it polls (a wake-up per call would take the
                # GIL from them): a record waits at most POLL for its first look.
                now = time.monotonic()
                pause, looked = self._pause(now - looked), now
                self._wake.wait(pause)
                self._wake.clear()
                continue
            self._idle = True  # nothing for two looks: sleep until a caller appends
            if not inflight and not self._stopped:  # a record appended before _idle was set
                self._wake.wait()
            self._idle = False  # then clear: a caller that saw it idle meanwhile sets no early wake-up
            self._wake.clear()
            empty = 0

    def _pause(self, since: float) -> float:
        """Seconds to wait before the next look, given ``since`` seconds between the last two: :data:`POLL`,
        or less while the callers' rate (the records the last look took off, per second) would use
        half the pool's events in a :data:`POLL` (each call takes one; a call that finds the pool
        empty makes a new CUDA event, a microsecond or more of the caller's time)."""
        if self._taken * POLL <= (POOL // 2) * since:
            return POLL
        return max(BUSY_POLL, (POOL // 2) * since / self._taken)

    def _look(self):
        """Take completed operations off, oldest first; return the one past its deadline (and
        None) or the one an asynchronous error fails (and the error), else ``(None, None)``."""
        inflight, lent = self._inflight, self._lent
        self._taken = 0
        try:
            self._check()
        except Exception as exc:  # noqa: BLE001 - NCCL's error, reported through expire()
            return (inflight[0] if inflight else record(0, "an operation in flight", 0.0)), exc
        # Each stream's newest record, asked first: records numbered up to it on that stream are
        # done too. One made after this snapshot has a higher number: it is asked itself.
        done_upto = {}
        newest = self._newest
        for stream, last in list(newest.items()):
            event = last[EVENT]
            if event is not None and event.query():
                done_upto[stream] = last[N]
                if newest.get(stream) is last:  # nothing newer on it: forget the stream (a caller
                    del newest[stream]          # racing this only costs its record a query)
        while inflight:
            oldest = inflight[0]
            event = oldest[EVENT]
            # No lock held: the callers never wait on a query.
            if event is not None and (oldest[N] <= done_upto.get(oldest[STREAM], 0) or event.query()):
                inflight.popleft()
                self._taken += 1
                oldest[HELD] = ()  # the stream is done with them: the allocator may have them back
                lent.append(event)  # back to the pool once nothing refers to it (_recycle)
                continue
            if time.monotonic() > oldest[DEADLINE]:
                return oldest, None
            if any(stream != oldest[STREAM] for stream in done_upto):
                # Another stream has finished records made after this one: what they hold goes now,
                # not in issue order behind a collective of another stream (a snapshot: callers append).
                for later in list(inflight):
                    if later[HELD] and later[EVENT] is not None and later[N] <= done_upto.get(later[STREAM], 0):
                        later[HELD] = ()
            break
        return None, None

    def _recycle(self) -> None:
        """Put back in the pool the events of completed records that nothing refers to any more."""
        lent = self._lent
        if not lent:
            return
        free, keep = self.free, []
        for event, count in zip(lent, _references(lent)):
            if count > _UNSHARED:  # a Work or an operation still refers to it
                keep.append(event)
            elif len(free) < POOL:
                free.append(event)
        self._lent = keep[-POOL:]  # events Works keep for ever go with their Works

    def give_up(self, failed: Watched, error: Optional[BaseException]) -> None:
        self.expired = self._stopped = self._expiring = True
        try:
            self._expire(failed, error)
        finally:
            self._expiring = False
            self._inflight.clear()
            with self._passed:
                self._passed.notify_all()
