"""smddp's ``DistributedDataParallel``: torch's DDP bound to smddp's process group.

torch's reducer (bucketing, overlap with backward, ``no_sync``) does the work; smddp gives
it the signature and defaults of smdistributed's DDP and its own process group. Where every
rank shares one host (the shared-memory plane), a communication hook (:mod:`._hook`)
all-reduces each bucket in the backward thread; elsewhere the group's all-reduces are
non-blocking and complete on the engine's progress thread while backward goes on.
``gradient_as_bucket_view`` defaults to True (one copy of the gradients less per step).
"""

from __future__ import annotations

import inspect
from typing import Any, List, Optional

import torch
import torch.distributed as tdist
from torch.nn.parallel import DistributedDataParallel as _TorchDDP

import smddp.torch.parallel._hook as _hook
from smddp import _compat
from smddp.comm.engine.handle import DETACHABLE
from smddp.comm.reduction import Op
from smddp.errors import InvalidArgumentError, InvalidGroupError, NotInitializedError
from smddp.torch import distributed as _dist
from smddp.torch import groups as _groups

__all__ = ["DistributedDataParallel", "DEFAULT_BUCKET_CAP_MB"]

#: ``bucket_cap_mb=None`` means this many megabytes, as in smdistributed.
DEFAULT_BUCKET_CAP_MB = 25

# torch 2.13 split ``broadcast_buffers`` into a deprecated flag and ``forward_sync_buffers``.
_HAS_FORWARD_SYNC = "forward_sync_buffers" in inspect.signature(_TorchDDP.__init__).parameters


def _smddp_group():
    pg = _groups.current()
    if pg is None:
        raise NotInitializedError(
            "DistributedDataParallel needs smddp initialized: call "
            "smddp.torch.distributed.init_process_group() before wrapping the model"
        )
    return pg


def _check_process_group(process_group, pg) -> None:
    if process_group is None or process_group is _dist.group.WORLD or process_group is pg:
        return
    if process_group is getattr(tdist.GroupMember, "WORLD", None):  # torch's default group is smddp's
        return
    raise InvalidGroupError(
        f"process_group={process_group!r} is not supported: smddp's DistributedDataParallel runs on "
        f"every process of the job; pass None or smddp.torch.distributed.group.WORLD"
    )


class DistributedDataParallel(_TorchDDP):
    """smddp's implementation of distributed data parallelism for PyTorch.

    In most cases, wrapping your PyTorch Module with smddp's ``DistributedDataParallel``
    (DDP) is all you need to do to use smddp. Creation of this DDP class requires smddp
    already initialized with :func:`smddp.torch.distributed.init_process_group`.

    This container parallelizes the application of the given module by splitting the input
    across the specified devices by chunking in the batch dimension. The module is
    replicated on each machine and each device, and each such replica handles a portion of
    the input. Rank 0's parameters and buffers are broadcast at construction, so every
    replica starts identical. During the backwards pass, gradients from each node are
    averaged, bucket by bucket, while backward continues. The batch size should be larger
    than the number of GPUs used locally.

    It is ``torch.nn.parallel.DistributedDataParallel`` bound to smddp's process group:
    ``.module``, ``no_sync()``, ``join()``, communication hooks and ``state_dict()`` (keys
    prefixed ``module.``) behave as in torch, so checkpoints load in either.

    Example::

        import torch
        import smddp.torch.distributed as dist
        from smddp.torch.parallel import DistributedDataParallel as DDP

        dist.init_process_group()
        if torch.cuda.is_available():
            torch.cuda.set_device(dist.get_local_rank())
        model = ...
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3 * dist.get_world_size())
        model = DDP(model)

    Args:
        module (torch.nn.Module): PyTorch NN Module to be parallelized.
        device_ids (list[int], optional): CUDA devices. This should only be provided when
            the input module resides on a single CUDA device. For multi-device modules and
            CPU modules, ``device_ids`` must be ``None`` or an empty list. Defaults to ``None``.
        output_device (int, optional): device location of output for single-device CUDA
            modules (default ``device_ids[0]``). For multi-device modules and CPU modules it
            must be ``None``.
        broadcast_buffers (bool): flag that enables syncing (broadcasting) buffers of the
            module from rank 0 at the beginning of the forward function. Defaults to
            ``True``. smdistributed did not support it; smddp does. With ``False`` buffers
            (such as BatchNorm running statistics) stay rank-local after construction.
        process_group: process groups are not supported; the parameter exists for API
            parity with torch. Only ``None`` or ``smddp.torch.distributed.group.WORLD``.
        bucket_cap_mb (int, optional): DistributedDataParallel buckets parameters so that
            the gradient reduction of each bucket can overlap with backward computation;
            ``bucket_cap_mb`` is the bucket size in megabytes (MB). Defaults to 25.
        **kwargs: other arguments of ``torch.nn.parallel.DistributedDataParallel``, passed
            through with torch's defaults (``find_unused_parameters``, ``static_graph``, ``dim``,
            ...), except ``gradient_as_bucket_view``, which defaults to ``True``: each ``.grad``
            is a view into its all-reduce bucket (one copy of the gradients less per step, and
            less memory). Pass ``False`` for torch's separate gradient tensors.

    Raises:
        NotInitializedError: smddp is not initialized (a ``RuntimeError``).
        InvalidGroupError: ``process_group`` is not ``None`` or ``group.WORLD`` (a ``ValueError``).

    Notes:
        - All parameters must be registered in the model by the time it is wrapped, in the
          same order on every process; do not add or remove parameters afterwards.
        - Gradients are reduced following the reverse order of the registered parameters.
        - On the shared-memory plane (every rank on one host, CPU parameters) smddp registers
          its own communication hook at the first forward, unless one was registered before;
          ``SMDDP_DDP_HOOK=0`` keeps torch's default path.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        device_ids: Optional[List[int]] = None,
        output_device: Optional[Any] = None,
        broadcast_buffers: bool = True,
        process_group=None,
        bucket_cap_mb: Optional[float] = None,
        **kwargs: Any,
    ):
        pg = _smddp_group()
        _check_process_group(process_group, pg)
        sync_buffers_now = False
        if "forward_sync_buffers" in kwargs:
            pass  # the caller speaks torch 2.13's dialect: take it as given
        elif _HAS_FORWARD_SYNC:
            # Buffers are broadcast at construction either way; then in every forward, or not.
            kwargs["forward_sync_buffers"] = bool(broadcast_buffers)
        else:
            kwargs["broadcast_buffers"] = bool(broadcast_buffers)
            sync_buffers_now = not broadcast_buffers
        kwargs.setdefault("gradient_as_bucket_view", True)
        super().__init__(
            module,
            device_ids=device_ids,
            output_device=output_device,
            process_group=pg,
            bucket_cap_mb=DEFAULT_BUCKET_CAP_MB if bucket_cap_mb is None else bucket_cap_mb,
            **kwargs,
        )
        if sync_buffers_now:
            # Older torch skips buffers at construction when broadcast_buffers is False.
            for buffer in self.module.buffers():
                tdist.broadcast(buffer.data, 0, group=pg)
        # smddp's hook goes in at the first forward, so that a hook the caller registers after
        # wrapping replaces it (torch's reducer takes one hook, once). torch's reducer in Python
        # (compiled autograd's "python_reducer") calls hooks per parameter: it keeps its own path.
        self._smddp_hook = "pending" if (
            pg.delegate is None and _hook.completes_inline(pg.engine, self.module) and not self._comm_hooks
            and not getattr(self, "_use_python_reducer", False)) else "off"
        self._smddp_hook_state = _HookState(pg.engine)

    def forward(self, *inputs, **kwargs):
        """Run the module's forward (torch's DDP), installing smddp's all-reduce hook the first time."""
        if self._smddp_hook == "pending":
            self._smddp_hook = "on"
            super().register_comm_hook(self._smddp_hook_state, _allreduce_hook)
        return super().forward(*inputs, **kwargs)

    def _replace_smddp_hook(self, what: str) -> None:
        if self._smddp_hook == "on":
            raise InvalidArgumentError(
                f"{what}: smddp's DistributedDataParallel registered its own communication hook at the first "
                f"forward, and torch's DDP takes one hook per model: call {what} before the first forward, "
                f"or set {_hook.ENV}=0 before wrapping the model")
        self._smddp_hook = "off"

    def register_comm_hook(self, state: object, hook) -> None:
        """torch's ``register_comm_hook``: ``hook`` reduces the gradient buckets instead of smddp's hook.

        Args:
            state: passed to every call of ``hook``.
            hook: ``hook(state, bucket) -> torch.futures.Future[torch.Tensor]``, as in torch.

        Raises:
            InvalidArgumentError: called after the first forward, once smddp's own hook (on the
                shared-memory plane) is registered: call it before the first forward.
        """
        self._replace_smddp_hook("register_comm_hook()")
        super().register_comm_hook(state, hook)

    def _register_builtin_comm_hook(self, comm_hook_type) -> None:
        self._replace_smddp_hook("_register_builtin_comm_hook()")
        _compat.register_builtin_comm_hook(_TorchDDP, self, comm_hook_type)

    def join_hook(self, **kwargs):
        """torch's DDP join hook (``model.join()``, ``torch.distributed.algorithms.Join``), for uneven inputs.

        Joined ranks contribute zero gradients. With ``divide_by_initial_world_size=True`` (torch's
        default) every rank divides by the world size the job started with; with ``False``, by
        the number of ranks that have not joined yet, as in torch: smddp's communication hook
        then counts them with a one-element all-reduce per step.

        Raises:
            InvalidArgumentError: ``divide_by_initial_world_size=False`` on a torch without
                ``PythonCallbackWork`` (torch 2.10 and later), before anything is sent: there torch's
                reducer would wait forever on the ``Work`` of the forward's all-reduce once Python
                has dropped it (see :mod:`smddp.comm.engine.handle`).
        """
        divide_by_active = not kwargs.get("divide_by_initial_world_size", True)
        if divide_by_active and not DETACHABLE:
            raise InvalidArgumentError(
                f"join(divide_by_initial_world_size=False) needs torch's PythonCallbackWork, which torch "
                f"{torch.__version__} lacks (torch's reducer would wait forever on a dropped Work): use "
                f"divide_by_initial_world_size=True, the default, or a newer torch")
        self._smddp_hook_state.divide_by_active = divide_by_active
        return super().join_hook(**kwargs)


class _HookState:
    """The state of smddp's communication hook: the group's engine, and what to divide by."""

    __slots__ = ("engine", "divide_by_active", "scale")

    def __init__(self, engine):
        self.engine = engine
        #: ``join(divide_by_initial_world_size=False)``: divide by the ranks still training.
        self.divide_by_active = False
        #: This step's world size over the number of ranks still training.
        self.scale = 1.0


@_compat.opaque_to_dynamo  # torch's reducer calls it, in a compiled step's backward too
def _allreduce_hook(state: _HookState, bucket) -> torch.futures.Future:
    """smddp's hook (:func:`._hook.allreduce_hook`), dividing by the ranks not yet joined where asked.

    torch's reducer divides by that number only on its own path; with a hook, the hook divides.
    Ranks that have joined run the hook outside backward, on zero buckets, in the same bucket
    order (torch's ``_match_all_reduce_for_bwd_pass``); so at the first bucket of a step every
    rank adds 1 if it is still training (in backward), 0 if it has joined, and the average over
    the world is scaled by the world size over that count.
    """
    future = _hook.allreduce_hook(state.engine, bucket)
    if not state.divide_by_active:
        return future
    if bucket.index() == 0:
        training = torch.ones(1) if _compat.in_backward() else torch.zeros(1)
        state.engine.all_reduce(training, Op.SUM)
        state.scale = state.engine.size / max(training.item(), 1.0)
    scale = state.scale
    if scale == 1.0:
        return future
    return future.then(lambda done: done.value().mul_(scale))


# torch checks a hook's annotations against its own types; this module's are strings.
_allreduce_hook.__annotations__ = {
    "state": _HookState, "bucket": tdist.GradBucket, "return": torch.futures.Future[torch.Tensor]}
