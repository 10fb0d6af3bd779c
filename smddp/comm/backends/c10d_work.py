"""A torch c10d ``Work`` as smddp's :class:`~smddp.comm.base.Pending`: the one adapter.

gloo's collectives (smddp's ``gloo`` plane) and torch's device backends (``torch-nccl``,
``xccl``, ``ccl``) hand back torch's ``Work``; the engine waits on Pendings. A host-completed
Work is polled with ``is_completed()``; a stream-ordered one (NCCL, XCCL) is done for the host at
once, and every wait orders the caller's current stream after it. Either may be followed by a
step on this rank (divide for AVERAGE, copy back). gloo completes its Work on threads of its
own: :class:`GlooWork` sleeps on the Work's future instead of polling.
"""

from __future__ import annotations

import threading
from typing import Callable, Optional

from smddp.comm.base import Pending


class WorkPending(Pending):
    """A torch ``Work``, then an optional ``after()`` on this rank.

    Args:
        work: what a torch backend's collective returned.
        stream_ordered: ``work.wait()`` orders the caller's current stream after the
            collective without blocking the host (NCCL, XCCL); otherwise ``test()`` polls
            ``work.is_completed()`` first.
        after: run once, on completion (divide for AVERAGE, copy back).
    """

    __slots__ = ("_work", "_stream_ordered", "_after", "_ordering")

    def __init__(self, work, stream_ordered: bool, after: Optional[Callable[[], None]] = None,
                 captured: bool = False):
        self._work, self._stream_ordered, self._after = work, stream_ordered, after
        # A stream-ordered Work orders the caller's current stream on every wait().
        self._ordering = work if stream_ordered else None
        if captured:
            # Captured in a CUDA graph: ordered on the capturing stream now, in the capturing
            # thread; no other thread may touch it (the engine's progress thread tests this).
            self.test()
            self._ordering = None

    def test(self) -> bool:
        if self._work is None:
            return True
        if not self._stream_ordered and not self._work.is_completed():
            return False
        self._work.wait()  # raises the error of a failed collective
        self._work = None
        if self._after is not None:
            self._after()
        return True

    def waited(self) -> None:
        if self._ordering is not None:
            self._ordering.wait()


class GlooWork(WorkPending):
    """A gloo Work, then what must follow it on this rank: slept on, not polled (gloo's threads do the work)."""

    __slots__ = ("_finished",)

    def __init__(self, work, after: Optional[Callable[[], None]] = None):
        super().__init__(work, False, after)
        self._finished: Optional[threading.Event] = None

    def block(self, seconds: float) -> None:
        """Sleep until gloo's thread completes the work or ``seconds`` pass."""
        # Read once: the progress thread's test() may clear self._work meanwhile.
        work = self._work
        if work is None:
            return
        finished = self._finished
        if finished is None:
            finished = self._finished = threading.Event()
            work.get_future().add_done_callback(lambda _: finished.set())
        finished.wait(seconds)
