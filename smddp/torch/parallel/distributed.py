"""smddp's ``DistributedDataParallel``: torch's DDP bound to smddp's process group.

torch's reducer (bucketing, overlap with backward, ``no_sync``) does the work; smddp
gives it the signature and defaults of smdistributed's DDP and its own process group.
"""

from __future__ import annotations

import inspect

import torch
from torch.nn.parallel import DistributedDataParallel as _TorchDDP

from smddp.errors import InvalidGroupError, NotInitializedError
from smddp.torch import distributed as _dist
from smddp.torch import process_group as _pg

DEFAULT_BUCKET_CAP_MB = 25
_HAS_FORWARD_SYNC = "forward_sync_buffers" in inspect.signature(_TorchDDP.__init__).parameters


class DistributedDataParallel(_TorchDDP):
    """smddp's implementation of distributed data parallelism for PyTorch.

    In most cases, wrapping your PyTorch Module with smddp's ``DistributedDataParallel``
    is all you need to do. Creation of this class requires smddp already initialized with
    :func:`smddp.torch.distributed.init_process_group`.

    The module is replicated on each process; rank 0's parameters and buffers are
    broadcast at construction so every replica starts identical. During the backwards
    pass, gradients from each process are averaged, bucket by bucket, while backward
    continues. ``no_sync()`` skips the reduction for gradient accumulation.

    Args:
        module (torch.nn.Module): PyTorch NN Module to be parallelized.
        device_ids (list[int], optional): CUDA devices, only for a module on a single
            CUDA device; ``None`` or empty for CPU and multi-device modules.
        output_device (int, optional): device of the output for single-device CUDA
            modules (default ``device_ids[0]``).
        broadcast_buffers (bool): sync (broadcast from rank 0) the module's buffers at the
            beginning of each forward. Defaults to ``True`` (smdistributed ignored it;
            smddp does it).
        process_group: only ``None`` or ``group.WORLD`` is supported.
        bucket_cap_mb (int, optional): bucket size in megabytes for gradient reduction
            (default 25).
        **kwargs: other arguments of ``torch.nn.parallel.DistributedDataParallel``
            (``find_unused_parameters``, ``gradient_as_bucket_view``, ``static_graph``, ...).

    Raises:
        NotInitializedError: smddp is not initialized.
        InvalidGroupError: ``process_group`` is not ``None`` or ``group.WORLD``.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        device_ids=None,
        output_device=None,
        broadcast_buffers=True,
        process_group=None,
        bucket_cap_mb=None,
        **kwargs,
    ):
        pg = _pg.current()
        if pg is None:
            raise NotInitializedError(
                "DistributedDataParallel needs smddp initialized: call "
                "smddp.torch.distributed.init_process_group() before wrapping the model"
            )
        if process_group is not None and process_group is not _dist.group.WORLD and process_group is not pg:
            raise InvalidGroupError(
                f"process_group={process_group!r} is not supported; pass None or "
                f"smddp.torch.distributed.group.WORLD"
            )
        if _HAS_FORWARD_SYNC:
            # torch >= 2.13 renamed the flag; rank 0's buffers are broadcast at init either way.
            if not broadcast_buffers:
                kwargs.setdefault("forward_sync_buffers", False)
        else:
            kwargs["broadcast_buffers"] = broadcast_buffers
        super().__init__(
            module,
            device_ids=device_ids,
            output_device=output_device,
            process_group=pg,
            bucket_cap_mb=DEFAULT_BUCKET_CAP_MB if bucket_cap_mb is None else bucket_cap_mb,
            **kwargs,
        )
