"""torch.profiler's view of the engine: one event per collective, as gloo's backend records.

torch's gloo backend records an event per operation (``gloo:all_reduce``, with the input
tensors' shapes) that lasts from the start of the operation to its completion, in whatever
thread completes it. The engine records the same for every collective it runs, named
``smddp:<collective>``: :func:`begin` when it starts one, :func:`end` once a synchronous one
(or one that completed as it started) is done, :func:`end_on` for one in flight, which ends
when its handle's future completes (torch carries the profiler's thread state to the thread
that completes it).

With no profiler active in the calling thread this costs one C call per collective
(:data:`active`); nothing else here runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence

import torch

from smddp import _compat

if TYPE_CHECKING:
    from smddp.comm.engine import Engine

__all__ = ["active", "begin", "end", "end_on", "name_of", "profiled"]

#: True while torch's profiler records in the calling thread (one C call).
active = _compat.profiler_enabled

_enter = _compat.record_function_enter
_exit = _compat.record_function_exit


def name_of(op_name: str) -> str:
    """The event's name for collective ``op_name`` (a label in parentheses dropped)."""
    return "smddp:" + op_name.split(" (", 1)[0]


def begin(op_name: str, inputs: Sequence[torch.Tensor]) -> Optional[object]:
    """Start collective ``op_name``'s event, with the shapes of ``inputs``, in this thread.

    Args:
        op_name: the engine's name of the collective (``all_reduce``, ``broadcast``, ...).
        inputs: the tensors the collective reads (their shapes are recorded).

    Returns:
        The event, for :func:`end` or :func:`end_on`.
    """
    return _enter(name_of(op_name), *inputs)


def end(event: object) -> None:
    """End ``event`` now (in the thread that began it)."""
    _exit(event)


def end_on(event: object, future: torch.futures.Future) -> None:
    """End ``event`` when ``future`` completes, in the thread that completes it.

    Args:
        event: from :func:`begin`.
        future: completed when the collective is (a handle's C++ future).
    """
    _compat.end_record_function_on(event, future)


def profiled(engine: Engine, op_name: str, start, async_op: bool, check, args: tuple, inputs, result):
    """``engine.run(...)`` with the collective's event, from its start to its completion.

    Returns:
        What :meth:`Engine.run <smddp.comm.engine.Engine.run>` returns.
    """
    event = begin(op_name, inputs)
    try:
        handle = engine.run(op_name, start, async_op, check, args, inputs, result, False)
    except BaseException:
        end(event)
        raise
    if handle is None or handle.done:
        end(event)
    else:
        end_on(event, handle.completion())
    return handle
