"""Device communicators and the CPU communicator that travels with them.

A device backend (``nccl``, ``torch-nccl``, ``xccl``) moves only its device's tensors.
Training scripts also reduce CPU tensors (a loss read with ``.item()``, a sample count,
a metric), so each device backend's ``build(ctx)`` pairs it with a CPU communicator
and the engine routes every tensor by its device type: smdistributed could not mix
backends; smddp can.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, Optional

import torch

from smddp.comm.base import Communicator, Context
from smddp.comm.needs import CUDA_INSTALL, TORCH_CUDA_INSTALL, XPU_INSTALL
from smddp.errors import BackendUnavailableError, InvalidArgumentError

#: The install hints live with the registry (smddp.comm); re-exported for the device backends.
__all__ = ["CUDA_INSTALL", "TORCH_CUDA_INSTALL", "XPU_INSTALL", "check_device", "device_count",
           "current_as_set", "pick_device", "with_cpu_companion"]

def with_cpu_companion(device_type: str, make: Callable[[Context], Communicator],
                       ctx: Context) -> Dict[str, Communicator]:
    """The device communicator ``make(ctx)`` first, then a CPU communicator for CPU tensors.

    Args:
        device_type: the device type the device communicator serves (``"cuda"``, ``"xpu"``).
        make: creates the device communicator.
        ctx: the job's context; ``ctx.cpu(ctx)`` makes the CPU communicator (the registry sets
            it: :func:`smddp.comm.planes.choose.build` over the launcher's CPU backend).

    Returns:
        ``{device_type: device_comm, "cpu": cpu_comm}``; the engine treats the first as the
        job's backend (barriers run on it).

    The CPU communicator is made first: its ranks agree on the group's layout, whose local rank
    (where the launcher counted none) picks the device.

    Raises:
        BackendUnavailableError: either communicator cannot start (the CPU one is closed
            again when the device one fails), or ``ctx`` has no CPU factory.
    """
    if ctx.cpu is None:
        raise BackendUnavailableError(
            f"the {device_type} backend needs a CPU communicator for CPU tensors: create it through "
            f"smddp.comm.create_communicators")
    cpu_comm = ctx.cpu(ctx)
    # The CPU communicator's ranks have met (smddp.comm.planes.layout): where no launcher counted this
    # host's ranks, its local rank is the group's, and picks this rank's device.
    topology = dataclasses.replace(ctx.topology, local_rank=cpu_comm.local_rank, local_size=cpu_comm.local_size)
    try:
        device_comm = make(dataclasses.replace(ctx, topology=topology))
    except BaseException:
        cpu_comm.close()
        raise
    return {device_type: device_comm, "cpu": cpu_comm}


def device_count(device_type: str) -> int:
    """How many devices of ``device_type`` torch sees (0 when the build has none)."""
    module = getattr(torch, device_type, None)
    if module is None or not module.is_available():
        return 0
    return int(module.device_count())


def pick_device(ctx: Context, device_type: str, count: Optional[int] = None) -> torch.device:
    """This rank's device, as torch's NCCL group picks it.

    1. ``ctx.device``: ``init_process_group(device_id=...)`` (or ``new_group(device_id=...)``);
    2. the current device, where the process has set one: torch has initialised the device
       runtime and the current device is not the untouched default 0
       (``torch.cuda.set_device(i)``, ``with torch.cuda.device(i)``);
    3. ``<type>:<local_rank mod count>``: one process per device (SageMaker runs one per GPU); the
       modulo keeps a job working where the launcher shows each process only its own device
       (``CUDA_VISIBLE_DEVICES`` per rank: every process sees one device, index 0).

    Reading it creates no device context.

    Args:
        ctx: the group's context.
        device_type: ``"cuda"`` or ``"xpu"``.
        count: the number of visible devices (default: ask torch).

    Raises:
        BackendUnavailableError: no device of that type is visible.
        InvalidArgumentError: ``ctx.device`` is of another type or out of range.
    """
    if count is None:
        count = device_count(device_type)
    if count <= 0:
        raise BackendUnavailableError(f"no {device_type} device is visible to this process (torch sees none)")
    if ctx.device is not None:
        device = torch.device(ctx.device)
        if device.type != device_type:
            raise InvalidArgumentError(f"device {device} given to a backend of {device_type} devices")
        if device.index is not None:
            if not 0 <= device.index < count:
                raise InvalidArgumentError(
                    f"device {device} does not exist here: {count} {device_type} device(s) visible")
            return device
    chosen = current_as_set(device_type)
    if chosen is not None and chosen < count:
        return torch.device(device_type, chosen)
    return torch.device(device_type, ctx.topology.local_rank % count)


def current_as_set(device_type: str) -> Optional[int]:
    """The current device of ``device_type`` if this process chose one, else None.

    torch cannot tell a device set to 0 from the default: 0 counts as not chosen (the local
    rank then decides, which is 0 for the first rank of each host).
    """
    module = getattr(torch, device_type, None)
    initialized = getattr(module, "is_initialized", None)
    if initialized is None or not initialized():
        return None
    index = int(module.current_device())
    return index if index != 0 else None


def check_device(tensor: torch.Tensor, device: torch.device, backend: str) -> None:
    """Raise unless ``tensor`` lives on this rank's ``device``.

    Raises:
        InvalidArgumentError: it lives on another device of the same type.
    """
    if tensor.device != device:
        kind = device.type
        raise InvalidArgumentError(
            f"this rank's {backend!r} group runs on {device} (from init_process_group(device_id=...), else the "
            f"device set with torch.{kind}.set_device(), else the local rank), but a tensor is on "
            f"{tensor.device}: move the tensor to {device} (after torch.{kind}.set_device({device.index}), "
            f"'{kind}' means {device}), or choose the group's device before its first collective "
            f"(torch.{kind}.set_device(i), or init_process_group(device_id=...))"
        )
