"""The events torch's dispatcher records for a process group's collective, for smddp's.

Through a C++ backend (gloo, NCCL), a collective of ``torch.distributed`` passes torch's
dispatcher, which records an event named after its operator (``c10d::allreduce_``,
``c10d::broadcast_``, ...) with its arguments' shapes. smddp's ProcessGroup is Python: torch
calls its methods directly, so :class:`~smddp.torch.process_group.SmddpProcessGroup` records
the same events itself, with the same names and the same argument list (read from torch's
own operator schema, so shapes line up with gloo's on every torch version). The backend's
own event (``smddp:all_reduce``, as gloo's ``gloo:all_reduce``) is the engine's
(:mod:`smddp.comm.engine.events`).
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence, Tuple

import torch

from smddp import _compat

__all__ = ["begin", "end"]

_Fast = _compat.RecordFunctionFast
_arguments: Dict[str, Tuple[str, ...]] = {}
_barrier_tensor: Optional[torch.Tensor] = None


def _schema(op: str, given: Sequence[str]) -> Tuple[str, ...]:
    """The argument names of torch's ``c10d::<op>`` (those given, where torch has no such op)."""
    names = _arguments.get(op)
    if names is None:
        try:
            names = tuple(a.name for a in getattr(torch.ops.c10d, op).default._schema.arguments)
        except (AttributeError, RuntimeError):
            names = tuple(given)
        _arguments[op] = names
    return names


def _from_options(opts) -> dict:
    values = {}
    if opts is None:
        return values
    for field, name in (("rootRank", "root_rank"), ("rootTensor", "root_tensor"), ("asyncOp", "async_op")):
        value = getattr(opts, field, None)
        if value is not None:
            values[name] = value
    timeout = getattr(opts, "timeout", None)
    if timeout is not None:
        values["timeout"] = int(timeout.total_seconds() * 1000)
    device_ids = getattr(opts, "device_ids", None)
    if device_ids:  # an empty list has no type for the profiler, and would drop out of the event
        values["device_ids"] = list(device_ids)
    return values


#: A method's parameter name to the name torch's operator schema gives it, where they differ.
_RENAMED = {"dstRank": "dst", "srcRank": "src"}
_RENAMED_IN = {
    "_allgather_base_": {"output": "output_tensor", "input": "input_tensor"},
    "_reduce_scatter_base_": {"output": "output_tensor", "input": "input_tensor"},
    "allgather_coalesced_": {"input_tensors": "input_list"},
}


def begin(op: str, params: dict):
    """Start the event of ``c10d::<op>`` in this thread (call only while profiling).

    The event ends when the object returned is released: a method that keeps it in a local
    variable records its whole body, whichever way it returns.

    Args:
        op: torch's operator name without its namespace (``allreduce_``).
        params: the method's arguments by name (its ``locals()`` as it starts); ``opts``, its
            options, gives the options the schema lists (root rank, timeout, ...).

    Returns:
        The event.
    """
    global _barrier_tensor
    renamed = _RENAMED_IN.get(op, _RENAMED)
    values = {renamed.get(name, _RENAMED.get(name, name)): value for name, value in params.items()
              if name not in ("self", "opts")}
    values.update(_from_options(params.get("opts")))
    if op == "barrier":
        if _barrier_tensor is None:  # torch's ProcessGroup::barrier passes a one-byte tensor
            _barrier_tensor = torch.empty(1, dtype=torch.uint8)
        values["tensor"] = _barrier_tensor
    event = _Fast("c10d::" + op, [values.get(name) for name in _schema(op, values)])
    event.__enter__()
    return event


def end(event) -> None:
    """End an event from :func:`begin` now (in the thread that began it)."""
    event.__exit__(None, None, None)
