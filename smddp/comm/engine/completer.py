"""Threads that complete finished operations' futures: callbacks never run on the progress thread.

A torch future's ``then`` callbacks run in the thread that completes the future, and a
callback may start collectives and wait for them there: torch's PowerSGD hook waits, inside
a ``then`` callback, on the future of the all-reduce it has just started. If the engine's
progress thread ran that callback, nothing would test the new all-reduce and the job would
hang. So the progress thread only finds what completed; a :class:`Completer` runs the
completions (done-callbacks, then the futures, whose callbacks run inline) on threads of its
own. Each job gets a thread of its own: an idle one if there is one, else a new one, so a
callback that blocks never holds back a completion it is waiting for, however deep callbacks
nest (torch's gloo runs callbacks on its two worker threads, and a third level of nesting hangs
it). A thread idle for :data:`IDLE_SECONDS` ends.

Threads that wait for an operation anyway (``wait()``, DDP's end of backward) complete what they
find themselves, as before: they are not the progress thread.
"""

from __future__ import annotations

import sys
import threading
from typing import Callable, List, Optional

#: Seconds an idle completion thread waits for a job before it ends.
IDLE_SECONDS = 10.0

_local = threading.local()


def completing() -> bool:
    """True in a thread that is completing operations (running their callbacks) right now."""
    return getattr(_local, "depth", 0) > 0


class completion:  # noqa: N801 - used as a context manager, like threading's lock objects
    """``with completion():`` marks the calling thread as completing operations (see :func:`completing`)."""

    __slots__ = ()

    def __enter__(self) -> None:
        _local.depth = getattr(_local, "depth", 0) + 1

    def __exit__(self, *exc) -> None:
        _local.depth -= 1


class _Worker:
    __slots__ = ("job", "ready", "retire", "thread")

    def __init__(self, job: Callable[[], None]):
        self.job: Optional[Callable[[], None]] = job
        self.ready = threading.Condition(threading.Lock())
        self.retire = False  # set while idle (trim): end instead of waiting for a job
        self.thread: Optional[threading.Thread] = None


class Completer:
    """Runs completion jobs on threads that never test operations in flight.

    Args:
        name: the threads' name (a rank's engine names its own).
    """

    def __init__(self, name: str = "smddp-completion"):
        self._name = name
        self._lock = threading.Lock()
        self._idle: List[_Worker] = []
        self._closed = False

    def submit(self, job: Callable[[], None]) -> None:
        """Run ``job()`` on a thread of its own: an idle completion thread, else a new one.

        A job that raises is reported on stderr; it never ends the thread's service.
        """
        with self._lock:
            worker = self._idle.pop() if self._idle else None
            if worker is not None:
                with worker.ready:
                    worker.job = job
                    worker.ready.notify()
                return
        worker = _Worker(job)
        worker.thread = threading.Thread(target=self._serve, args=(worker,), name=self._name, daemon=True)
        worker.thread.start()

    def trim(self) -> None:
        """End the idle threads now and return once they have ended (the last group was destroyed:
        it leaves no thread behind); later jobs start threads again."""
        with self._lock:
            idle, self._idle = self._idle, []
        for worker in idle:
            with worker.ready:
                worker.retire = True
                worker.ready.notify()
        for worker in idle:
            if worker.thread is not None and worker.thread is not threading.current_thread():
                worker.thread.join(5.0)

    def close(self) -> None:
        """End the idle threads; a thread still in a job ends once its job returns."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for worker in idle:
            with worker.ready:
                worker.ready.notify()

    def _serve(self, worker: _Worker) -> None:
        while True:
            job, worker.job = worker.job, None
            if job is not None:
                try:
                    with completion():
                        job()
                except Exception as exc:  # noqa: BLE001 - a completion's own errors are its handles'
                    print(f"smddp: completing an operation failed: {exc!r}", file=sys.stderr)
                job = None  # what it refers to (the handles, the caller's Works) is not kept while idle
            with self._lock:
                if self._closed:
                    return
                self._idle.append(worker)
            with worker.ready:
                if worker.job is None and not worker.retire:
                    worker.ready.wait(IDLE_SECONDS)
                if worker.job is not None:
                    continue
                if worker.retire:  # trimmed while idle: no longer in the idle list
                    return
            with self._lock:
                if worker in self._idle:  # not handed a job meanwhile: end
                    self._idle.remove(worker)
                    return
            # Handed a job between the wait's end and the lock: it is in worker.job now.
            with worker.ready:
                while worker.job is None and not self._closed and not worker.retire:
                    worker.ready.wait(1.0)
                if worker.job is None:
                    return


#: The process's completion threads, which every engine shares (a group adds no thread of its own).
COMPLETER = Completer()
