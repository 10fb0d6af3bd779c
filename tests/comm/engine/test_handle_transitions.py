"""A handle's transitions as the engine makes them, in-process: failed at close, settled after its device.

An engine of one rank over a communicator whose operations complete when the test says so: a
collective still in flight when its group is destroyed fails every wait on it (Python's and the
C++ future's) within the deadline instead of hanging; a stream-ordered operation (one with ``query``) is done for
Python at once, and what C++ sees of it settles only once its device has finished it.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch

from smddp.comm.base import Communicator, Context, Pending
from smddp.comm.engine import Engine
from smddp.comm.engine.handle import DETACHABLE
from smddp.comm.reduction import Op
from smddp.errors import CollectiveError
from smddp.job.topology import Topology

pytestmark = pytest.mark.unit


class Gate(Pending):
    """An operation that completes once ``opened`` is set; with ``on_device``, a stream-ordered
    one: done for the host at once, finished on its device once ``opened`` is set."""

    def __init__(self, opened: threading.Event, on_device: bool = False):
        self.opened = opened
        if on_device:
            self.query = opened.is_set

    def test(self) -> bool:
        return self.query is not None or self.opened.is_set()


class Gated(Communicator):
    """Every collective's operation is a :class:`Gate` on the communicator's ``opened``."""

    name = "gated"

    def __init__(self, ctx: Context, on_device: bool = False):
        super().__init__(ctx)
        self.opened = threading.Event()
        self.on_device = on_device

    def _gate(self, *args) -> Pending:
        return Gate(self.opened, self.on_device)

    all_reduce = broadcast = all_gather = all_to_all_single = barrier = _gate


def engine(on_device: bool = False, timeout: float = 10) -> Engine:
    ctx = Context(Topology(rank=0, size=1, local_rank=0, local_size=1, launcher="none"), timedelta(seconds=timeout))
    return Engine({"cpu": Gated(ctx, on_device)}, timeout=timeout)


def test_a_collective_in_flight_when_its_group_is_destroyed_fails_every_wait_on_it():
    eng = engine(timeout=1)
    handle = eng.all_reduce(torch.ones(4), Op.SUM, async_op=True)
    future = handle.get_future()
    assert not handle.is_completed()
    started = time.monotonic()
    eng.close()  # drains within the deadline, then gives up on what is left
    assert time.monotonic() - started < 8
    assert handle.is_completed() and not handle.is_success()
    with pytest.raises(CollectiveError, match=r"all_reduce \(sequence number 1\) did not complete within 1 s"):
        handle.wait()
    with pytest.raises(Exception, match="did not complete within"):
        future.wait()


def test_the_cpp_half_of_a_stream_ordered_collective_settles_once_its_device_has_finished():
    eng = engine(on_device=True)
    try:
        tensor = torch.ones(4)
        handle = eng.all_reduce(tensor, Op.SUM, async_op=True)
        handle.wait()  # done for the host as it is enqueued
        assert handle.is_completed() and handle.exception() is None
        future = handle.get_future()
        time.sleep(0.2)  # the progress thread polls the device meanwhile
        if DETACHABLE:
            assert not future.done(), "what C++ sees settled before the device finished"
        eng.comms["cpu"].opened.set()
        deadline = time.monotonic() + 10
        while not future.done() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert future.done() and future.value() == [tensor]
    finally:
        eng.comms["cpu"].opened.set()
        eng.close()
