"""What an ``nccl`` collective hands the engine: an operation ordered on a CUDA stream.

torch's NCCL ``Work`` is done for the host as soon as it is enqueued; what waiting means is
ordering: ``wait()`` makes the waiting thread's current stream wait on the event recorded
after the collective. :class:`StreamOrdered` is that; :class:`HostPolled` (barriers) is done
only once the GPU finished it, as torch's NCCL barrier blocks the host.
"""

from __future__ import annotations

import math

import torch

from smddp import _compat
from smddp.comm.backends.nccl.watchdog import relax_capture_mode
from smddp.comm.base import Pending
from smddp.comm.waiting import poll


# ---------------------------------------------------------------------------- completion
class StreamOrdered(Pending):
    """An operation enqueued on a CUDA stream: done for every kernel queued after it.

    Attributes:
        event: the CUDA event recorded after the operation (and the steps queued after it).
    """

    __slots__ = ("_owner", "_lane", "_stream", "_watched", "event")

    def __init__(self, owner, lane, stream, event, watched):
        """``owner``: the NCCLCommunicator; ``lane``: its Lane; ``watched``: the watchdog's record."""
        self._owner, self._lane, self._stream, self.event, self._watched = owner, lane, stream, event, watched

    def test(self) -> bool:
        # No stream is ordered here: the engine's progress thread tests too, and ordering its
        # stream would serialise the caller's work behind the collective. Waits order. NCCL's
        # asynchronous error is polled by the watchdog and as each call starts (the
        # communicator's _enqueue), not here: a failure either found is raised here.
        self._owner.raise_failure()
        return True

    def waited(self) -> None:
        self._owner.raise_failure()
        self.order_current_stream()

    def queue_after(self, action) -> bool:
        with torch.cuda.device(self._lane.index), torch.cuda.stream(self._stream):
            action()
        event = self._owner.watch.event()  # from the pool, back in it once nothing refers to it
        _compat.record_event(event, self._stream)
        # What the action touches (a list's tensors, a non-contiguous tensor) is held until it ran.
        self._owner.watch.follow(self._watched, event, action)
        self.event = event
        return True

    def order_current_stream(self) -> None:
        """Make the caller's current stream wait for the operation, if it ran on another one.

        The host does not wait.
        """
        current = torch.cuda.current_stream(self._lane.index)
        if current.cuda_stream != self._stream.cuda_stream:
            current.wait_event(self.event)

    def query(self) -> bool:
        """True once the GPU has finished the operation (the host does not wait).

        Raises:
            CollectiveTimeout: the communicator's watchdog gave up on an operation.
            CollectiveError: NCCL reported an error.
        """
        self._owner.check()
        relax_capture_mode()  # the engine's progress thread asks: never invalidate another thread's capture
        with torch.cuda.device(self._lane.index):  # the engine's progress thread may ask
            return self.event.query()

    def synchronize(self) -> None:
        """Block the host until the GPU has finished the operation, within its deadline.

        Raises:
            CollectiveTimeout: it (or an operation before it) did not complete in time.
            CollectiveError: NCCL reported an error.
        """
        # No deadline of its own: the watchdog ends a stalled operation, and query() raises.
        poll(self.query, math.inf)


class Captured(StreamOrdered):
    """An operation captured in a CUDA graph, on the capturing stream: done for the host, never
    queried (its event is a node of the graph, not a real one), nothing for a waiter to order."""

    __slots__ = ()

    query = None  # completes on the host: the engine settles it at once

    def waited(self) -> None:
        self._owner.raise_failure()

    def queue_after(self, action) -> bool:
        with torch.cuda.device(self._lane.index):
            action()  # the capturing stream is current: the step is captured after the operation
        return True


class HostPolled(StreamOrdered):
    """An operation whose ``test()`` is True only once the GPU finished it (barrier)."""

    __slots__ = ()

    def test(self) -> bool:
        return self.query()
