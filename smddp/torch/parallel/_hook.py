"""The communication hook smddp's ``DistributedDataParallel`` installs on the shared-memory plane.

torch's reducer hands each full gradient bucket to a communication hook and, at the end of
backward, waits on the future the hook returned. Without a hook it calls the process group's
``allreduce``: a ``Work`` whose future the engine's progress thread completes, then a callback.
On the shared-memory plane an all-reduce is memory copies made by the ranks' own threads, and
with one rank per core there is no idle core for another thread to use: handing the bucket to
the progress thread only adds wake-ups and GIL handoffs (docs/ddp.md, "Where a step's time goes").

:func:`allreduce_hook` therefore all-reduces the bucket in place, synchronously, in the thread
that runs backward, with ``AVERAGE`` (the shared-memory core divides as it reduces: no pass of
its own), and returns a future that is already complete. It goes through the group's engine like
every other collective, so it completes after every collective issued on the group before it
(an asynchronous ``all_reduce`` the caller started before ``backward()``, say) and is numbered,
checked and timed out like them.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as tdist

from smddp import knobs
from smddp.comm.engine import events as _events
from smddp.comm.reduction import Op
from smddp.torch import _c10d_events, _labels

__all__ = ["ENV", "allreduce_hook", "completes_inline"]

_profiling = _events.active  # one C call

#: ``SMDDP_DDP_HOOK=0`` keeps torch's default path (the process group's asynchronous allreduce).
ENV = "SMDDP_DDP_HOOK"


def completes_inline(engine, module: torch.nn.Module, env=os.environ) -> bool:
    """True when ``module``'s gradients are best reduced in the backward thread.

    That is: every parameter is a CPU tensor, the engine's CPU communicator is the
    shared-memory plane (every rank of the group on one host; not the hierarchical plane, nor
    ``mpi`` or ``gloo``), and ``SMDDP_DDP_HOOK`` is not ``0``.

    Args:
        engine: the group's :class:`~smddp.comm.engine.Engine`.
        module: the module DDP wraps.
        env: the environment to read ``SMDDP_DDP_HOOK`` from.

    Returns:
        Whether to install :func:`allreduce_hook`.
    """
    if not knobs.value(ENV, env):
        return False
    comm = engine.comms.get("cpu")
    if comm is None or comm.plane != "shm":
        return False
    params = list(module.parameters())
    return bool(params) and all(p.is_cpu for p in params)


def allreduce_hook(engine, bucket) -> torch.futures.Future:
    """All-reduce ``bucket`` in place, averaging, in this thread; return a completed future.

    Sparse buckets (an embedding's ``sparse=True`` gradients) take torch's own allreduce hook.

    Args:
        engine: the group's :class:`~smddp.comm.engine.Engine` (the hook's state).
        bucket: torch's ``GradBucket``.

    Returns:
        A completed ``torch.futures.Future`` whose value is the reduced bucket.

    Raises:
        CollectiveTimeout: the all-reduce did not complete within the group's timeout.
        CollectiveError: it failed.
    """
    buffer = bucket.buffer()
    if buffer.is_sparse:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        return default_hooks.allreduce_hook(None, bucket)
    # torch's reducer would call the group's allreduce here: the profiler sees the same event.
    event = _c10d_events.begin("allreduce_", {"tensors": [buffer]}) if _profiling() else None
    try:
        engine.all_reduce(buffer, Op.AVERAGE, label=_labels.all_reduce_label())
    finally:
        if event is not None:
            _c10d_events.end(event)
    future = torch.futures.Future()
    future.set_result(buffer)
    return future


# torch checks a hook's annotations against its own types; this module's are strings.
allreduce_hook.__annotations__ = {"bucket": tdist.GradBucket, "return": torch.futures.Future[torch.Tensor]}
