"""A group's NCCL communicator on its device, made at first use under a deadline, as torch does.

torch's ProcessGroupNCCL makes no NCCL communicator when a group is created: the first
collective on a device makes it (``ncclCommInitRank``, after the unique id went through the
group's store). smddp's ``nccl`` backend does the same, one :class:`Lane` per group:

- :func:`open_lane` shares the unique id through the group's store and runs
  ``ncclCommInitRank`` on a thread of its own, which sets the device first (NCCL binds a
  communicator to the current device, and the caller's current device is the caller's). The
  caller waits for both within the group's timeout: a peer that never creates its side (it
  died after reading the id) ends in :class:`CreationTimeout` instead of a hang. A creation
  that returns after the caller gave up aborts what it made. An error from NCCL or CuPy
  becomes a :class:`~smddp.errors.CollectiveError` that says what to check.
- :class:`Lane` keeps the communicator, the group's own stream (``SMDDP_NCCL_STREAM=side``,
  the default) and a buffer for barriers, and counts the host calls into NCCL in flight
  (:meth:`Lane.enter`, :meth:`Lane.calling`), so that an abort never starts a call on a
  communicator being aborted and leaves the calls already made a moment to return first
  (:meth:`Lane.take`).
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, Optional

import torch

from smddp import _compat
from smddp.comm.backends.nccl.unique_id import UniqueId
from smddp.errors import CollectiveError

#: Seconds an abort waits for host calls into NCCL already made to return before it goes on.
CALL_GRACE = 1.0


class CreationTimeout(CollectiveError):
    """``ncclCommInitRank`` did not return before the deadline (a peer never joined)."""


class Lane:
    """A group's NCCL communicator on one device, its stream, and the host calls into it.

    Attributes:
        device: the device its tensors must be on.
        index: the CUDA device index (set in every thread that calls CUDA for it).
        comm: the NCCL communicator (CuPy's), None once taken for an abort or a destroy.
        side: the group's own stream, or None (collectives on the caller's current stream).
        ready: the event the group's stream waits on for the caller's (recorded again for each
            collective, as torch's NCCL group caches its own: one the engine's start lock serves).
        barrier_buf: one float32 element on ``device``, reduced by barriers.
        streams: the calling thread's current stream on ``device``, asked cheaply
            (:class:`smddp._compat.CudaStreams`).
    """

    def __init__(self, comm: Any, device: torch.device, index: int, side_stream: bool):
        self.comm, self.device, self.index = comm, device, index
        with torch.cuda.device(index):
            self.side = torch.cuda.Stream(device) if side_stream else None
            self.ready = torch.cuda.Event() if side_stream else None
            self.barrier_buf = torch.zeros(1, dtype=torch.float32, device=device)
        self.streams = _compat.CudaStreams(index)
        self._calls = 0
        self._lock = threading.Lock()
        #: True while the direct path (:mod:`~smddp.comm.backends.nccl.direct`) calls NCCL: it reads
        #: :attr:`comm` after setting this, and :meth:`take` clears :attr:`comm` before reading it,
        #: so one of them sees the other (the engine's start lock lets one such call run at a time).
        self.busy = False

    def stream(self):
        """The stream to enqueue on, ordered after everything queued on the caller's current stream.

        During a CUDA graph capture, the caller's current stream itself (the capturing one): a
        collective captured there is part of the graph, and no other stream joins the capture.
        """
        current = self.streams.current()[1]
        side = self.side
        if side is None or self.streams.capturing():
            return current
        # An event on the producer's stream, waited on by the group's: the lane's own, recorded again
        # (Stream.wait_stream would make a new one per collective).
        _compat.record_event(self.ready, current)
        _compat.wait_event(self.ready, side)
        return side

    def enter(self):
        """Start a host call into the communicator: it, or None once it was taken. Call :meth:`leave` after."""
        with self._lock:
            comm = self.comm
            if comm is not None:
                self._calls += 1
            return comm

    def leave(self) -> None:
        """End a host call that :meth:`enter` started."""
        with self._lock:
            self._calls -= 1

    @contextlib.contextmanager
    def calling(self, refuse):
        """A host call into the communicator: yields it, or raises ``refuse()`` once it was taken."""
        comm = self.enter()
        if comm is None:
            raise refuse()
        try:
            yield comm
        finally:
            self.leave()

    def take(self, grace: float = CALL_GRACE) -> Optional[Any]:
        """Take the communicator out of use: no new call starts on it; calls made may finish.

        Waits up to ``grace`` seconds for host calls in flight to return: a call still inside
        NCCL then waits for a peer, and only an abort ends it.

        Returns:
            The communicator, or None if it was taken before.
        """
        with self._lock:
            comm, self.comm = self.comm, None
        end = time.monotonic() + grace
        while comm is not None and (self._calls or self.busy) and time.monotonic() < end:
            time.sleep(0.001)
        return comm


def open_lane(nccl, size: int, rank: int, uid: UniqueId, device: torch.device, index: int,
              deadline: float, side_stream: bool) -> Lane:
    """``ncclCommInitRank`` for this rank on ``device``, within ``deadline``, as a :class:`Lane`.

    Args:
        nccl: CuPy's NCCL module.
        size: the group's size.
        rank: this rank in the group.
        uid: rank 0's unique id.
        device: the group's device on this rank.
        index: its CUDA index.
        deadline: ``time.monotonic()`` by which the communicator must exist.
        side_stream: give the lane a stream of its own.

    Raises:
        CreationTimeout: the communicator was not made by ``deadline``.
        CollectiveError: NCCL or CuPy refused (the message has their words and what to check).
    """
    lock, done = threading.Lock(), threading.Event()
    box: dict = {}

    def create() -> None:
        try:
            torch.cuda.set_device(index)  # this thread's own: the caller's current device is untouched
            _use_cupy_device(index)
            made = nccl.NcclCommunicator(size, uid, rank)
        except BaseException as exc:  # noqa: BLE001 - reported to the caller
            box["error"] = exc
        else:
            with lock:
                if box.get("abandoned"):
                    made.abort()  # the caller gave up: nothing else will ever use or free it
                else:
                    box["comm"] = made
        finally:
            done.set()

    threading.Thread(target=create, name=f"smddp-nccl-init-{rank}", daemon=True).start()
    done.wait(max(deadline - time.monotonic(), 0.0))
    with lock:
        if "comm" not in box and "error" not in box:
            box["abandoned"] = True
            raise CreationTimeout(f"ncclCommInitRank on rank {rank} ({device}) did not return in time")
    if "error" in box:
        exc = box["error"]
        raise CollectiveError(
            f"NCCL could not create the communicator of rank {rank} of {size} on {device}: "
            f"{type(exc).__name__}: {exc}. Check that every rank of a host uses its own GPU "
            f"(torch.cuda.set_device(local_rank) or init_process_group(device_id=...)), that the ranks "
            f"reach each other (NCCL_SOCKET_IFNAME), and NCCL's own report (NCCL_DEBUG=WARN)") from exc
    return Lane(box["comm"], device, index, side_stream)


def _use_cupy_device(index: int) -> None:
    """Make ``index`` CuPy's current device too (CuPy may carry its own CUDA runtime)."""
    try:
        from cupy.cuda import runtime
    except ImportError:
        return
    runtime.setDevice(index)
