"""A collective in flight, as the caller holds it (:class:`Handle`), and how a thread waits.

The :class:`~smddp.comm.engine.Engine` creates a handle for every asynchronous operation
and owns it until it completes; this module is how a handle waits, fails and calls back.
:func:`poll` is smddp's one wait loop: handles, the engine's synchronous path, the
``SMDDP_DEBUG`` check, the end of DDP's backward and the stalled-rank reports' store
queries all wait through it.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Callable, List, Optional, Sequence

from smddp.comm.base import Pending

if TYPE_CHECKING:
    from smddp.comm.engine import Engine


# Busy-poll this many times before yielding the CPU while waiting: small collectives
# finish within it, and a stalled peer does not cost a whole core for long.
_HOT_POLLS = 4000
_WARM_POLLS = 40000
# A Pending with ``block(seconds)`` (a library that completes on its own threads, like gloo)
# is slept on in slices of this many seconds instead of polled: polling takes the CPU from
# the very threads doing the work.
_BLOCK_SLICE = 0.5


def poll(
    test: Callable[[], bool],
    deadline: float,
    block: Optional[Callable[[float], object]] = None,
    pause: Optional[Callable[[], object]] = None,
) -> bool:
    """Call ``test()`` until it returns True or ``deadline`` passes.

    Between two calls the thread waits as suits the operation: ``block(seconds)`` for a
    library that completes it on threads of its own; else ``pause()`` if given; else it
    polls busily for the first few thousand calls (small collectives finish within them),
    then yields the CPU, then sleeps half a millisecond at a time.

    Args:
        test: returns True once the operation has completed.
        deadline: a ``time.monotonic()`` time; ``math.inf`` for none.
        block: sleeps at most the given seconds or until the operation completes (a
            Pending's ``block``).
        pause: called between two tests instead of the default back-off.

    Returns:
        True once ``test()`` did; False when the deadline passed first.
    """
    polls = 0
    while not test():
        polls += 1
        if block is None and pause is None and polls <= _HOT_POLLS:
            continue
        now = time.monotonic()
        if now > deadline:
            return False
        if block is not None:
            block(min(_BLOCK_SLICE, deadline - now))
        elif pause is not None:
            pause()
        else:
            time.sleep(0 if polls < _WARM_POLLS else 0.0005)
    return True


class Handle:
    """A collective in flight: ``wait()`` and ``is_completed()``, like torch's Work.

    The engine holds every handle (and so its Pending and every buffer the Pending keeps)
    until the operation completes: dropping a handle changes nothing.
    """

    __slots__ = ("_engine", "seq", "op_name", "_pending", "_finished", "_done", "_error",
                 "_callbacks", "deadline", "ordered", "covers")

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
        #: Collectives issued just before this one that it stands for (a coalesced call,
        #: :func:`smddp.comm.algorithms.derived.each`): done when it is, their errors first.
        self.covers: Sequence[Handle] = ()

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
        if not self._done:  # most small collectives are done as they start
            if timeout is not None:
                self.deadline = min(self.deadline, time.monotonic() + timeout)
            block = self._block if getattr(self._pending, "block", None) is not None else None
            try:
                # The handle fails itself at its deadline (see _advance); past it, it completes
                # once the collectives issued before it have.
                if not poll(self.is_completed, self.deadline, block):
                    poll(self.is_completed, math.inf)
            except KeyboardInterrupt:
                self._engine._interrupted(self.seq, self.op_name)
                raise
        error = self.exception() if self.covers else self._error
        if error is not None:
            raise error
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
        """The error the operation ended with, if any (the first of :attr:`covers` and its own)."""
        for handle in self.covers:
            if handle._error is not None:
                return handle._error
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

    def _block(self, seconds: float) -> None:
        if self._finished:
            # Only the collectives issued before this one are left: is_completed advances them.
            time.sleep(0)
        else:
            self._pending.block(seconds)

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

