"""torch's ``Work`` over an engine :class:`~smddp.comm.engine.Handle`.

What every :class:`~smddp.torch.process_group.SmddpProcessGroup` method returns: ``wait()``,
``is_completed()`` and a real future, completed by the engine when the operation completes
(so torch's DDP overlaps gradient reduction with backward).
"""

from __future__ import annotations

from typing import List, Optional

import torch

from smddp.comm.engine import Handle
from smddp.torch import _compat

__all__ = ["RecvWork", "Work"]


class Work(_compat.WorkBase):
    """torch's Work over an engine :class:`~smddp.comm.engine.Handle`."""

    #: Made by the first get_future(); most Works never need one.
    _future: Optional[torch.futures.Future] = None

    def __init__(self, handle: Handle, result: List[torch.Tensor]):
        # Every torch-API collective builds one: the base's __init__ named, not super()'s lookup.
        _compat.WorkBase.__init__(self)
        self._handle = handle
        self._result = result

    def wait(self, timeout=None) -> bool:  # noqa: ARG002 - the group's timeout applies
        self._handle.wait()
        return True

    def is_completed(self) -> bool:
        return self._handle.is_completed()

    def is_success(self) -> bool:
        return self._handle.is_completed() and self._handle.exception() is None

    def exception(self):
        return self._handle.exception()

    def result(self) -> List[torch.Tensor]:
        return self._result

    def get_future(self) -> torch.futures.Future:
        if self._future is None:
            # CUDA tensors (nccl, torch-nccl): a CUDA-aware future, as torch's NCCL Work gives.
            # It completes when the operation is enqueued, with an event recorded after it, so
            # its value is ready for every kernel queued after wait() or in then() callbacks.
            devices = sorted({t.device for t in self._result if t.is_cuda}, key=str)
            future = torch.futures.Future(devices=devices) if devices else torch.futures.Future()

            def complete(handle: Handle) -> None:
                error = handle.exception()
                if error is None and devices:
                    try:
                        # A pool stream, not the completing thread's current one: that may be
                        # the caller's own, which must not wait for the collective.
                        with torch.cuda.stream(torch.cuda.Stream(devices[0])):
                            handle.order_current_stream()
                            future.set_result(self._result)
                        return
                    except Exception as exc:  # noqa: BLE001 - the communicator failed since
                        error = exc
                future.set_result(self._result if error is None else _Failed(error))

            # Future.set_exception() completes the future with the exception *as its value*,
            # which C++ consumers (DDP's reducer) read as tensors and crash on; an error
            # raised in a then() callback is a real error that they rethrow.
            self._future = future.then(_value_or_raise)
            self._handle.add_done_callback(complete)
        return self._future


class _Failed:
    """The value a Work's inner future carries when the operation failed."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException):
        self.error = error


def _value_or_raise(future: torch.futures.Future):
    value = future.value()
    if isinstance(value, _Failed):
        raise value.error
    return value


class RecvWork(Work):
    """A receive's Work: ``_source_rank()`` tells torch who sent (``recv(src=None)``)."""

    def __init__(self, handle, result, source):
        super().__init__(handle, result)
        self._source = source

    def _source_rank(self) -> int:
        self.wait()
        return self._source()
