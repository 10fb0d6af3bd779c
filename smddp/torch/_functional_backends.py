"""The torch-native backends an smddp group carries for torch's functional collectives.

torch's functional collectives (``torch.distributed._functional_collectives``, used by
DTensor, FSDP2's state dicts, ``torch.compile``) run as C++ operators: they find the group by
name and ask it for the backend of the tensor's device. For the collectives a Python group
cannot override in C++ (``all_gather_single``, ``reduce_scatter_single``, ``reduce``,
``gather``, ``scatter``, ``alltoall``) that backend must be a torch-native one. So the smddp
group registers, for each device type torch can serve here, torch's own backend created
from the job's store: gloo for CPU, NCCL for CUDA, XCCL for XPU.

Direct calls (``torch.distributed.*``, DDP's reducer, FSDP2's own collectives) still call the
group's Python methods and run on smddp's communicator; see ``docs/fsdp.md``.

Cost: gloo connects its peers as the group is made (one connection per peer, over the process's
shared gloo devices) and NCCL/XCCL create their communicators on first use. Where the group's CPU
communicator is smddp's ``gloo`` (torchrun, ``SMDDP_BACKEND=gloo``, a subgroup of either), its own
gloo group serves the functional collectives too, and where the group hands a device's tensors to
torch's own backend object (:mod:`smddp.torch.delegating_group`), that object serves them: a group
has one gloo group and one device communicator, as torch's own groups do.
"""

from __future__ import annotations

import functools
import time
import warnings
from typing import Callable, Dict, List, Tuple

import torch
import torch.distributed as tdist

from smddp import _compat
from smddp.comm.backends.gloo_group import gloo_group


def gloo_backend(store, rank: int, size: int, timeout, group_name: str, one_host: bool, ranks=None):
    """A ``ProcessGroupGloo`` over the process's shared gloo devices, named as its group.

    Its devices listen where smddp's sockets may (:mod:`smddp.comm.backends.gloo_group`):
    ``one_host``, from the group's agreed layout, says whether loopback reaches every rank.
    """
    return _compat.name_backend(gloo_group(store, rank, size, timeout, one_host), group_name, size, ranks)


def _devices(one_host: bool) -> List[Tuple[str, str, Callable]]:
    """(device type, torch backend type, factory) for each device torch can serve here.

    ``one_host``: every rank of the group is on this host (gloo then listens on loopback).
    """
    found = []
    if tdist.is_gloo_available():
        found.append(("cpu", "GLOO", functools.partial(gloo_backend, one_host=one_host)))
    if torch.cuda.is_available() and tdist.is_nccl_available():
        found.append(("cuda", "NCCL", _compat.nccl_backend))
    xpu = getattr(torch, "xpu", None)
    is_xccl = getattr(tdist, "is_xccl_available", None)
    if xpu is not None and xpu.is_available() and is_xccl is not None and is_xccl():
        found.append(("xpu", "XCCL", _compat.xccl_backend))
    return found


def attach(group: tdist.ProcessGroup, store, rank: int, size: int, timeout, group_name: str,
           delegate=None, ranks=None) -> Dict[str, float]:
    """Register a torch-native backend on ``group`` for every device type available here.

    A backend that cannot be created is skipped with a warning that names the device and the
    reason: the job still runs, but functional collectives on that device will not.

    Args:
        group: the smddp process group.
        store: the group's store (each backend uses its own key prefix in it).
        rank: this process's rank in the group.
        size: the group's size.
        timeout: the group's timeout (a ``datetime.timedelta``).
        group_name: the group's name, as torch registered it.
        delegate: the group's :class:`~smddp.comm.backends.torch_native.Delegate`, if it hands a
            device's tensors to torch's own backend: that object serves its device here too (one
            communicator per device and group).
        ranks: the group's global ranks (None: the world).

    Returns:
        ``{device type: seconds its backend took to create}`` for the backends registered.
    """
    costs: Dict[str, float] = {}
    given = {}
    if delegate is not None:
        given[delegate.device_type] = delegate
        _compat.register_device_backend(group, delegate.device_type, delegate.kind, delegate.backend)
    cpu = group.engine.comms.get("cpu")
    flat = getattr(cpu, "flat", cpu)  # the CPU plane's flat communicator, or the communicator itself
    if "cpu" not in given and isinstance(getattr(flat, "pg", None), tdist.ProcessGroupGloo):
        # smddp's gloo communicator's own gloo group serves torch's functional collectives too
        given["cpu"] = flat.pg
        _compat.register_device_backend(group, "cpu", "GLOO", _compat.name_backend(flat.pg, group_name, size, ranks))
        costs["cpu"] = 0.0
    # Whether every rank is on this host: the group's agreed layout says (its CPU communicator's).
    layout = getattr(cpu, "layout", None)
    one_host = layout.one_host if layout is not None else size == 1
    for device, kind, factory in _devices(one_host):
        if device in given:
            continue
        started = time.perf_counter()
        try:
            backend = factory(tdist.PrefixStore(f"smddp/native/{device}/", store), rank, size, timeout, group_name,
                              ranks=ranks)
            _compat.register_device_backend(group, device, kind, backend)
        except Exception as exc:  # noqa: BLE001 - the job runs without it; say what is lost
            warnings.warn(
                f"smddp: could not create torch's {kind.lower()} backend for {device} tensors ({exc}); "
                f"torch's functional collectives (FSDP2 state dicts, DTensor) will not work on {device} tensors",
                RuntimeWarning, stacklevel=2,
            )
            continue
        costs[device] = time.perf_counter() - started
    return costs
