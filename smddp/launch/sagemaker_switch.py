"""SageMaker's data-parallel switch on a machine without a GPU: Hugging Face and accelerate on CPU.

A job submitted with ``distribution={"smdistributed": {"dataparallel": {"enabled": True}}}``
finds ``"sagemaker_distributed_dataparallel_enabled": true`` in ``SM_FRAMEWORK_PARAMS``
(accelerate's own SageMaker launcher adds ``ACCELERATE_USE_SAGEMAKER=true`` and
``ACCELERATE_SAGEMAKER_DISTRIBUTED_TYPE=DATA_PARALLEL``). transformers and accelerate then
take a path written for GPUs:

- accelerate's ``PartialState`` imports ``smdistributed.dataparallel.torch.torch_smddp``, calls
  ``init_process_group(backend="smddp")``, then picks the CUDA device ``local rank % number of
  CUDA devices``: a ``ZeroDivisionError`` without GPUs, unless ``ACCELERATE_TORCH_DEVICE``
  names the device;
- transformers' ``Trainer`` wraps the model in torch's ``DistributedDataParallel(model,
  device_ids=[SMDATAPARALLEL_LOCAL_RANK])``, and accelerate's ``prepare`` in
  ``DistributedDataParallel(model, device_ids=[local rank], output_device=local rank)``; torch
  refuses ``device_ids`` for a module on CPU.

:func:`apply` runs in every process smddp starts, before the user's script (smddprun's
ranks, local mode's). Where the switch is on and no CUDA device is visible, it

- sets ``ACCELERATE_TORCH_DEVICE=cpu``, unless the user set it;
- makes torch's ``DistributedDataParallel`` take ``device_ids=[local rank]`` (with
  ``output_device`` unset or the local rank) for a module whose parameters are all on the CPU
  as no ``device_ids``, which is what torch asks of a CPU module. Any other ``device_ids`` still
  gets torch's own error.

Nothing changes where a GPU is visible or the switch is off.
"""

from __future__ import annotations

import functools
import json
import os
from typing import Any, List, Mapping, MutableMapping, Optional

#: accelerate's variable for the device of every process (``cpu`` here).
DEVICE_ENV = "ACCELERATE_TORCH_DEVICE"
#: Marks torch's ``DistributedDataParallel.__init__`` once :func:`apply` has wrapped it.
_WRAPPED = "_smddp_sagemaker_switch"


def switch_on(env: Mapping[str, str]) -> bool:
    """True when SageMaker's data-parallel switch is on, as transformers or accelerate read it."""
    try:
        params = json.loads(env.get("SM_FRAMEWORK_PARAMS") or "{}")
    except ValueError:
        params = {}
    if isinstance(params, dict) and params.get("sagemaker_distributed_dataparallel_enabled"):
        return True
    return (env.get("ACCELERATE_USE_SAGEMAKER", "").lower() == "true"
            and env.get("ACCELERATE_SAGEMAKER_DISTRIBUTED_TYPE") == "DATA_PARALLEL")


def _local_ranks(env: Mapping[str, str]) -> List[int]:
    """This process's local rank, as accelerate (``LOCAL_RANK``) and the Trainer read it."""
    names = ("LOCAL_RANK", "SMDATAPARALLEL_LOCAL_RANK")
    return [int(env[name]) for name in names if env.get(name, "").isdigit()]


def _names_this_rank(device_ids: Any, output_device: Any, env: Mapping[str, str]) -> bool:
    ranks = _local_ranks(env)
    if not (isinstance(device_ids, (list, tuple)) and len(device_ids) == 1 and device_ids[0] in ranks):
        return False
    return output_device is None or output_device in ranks


def _accept_local_rank_on_cpu(env: Mapping[str, str]) -> None:
    """Wrap torch's ``DistributedDataParallel.__init__`` as the module docstring says (once)."""
    from torch.nn.parallel import DistributedDataParallel

    original = DistributedDataParallel.__init__
    if getattr(original, _WRAPPED, False):
        return

    @functools.wraps(original)
    def __init__(self, module, device_ids=None, output_device=None, *args, **kwargs):
        if _names_this_rank(device_ids, output_device, env):
            params = list(module.parameters())
            if params and all(p.device.type == "cpu" for p in params):
                device_ids = output_device = None
        original(self, module, device_ids, output_device, *args, **kwargs)

    setattr(__init__, _WRAPPED, True)
    DistributedDataParallel.__init__ = __init__


def apply(env: Optional[MutableMapping[str, str]] = None) -> bool:
    """Let a Hugging Face or accelerate script with SageMaker's switch on train on CPU.

    Call in a process smddp started, before the user's script runs. Imports torch only when
    the switch is on.

    Args:
        env: the process's environment; ``os.environ`` by default.

    Returns:
        True when the switch is on and no CUDA device is visible (the changes were made).
    """
    env = os.environ if env is None else env
    if not switch_on(env):
        return False
    import torch

    if torch.cuda.is_available():
        return False
    env.setdefault(DEVICE_ENV, "cpu")
    _accept_local_rank_on_cpu(env)
    return True
