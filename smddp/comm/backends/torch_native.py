"""torch's own backend objects, to which a group hands its device's tensors as they come: the delegated route.

On GPUs smddp's process group gives device tensors straight to torch's backend object
(:mod:`smddp.torch.delegating_group`), with torch's options as given, and returns torch's ``Work``
as it is: no engine, Handle, Pending or thread of smddp's on that route. torch's group, tested on
many GPUs by torch's own CI, keeps the stream and lifetime rules of a device collective (its own
stream per group, tensors stashed until ``wait()``, a CUDA-aware future, the watchdog). smddp adds
what surrounds it: the smdistributed API, the launchers, SageMaker, the CPU planes for CPU tensors.

- ``torch-nccl``: torch's ``ProcessGroupNCCL`` on CUDA tensors; the default on CUDA.
- ``xccl``: Intel GPUs: torch's ``ProcessGroupXCCL`` (XPU builds of torch >= 2.8), else Intel's
  ``oneccl_bindings_for_pytorch``; ``ccl``: the bindings only (XPU tensors, or CPU ones where
  torch sees no XPU).
- ``torch-gloo``: torch's ``ProcessGroupGloo`` on CPU tensors: the same route on a CPU, which the
  suite runs on every CI run, and a reference to compare smddp's CPU planes with.

:func:`create` makes a group's object: its device (as torch's NCCL group picks it), from the
group's store, named with the group's name and global ranks as torch's own groups are; a
subgroup's NCCL communicator is split from the world's where torch would split it.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any, Dict, Optional, Sequence

import torch
import torch.distributed as tdist

from smddp import _compat, knobs
from smddp.comm.backends.devices import pick_device
from smddp.comm.backends.gloo_group import gloo_group
from smddp.comm.base import Context
from smddp.comm.needs import TORCH_CUDA_INSTALL, XPU_INSTALL
from smddp.errors import BackendUnavailableError

__all__ = ["DEVICES", "Delegate", "ccl_backend", "create", "xccl_available"]

#: Each delegating backend's device type: the tensors it hands to torch's backend object.
DEVICES: Dict[str, str] = {"torch-nccl": "cuda", "xccl": "xpu", "ccl": "xpu", "torch-gloo": "cpu"}

#: The store prefix of a group's torch-native backend for each device type (one object per device
#: and group: the delegate, which also serves torch's functional collectives).
STORE_PREFIX = "smddp/native/{}/"


@dataclass(frozen=True)
class Delegate:
    """torch's backend object that a group hands its ``device_type`` tensors to.

    Attributes:
        device_type: ``"cuda"``, ``"xpu"`` or ``"cpu"``.
        backend: the c10d ``Backend`` (``ProcessGroupNCCL``, ...), or torch's ``ProcessGroupWrapper``
            around it under ``SMDDP_DEBUG``.
        kind: its ``ProcessGroup.BackendType`` name (``"NCCL"``, ``"XCCL"``, ``"GLOO"``, ``"CUSTOM"``).
        device: this rank's device (``cpu`` for ``torch-gloo``).
        name: the smddp backend it serves (``"torch-nccl"``, ...).
        inner: the backend itself (``backend`` without torch's wrapper): what a subgroup splits from.
    """

    device_type: str
    backend: Any
    kind: str
    device: torch.device
    name: str
    inner: Any


def create(name: str, ctx: Context, group_name: str = "", ranks: Optional[Sequence[int]] = None,
           parent: Optional[Delegate] = None) -> Delegate:
    """torch's backend object for backend ``name`` in the group of ``ctx``.

    Called by the group's members, after the group's CPU communicator (whose layout gives the
    local rank that picks the device where no launcher counted one, and says whether every rank
    is on this host).

    Args:
        name: a key of :data:`DEVICES`.
        ctx: the group's context (topology, timeout, the group's store, ``device_id``).
        group_name: the group's name as torch registered it.
        ranks: the group's global ranks (None: the world).
        parent: the world's delegate, for a subgroup: torch's NCCL group splits the subgroup's
            communicator from it where the world's is bound to a device (``device_id``), as
            torch's ``new_group`` does (the non-members' side of the split is torch's own call).

    Raises:
        BackendUnavailableError: the device or library is missing (the message says what to install).
    """
    topology = ctx.topology
    store = ctx.store
    if store is None:
        if topology.size > 1:
            raise BackendUnavailableError(f"the {name!r} backend needs the job's store (MASTER_ADDR)")
        store = tdist.HashStore()
    device_type = DEVICES[name]
    if name == "torch-nccl":
        device = _cuda_device(ctx)
        prefixed = tdist.PrefixStore(STORE_PREFIX.format("cuda"), store)
        split = parent.inner if parent is not None and parent.kind == "NCCL" else None
        with _nccl_error_handling():
            backend = _compat.nccl_backend(prefixed, topology.rank, topology.size, ctx.timeout, group_name,
                                           ranks, split)
        kind = "NCCL"
    elif name == "torch-gloo":
        device = torch.device("cpu")
        one_host = ctx.layout.one_host if ctx.layout is not None else topology.size == 1
        backend = gloo_group(tdist.PrefixStore(STORE_PREFIX.format("cpu"), store), topology.rank,
                                  topology.size, ctx.timeout, one_host)
        _compat.name_backend(backend, group_name, topology.size, ranks)
        kind = "GLOO"
    else:
        prefixed = tdist.PrefixStore(STORE_PREFIX.format(device_type), store)
        xpu = getattr(torch, "xpu", None)
        if name == "ccl" and (xpu is None or not xpu.is_available()):
            device_type, device = "cpu", torch.device("cpu")  # oneCCL moves CPU tensors too
        else:
            device = _xpu_device(ctx, name)
        if name == "xccl" and xccl_available():
            backend = _compat.xccl_backend(prefixed, topology.rank, topology.size, ctx.timeout, group_name, ranks)
            kind = "XCCL"
        else:
            backend, kind = ccl_backend(prefixed, topology.rank, topology.size, ctx.timeout), "CUSTOM"
    _compat.set_sequence_number(backend)
    called = backend
    if knobs.value("SMDDP_DEBUG"):
        # smddp's cross-rank checks on this route are torch's own: TORCH_DISTRIBUTED_DEBUG=DETAIL's wrapper.
        called = _compat.debug_wrapper(backend, tdist.PrefixStore("smddp/debug/", store), group_name or "world",
                                       topology.rank, topology.size, ctx.timeout)
    return Delegate(device_type, called, kind, device, name, backend)


@contextlib.contextmanager
def _nccl_error_handling():
    """``SMDDP_NCCL_ASYNC_ERROR_HANDLING`` as torch's ``TORCH_NCCL_ASYNC_ERROR_HANDLING``, which
    ``ProcessGroupNCCL`` reads as it is made (torch's own setting wins where both are set)."""
    mode = knobs.value("SMDDP_NCCL_ASYNC_ERROR_HANDLING")
    given = mode is not None and not os.environ.get(_TORCH_ERROR_HANDLING)
    if given:
        os.environ[_TORCH_ERROR_HANDLING] = str(mode)
    try:
        yield
    finally:
        if given:
            os.environ.pop(_TORCH_ERROR_HANDLING, None)


_TORCH_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"


def _cuda_device(ctx: Context) -> torch.device:
    if not torch.cuda.is_available():
        raise BackendUnavailableError(
            f"the 'torch-nccl' backend needs a CUDA GPU and torch {torch.__version__} sees none; "
            f"install {TORCH_CUDA_INSTALL}")
    if not tdist.is_nccl_available():
        raise BackendUnavailableError(f"this torch build has no NCCL; install {TORCH_CUDA_INSTALL}")
    device = pick_device(ctx, "cuda")
    torch.cuda.set_device(device)
    return device


def _xpu_device(ctx: Context, name: str) -> torch.device:
    xpu = getattr(torch, "xpu", None)
    if xpu is None or not xpu.is_available():
        raise BackendUnavailableError(
            f"the {name!r} backend needs an Intel GPU and torch {torch.__version__} sees none; install {XPU_INSTALL}")
    device = pick_device(ctx, "xpu")
    xpu.set_device(device)
    return device


def xccl_available() -> bool:
    """True when this torch has its native XCCL backend (XPU builds of torch >= 2.8)."""
    available = getattr(tdist, "is_xccl_available", None)
    return bool(available and available())


def ccl_backend(store, rank: int, size: int, timeout):
    """A oneCCL backend object from Intel's ``oneccl_bindings_for_pytorch``.

    Importing the bindings registers torch backend ``"ccl"``; its creator is called here.

    Raises:
        BackendUnavailableError: the bindings are not installed (says what to install).
    """
    try:
        import oneccl_bindings_for_pytorch  # noqa: F401 - registers torch backend "ccl"
    except ImportError as exc:
        raise BackendUnavailableError(
            f"no oneCCL for this Intel GPU job ({exc}); install {XPU_INSTALL}"
        ) from exc
    backend = _compat.plugin_backend("CCL", store, rank, size, timeout)
    if backend is None:
        raise BackendUnavailableError(
            "oneccl_bindings_for_pytorch did not register the 'ccl' backend with this torch; "
            f"install the bindings built for torch {torch.__version__}"
        )
    return backend
