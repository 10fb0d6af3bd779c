"""torch's ``Work`` over an engine :class:`~smddp.comm.engine.Handle`.

What every :class:`~smddp.torch.process_group.SmddpProcessGroup` method returns: ``wait()``,
``is_completed()`` and a real future, completed by the engine when the operation completes
(so torch's DDP overlaps gradient reduction with backward).

Two kinds, with the same methods for Python (:class:`_Methods`):

- :class:`Work`, a Python subclass of torch's ``Work``. C++ calls its Python methods through
  torch's trampoline, which finds them only while the Python object lives: a C++ caller of the
  group (DDP's reducer) gets it wrapped by torch in a holder that keeps it alive.
- :class:`DetachedWork`, for what ``torch.distributed``'s API hands to Python code, which may
  pass it on to C++ and drop it (DDP's forward gives the reducer the Work of its
  ``join()`` all-reduce, then returns). Its C++ half is torch's ``PythonCallbackWork``: its
  ``wait()`` calls a function that holds the handle, not the Python object, and completes its
  future. (On a Python subclass of torch's ``Work``, C++ would fall back to
  torch's base ``wait()``, which waits for a completion that only C++ backends signal: forever.)
"""

from __future__ import annotations

import functools
from typing import List, Optional

import torch

from smddp.comm.engine import Handle
from smddp.torch import _compat

__all__ = ["DetachedWork", "RecvWork", "Work", "detached_works"]


class _Methods:
    """What Python sees of a Work, over ``self._handle`` and ``self._result``."""

    #: Made by the first get_future(); most Works never need one.
    _future: Optional[torch.futures.Future] = None
    _handle: Handle
    _result: list

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


class Work(_Methods, _compat.WorkBase):
    """torch's Work over an engine :class:`~smddp.comm.engine.Handle`."""

    def __init__(self, handle: Handle, result: List[torch.Tensor]):
        # Every torch-API collective builds one: the base's __init__ named, not super()'s lookup.
        _compat.WorkBase.__init__(self)
        self._handle = handle
        self._result = result


def detached_works() -> bool:
    """True when this torch has what :class:`DetachedWork` is made of (``PythonCallbackWork``)."""
    return _compat.CallbackWork is not None


class DetachedWork(_Methods, _compat.CallbackWork or _compat.WorkBase):
    """A Work whose C++ half waits, and holds its result, after Python has dropped it.

    Python calls the methods of :class:`_Methods`, as on :class:`Work`. C++ calls torch's
    ``PythonCallbackWork``: its ``wait()`` waits for the handle (within the group's timeout,
    raising its error), then completes its future (``getFuture()``, which C++ reads after
    ``wait()``: DDP's reducer does) with ``result``. Neither refers to this Python object, so
    dropping it changes nothing. Only where :func:`detached_works`.
    """

    def __init__(self, handle: Handle, result: list):
        future: list = []  # the C++ half's future, once there is a C++ half
        _compat.CallbackWork.__init__(self, functools.partial(_wait_for, handle, result, future))
        future.append(_compat.CallbackWork.get_future(self))
        self._handle = handle
        self._result = result


def _wait_for(handle: Handle, result: list, future: list, timeout) -> bool:  # noqa: ARG001 - the group's timeout
    """What a :class:`DetachedWork`'s C++ ``wait()`` calls: wait, then complete its C++ future."""
    try:
        handle.wait()
    except BaseException as exc:
        # Completed here, the future keeps no copy of the error that torch passes on from this
        # call: torch would raise that copy again if C++ read the future, and a Python error
        # raised twice from C++ ends the process.
        if not future[0].done():
            future[0].set_result(exc)
        raise
    if not future[0].done():
        future[0].set_result(result)
    return True


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
