"""Deadlines for NCCL operations, which the host does not wait for.

An NCCL call returns once the operation is enqueued on a CUDA stream, and waiting on it
only orders the caller's stream after it (torch's NCCL ``Work.wait()`` does the same), so
a collective whose peer never arrives stalls the GPU, not the host. A :class:`Watchdog`,
one thread per communicator as in torch's ProcessGroupNCCL, polls the CUDA event recorded
after each operation against the operation's deadline. An operation is watched from
*before* its NCCL call: a call that blocks the host (NCCL connects to peers lazily, inside
the first operation with each) expires like a stalled kernel.

Each record also holds every tensor the operation's stream reads or writes (``held``) until
its event completes, as torch's NCCL group stashes them: a tensor the caller drops meanwhile
is not handed back to the caching allocator while NCCL still uses its memory.

The thread sets its CUDA device (:attr:`Watchdog.device`) before it looks at an event, so it
makes no CUDA context on another GPU.

On the first deadline that passes, or the first asynchronous error NCCL reports, the
watchdog calls ``expire(watched, error)`` once and stops: the communicator decides what
follows (:mod:`smddp.comm.backends.nccl_errors`).
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, List, Optional

import torch

#: Seconds between two looks at the operations in flight (torch's watchdog: 0.1 s).
POLL = 0.05


class Watched:
    """One NCCL operation under a deadline.

    Attributes:
        seq: the collective's sequence number.
        op_name: what was called.
        deadline: ``time.monotonic()`` by which it must complete.
        event: the CUDA event recorded after it; None while its NCCL call has not returned.
        held: what its stream uses (tensors, and the steps queued after it), kept until
            ``event`` completes.
    """

    __slots__ = ("seq", "op_name", "deadline", "event", "held")

    def __init__(self, seq: int, op_name: str, deadline: float, held: Any = ()):
        self.seq, self.op_name, self.deadline, self.event, self.held = seq, op_name, deadline, None, held

    def done(self) -> bool:
        """True once the GPU has finished the operation."""
        return self.event is not None and self.event.query()


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
        self._inflight: List[Watched] = []
        self._cv = threading.Condition()
        self._thread: Optional[threading.Thread] = None
        self._stopped = False
        self._expiring = False  # expire() is running: drain() waits for its abort to finish
        self.expired = False
        #: The CUDA device index the thread sets before it looks at events (None: leave it).
        self.device: Optional[int] = None

    def start(self, seq: int, op_name: str, held: Any = ()) -> Watched:
        """Watch an operation about to be enqueued; set its ``event`` once it is.

        Args:
            seq: its sequence number.
            op_name: its name, for the error.
            held: what its stream uses, kept until its event completes.

        Returns:
            The record; the operation counts as in flight until its event completes.
        """
        return self._add(Watched(seq, op_name, time.monotonic() + self.timeout, held))

    def follow(self, watched: Watched, event, held: Any) -> Watched:
        """Watch a step queued after ``watched`` on its stream (a copy back): same operation and
        deadline, ``event`` recorded after the step, ``held`` kept until then."""
        after = Watched(watched.seq, watched.op_name, watched.deadline, held)
        after.event = event
        return self._add(after)

    def _add(self, watched: Watched) -> Watched:
        with self._cv:
            self._inflight.append(watched)
            if self._thread is None and not self._stopped:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            elif len(self._inflight) == 1:
                self._cv.notify_all()  # the thread sleeps until there is something to watch
        return watched

    def drain(self) -> bool:
        """Wait until every watched operation has completed or the watchdog gave up (and acted).

        Returns:
            True if they all completed (each within its deadline).
        """
        with self._cv:
            while (self._inflight and not self._stopped) or self._expiring:
                self._cv.wait(POLL)
            return not self._inflight and not self.expired

    def stop(self) -> None:
        """Stop watching (the communicator is closed or aborted); join the thread unless called from it."""
        with self._cv:
            self._stopped = True
            self._cv.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(10.0)

    def _run(self) -> None:
        if self.device is not None:
            torch.cuda.set_device(self.device)  # events are queried here: no context on GPU 0
        while True:
            with self._cv:
                while not self._inflight and not self._stopped:
                    self._cv.wait()
                if self._stopped:
                    return
                watched = list(self._inflight)
            failed, error = self._look(watched)
            with self._cv:
                if failed is None:
                    finished = {id(w) for w in watched if w.done()}  # event.query() does not block
                    for w in watched:
                        if id(w) in finished:
                            w.held = ()  # the stream is done with them: the allocator may have them back
                    self._inflight = [w for w in self._inflight if id(w) not in finished]
                    self._cv.notify_all()
                    if self._inflight:
                        self._cv.wait(POLL)
                    continue
                self.expired = self._stopped = self._expiring = True
            try:
                self._expire(failed, error)
            finally:
                with self._cv:
                    self._expiring = False
                    self._inflight.clear()
                    self._cv.notify_all()
            return

    def _look(self, watched: List[Watched]):
        """The first operation past its deadline (and None), or the one an async error fails."""
        try:
            self._check()
        except Exception as exc:  # noqa: BLE001 - NCCL's error, reported through expire()
            return watched[0], exc
        now = time.monotonic()
        for w in watched:
            if now > w.deadline and not w.done():
                return w, None
        return None, None
