"""Ranks of one host as threads of one process over one real shared-memory segment.

:func:`on_threads` makes one :class:`~smddp.comm.planes.shm.Plane` per thread over a torch
``HashStore`` (the planes meet through it as ranks meet through the group's store), runs the
same function on every rank, and returns each rank's result, raising the first rank's error.
The compiled core releases the GIL while it waits; the Python path's waits hand the GIL back
between tests: both make progress with every rank in one process.
"""

from __future__ import annotations

import itertools
import threading
import time
from datetime import timedelta
from typing import Callable, List, Optional

import torch.distributed as tdist

from smddp.comm.planes import hostmates
from smddp.comm.planes.shm import MIN_SLOT_BYTES, Plane
from smddp.comm.waiting import poll

#: How long a thread rank waits for another before the test fails (never reached when all is well).
TIMEOUT = timedelta(seconds=30)
_groups = itertools.count()


def channels(size: int, store: Optional[tdist.Store] = None) -> List[hostmates.HostChannel]:
    """The set-up channels of ``size`` ranks of one host, over one in-process store."""
    store = store if store is not None else tdist.HashStore()
    info = [{"host": "here"}] * size
    return [hostmates.HostChannel(store, hostmates.grouped(info, r), TIMEOUT) for r in range(size)]


def wait(pending, seconds: float = TIMEOUT.total_seconds()) -> None:
    """Wait for ``pending`` as the engine does (:func:`smddp.comm.waiting.poll`), or fail.

    Raises:
        AssertionError: it did not complete within ``seconds``.
        Whatever its ``test()`` raises.
    """
    assert poll(pending.test, time.monotonic() + seconds), "the operation did not complete"


def on_threads(body: Callable[[Plane], object], size: int = 2, native: bool = True,
               slot: int = MIN_SLOT_BYTES, **plane_args) -> List[object]:
    """``body(plane)`` on ``size`` thread ranks, each with its plane over one new segment.

    Args:
        body: what every rank runs; ``plane.rank`` is its rank.
        size: the number of ranks.
        native: run the compiled core (False: the Python path).
        slot: bytes of each buffer (the smallest the plane takes: larger tensors take several steps).
        plane_args: passed on to :class:`Plane`.

    Returns:
        Every rank's result, in rank order.

    Raises:
        The first rank's error, if one raised.
    """
    group = f"threads{next(_groups)}"
    results: List[object] = [None] * size
    errors: List[Optional[BaseException]] = [None] * size

    def rank(host: hostmates.HostChannel) -> None:
        plane = None
        try:
            plane = Plane(host, group, slot, use_native=native, **plane_args)
            assert plane.native is native, "the plane did not take the path asked for"
            results[host.rank] = body(plane)
        except BaseException as exc:  # noqa: BLE001 - handed to the test's thread
            errors[host.rank] = exc
        finally:
            if plane is not None:
                plane.close()

    threads = [threading.Thread(target=rank, args=(host,), daemon=True) for host in channels(size)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 2 * TIMEOUT.total_seconds()
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
        assert not thread.is_alive(), "a thread rank never finished"
    for error in errors:
        if error is not None:
            raise error
    return results

