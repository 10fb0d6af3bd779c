"""The private torch APIs smddp relies on, each wrapped in one place.

When torch changes one of these, this file is the only one to mend. Each says which torch
versions have it, checked against the wheels of torch 2.4.0, 2.9.0, 2.10.0, 2.11.0 and 2.13.0
(``setup.cfg`` admits torch >= 2.4; the test suite runs on 2.13, and ``tests/test_nccl.py`` and
the torch-API tests were also run on 2.11.0, the GPU machine's), and what a version without it gets.
"""

from __future__ import annotations

import sys
from typing import Callable

import torch
import torch.distributed as tdist

#: torch 2.8 and later: every function of ``torch.distributed`` that passes ``asyncOp=False``
#: to a process group accepts ``None`` back (the backend has completed the call); earlier ones
#: call ``wait()`` on what they get.
SYNC_RETURNS_NONE = torch.__version__ >= (2, 8)

_C10D_GLOBALS = vars(sys.modules["torch.distributed.distributed_c10d"])


def requested_device_id() -> torch.device | None:
    """The ``device_id`` torch's ``init_process_group`` or ``new_group`` was given, while torch
    creates the group (called from the backend's creator); None outside that or without one.

    torch hands ``device_id`` to ``_new_process_group_helper`` (a parameter in 2.4 through 2.13)
    but not to a third-party backend's creator, and sets ``bound_device_id`` only on the group
    object it then replaces with the backend's own. So it is read from that frame; a torch whose
    helper lacks it gives None, and the device is chosen as without ``device_id``.
    """
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "_new_process_group_helper" and frame.f_globals is _C10D_GLOBALS:
            device = frame.f_locals.get("device_id")
            return device if isinstance(device, torch.device) else None
        frame = frame.f_back
    return None


def register_backend(name: str, creator: Callable, devices) -> None:
    """Register ``creator(options, backend_options)`` as torch backend ``name`` (once).

    ``extended_api`` and ``devices``: keyword arguments of ``Backend.register_backend`` in 2.4 to 2.13.
    """
    if getattr(tdist.Backend, name.upper(), None) is not None:
        return
    tdist.Backend.register_backend(name, creator, extended_api=True, devices=list(devices))


#: torch 2.7 and later call every group's ``shutdown()`` from ``destroy_process_group()``
#: (2.9, 2.10, 2.11 and 2.13 checked); torch 2.4 to 2.6 call it only on NCCL's (their
#: ``_shutdown_backend``), and there the next ``init_process_group()`` closes the old world.
DESTROY_CALLS_SHUTDOWN = torch.__version__ >= (2, 7)


def rendezvous_handlers() -> dict:
    """torch's table of ``init_method`` schemes to rendezvous functions (``_rendezvous_handlers``, 2.4 to 2.13)."""
    return sys.modules["torch.distributed.rendezvous"]._rendezvous_handlers


def default_timeout():
    """torch's default process-group timeout (30 minutes for non-NCCL backends)."""
    from torch.distributed import constants

    return constants.default_pg_timeout


#: The id of the autograd backward pass running in this thread, -1 outside one (a C function:
#: ``torch._C._current_graph_task_id``, 2.4 to 2.13; without it nothing counts as inside backward).
graph_task_id = getattr(torch._C, "_current_graph_task_id", None) or (lambda: -1)


def in_backward() -> bool:
    """True inside autograd's backward pass (where DDP's reducer starts its all-reduces)."""
    return graph_task_id() != -1


# ---------------------------------------------------------------------------- native backends
def backend_type(name: str):
    """torch's ``ProcessGroup.BackendType`` member called ``name`` (``"GLOO"``, ``"NCCL"``; ``"XCCL"`` from 2.8)."""
    return getattr(tdist.ProcessGroup.BackendType, name)


def register_device_backend(pg, device_type: str, backend_type_name: str, backend) -> None:
    """Make ``backend`` serve ``device_type`` tensors of ``pg`` in torch's C++ dispatch
    (``ProcessGroup._register_backend``, 2.4 to 2.13)."""
    pg._register_backend(torch.device(device_type), backend_type(backend_type_name), backend)


def gloo_backend(store, rank: int, size: int, timeout, group_name: str, one_host: bool, lazy: bool = True):
    """A ``ProcessGroupGloo`` that connects its peers on first use where torch can (``lazy``).

    Its devices listen where smddp's sockets may (:mod:`smddp.comm.backends.gloo_group`):
    ``one_host``, from the group's agreed layout, says whether loopback reaches every rank.
    """
    from smddp.comm.backends.gloo_group import gloo_group

    backend = None
    if lazy:
        try:
            backend = gloo_group(store, rank, size, timeout, one_host, lazy=True, threads=2)
        except (AttributeError, TypeError):  # a torch without lazy gloo: connect now
            backend = None
    if backend is None:
        backend = gloo_group(store, rank, size, timeout, one_host)
    backend.options.group_name = group_name
    backend.options.global_ranks_in_group = list(range(size))
    return backend


def nccl_backend(store, rank: int, size: int, timeout, group_name: str):
    """A ``ProcessGroupNCCL`` (its communicator is created on first use).

    ``Options``' ``is_high_priority_stream``, ``_timeout``, ``group_name`` and
    ``global_ranks_in_group``: 2.4 to 2.13.
    """
    options = tdist.ProcessGroupNCCL.Options()
    options.is_high_priority_stream = False
    options._timeout = timeout
    options.group_name = group_name
    options.global_ranks_in_group = list(range(size))
    return tdist.ProcessGroupNCCL(store, rank, size, options)


def xccl_backend(store, rank: int, size: int, timeout, group_name: str):
    """A ``ProcessGroupXCCL`` (torch >= 2.8 XPU builds)."""
    options = tdist.ProcessGroupXCCL.Options()
    options._timeout = timeout
    options.group_name = group_name
    options.global_ranks_in_group = list(range(size))
    return tdist.ProcessGroupXCCL(store, rank, size, options)


# ---------------------------------------------------------------------------- autograd
def queue_backward_callback(callback: Callable[[], None]) -> None:
    """Run ``callback()`` when the running backward pass ends, before ``backward()`` returns
    (``Variable._execution_engine.queue_callback``, 2.4 to 2.13)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)
