"""Argument checks every backend would make, done before anything is sent.

Every :class:`~smddp.comm.engine.Engine` owns a :class:`ArgumentChecks` (``engine.checks``): it
picks the communicator for a call's tensors (device and dtype), checks ranks, per-rank
lists and split sizes, and gives each collective a contiguous buffer. An argument error
raises on the calling rank before any rank communicates, as torch's process groups do.
The engine's own collectives and the ones built on them
(:mod:`smddp.comm.algorithms.derived`) check through it.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch

from smddp.comm.base import Communicator
from smddp.errors import BackendUnavailableError, InvalidArgumentError, InvalidTypeError


class ArgumentChecks:
    """The argument checks of one engine's group.

    Args:
        rank: this process's rank in the group.
        size: the number of ranks in the group.
        comms: device type to communicator, as the engine has them.
        backend: the name of the group's primary backend (for errors).
    """

    __slots__ = ("rank", "size", "comms", "backend", "_cpu_comm")

    def __init__(self, rank: int, size: int, comms: Dict[str, Communicator], backend: str):
        self.rank, self.size, self.comms, self.backend = rank, size, comms, backend
        self._cpu_comm: Optional[Communicator] = comms.get("cpu")

    def comm_for(self, *tensors: torch.Tensor) -> Communicator:
        """The communicator that serves ``tensors``: one device and one dtype it supports.

        Raises:
            InvalidTypeError: not a tensor, different dtypes, or a dtype the backend refuses.
            InvalidArgumentError: tensors on different devices.
            BackendUnavailableError: no communicator serves the tensors' device.
        """
        tensor = tensors[0]
        if isinstance(tensor, torch.Tensor):
            # The hot paths, one tensor or CPU tensors of one dtype: a few attribute reads each
            # (a torch.device, which the general path compares, costs a new object per read;
            # tensor.is_cpu is 10x cheaper than tensor.device.type). Every collective's
            # small-message cost includes this.
            cpu = tensor.is_cpu
            comm = self._cpu_comm if cpu else self.comms.get(tensor.device.type)
            dtype = tensor.dtype
            if comm is not None and dtype in comm.dtypes:
                if len(tensors) == 1:
                    return comm
                if cpu:
                    for t in tensors:
                        if not (isinstance(t, torch.Tensor) and t.is_cpu and t.dtype == dtype):
                            break
                    else:
                        return comm
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                raise InvalidTypeError(f"expected a torch.Tensor, got {type(t).__name__}")
        device = tensor.device
        for t in tensors:
            if t.device != device:
                raise InvalidArgumentError(f"tensors are on different devices: {device} and {t.device}")
        comm = self.comms.get(device.type)
        if comm is None:
            raise BackendUnavailableError(
                f"the {self.backend!r} backend does not serve {device.type} tensors "
                f"(this job serves: {', '.join(sorted(self.comms))})"
            )
        dtype = tensors[0].dtype
        for t in tensors:
            if t.dtype != dtype:
                raise InvalidTypeError(f"tensors have different dtypes: {dtype} and {t.dtype}")
        if dtype not in comm.dtypes:
            names = ", ".join(sorted(str(d).replace("torch.", "") for d in comm.dtypes))
            raise InvalidTypeError(f"dtype {dtype} is not supported by the {comm.name} backend; use one of: {names}")
        return comm

    @staticmethod
    def buffer(tensor: torch.Tensor, op: str = "collective", what: str = "tensor"):
        """A contiguous buffer for ``tensor`` and what to do once the operation is done.

        Raises:
            InvalidArgumentError: ``tensor`` has overlapping memory (:func:`check_writable`).
        """
        if tensor.is_contiguous():
            # Communicators also finish with torch in-place ops (AVERAGE's divide, the copy
            # back from a bfloat16 upcast), which autograd refuses on a leaf that requires grad.
            return (tensor.detach() if tensor.requires_grad else tensor), None
        check_writable(tensor, op, what)
        target = tensor.detach()
        buf = target.contiguous()
        return buf, lambda: target.copy_(buf)

    def per_rank(
        self, tensors: Sequence[torch.Tensor], reference: torch.Tensor, op: str, what: str, other: str
    ) -> None:
        """``tensors`` holds one tensor per rank, each with ``reference``'s number of elements."""
        if len(tensors) != self.size:
            raise InvalidArgumentError(f"{op}: {what} has {len(tensors)} tensors; it needs one per rank ({self.size})")
        for i, t in enumerate(tensors):
            if t.numel() != reference.numel():
                raise InvalidArgumentError(
                    f"{op}: {what}[{i}] has shape {tuple(t.shape)}, the {other} has shape "
                    f"{tuple(reference.shape)}: they must have the same number of elements"
                )

    def rank_arg(self, rank, what: str) -> None:
        """``rank`` (the argument called ``what``) is an int rank of this group."""
        if isinstance(rank, bool) or not isinstance(rank, int):
            raise InvalidTypeError(f"{what} must be an int rank, got {type(rank).__name__}")
        if not 0 <= rank < self.size:
            raise InvalidArgumentError(f"{what}={rank} is not a rank of this job (0..{self.size - 1})")

    def self_split(self, out_counts: Sequence[int], in_counts: Sequence[int], op: str) -> None:
        """This rank receives from itself what it sends itself: a mismatch is an error here alone."""
        mine = self.rank
        if out_counts[mine] != in_counts[mine]:
            raise InvalidArgumentError(
                f"{op}: rank {mine} sends itself {in_counts[mine]} elements but expects {out_counts[mine]} "
                f"from itself: its input and output parts for rank {mine} (split sizes, or list entries) must "
                f"have the same size"
            )

    def split_counts(self, tensor: torch.Tensor, splits: Optional[Sequence[int]], what: str) -> List[int]:
        """Elements per rank of ``tensor`` (``what``: ``"input"`` or ``"output"``), from its split sizes.

        Raises:
            InvalidArgumentError: splits that do not fit the world size or the tensor.
        """
        rows = tensor.shape[0] if tensor.dim() > 0 else 1
        row_numel = tensor.numel() // rows if rows else 0
        if splits is None or len(splits) == 0:
            if rows % self.size:
                raise InvalidArgumentError(
                    f"all_to_all_single: {what} has {rows} rows along dim 0, not divisible by the "
                    f"world size {self.size}; pass {what}_split_sizes"
                )
            return [rows // self.size * row_numel] * self.size
        splits = list(splits)
        if len(splits) != self.size or any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in splits):
            raise InvalidArgumentError(
                f"all_to_all_single: {what}_split_sizes must be {self.size} non-negative ints, got {splits}"
            )
        if sum(splits) != rows:
            raise InvalidArgumentError(
                f"all_to_all_single: {what}_split_sizes {splits} add up to {sum(splits)}, but {what} has "
                f"{rows} rows along dim 0"
            )
        return [s * row_numel for s in splits]


def check_writable(tensor: torch.Tensor, op: str, what: str) -> None:
    """Refuse an output that is not dense, or whose elements share memory (a stride 0, as
    ``expand()`` makes).

    A result cannot be written back into such a tensor: torch's ``copy_`` refuses it, and by
    then the data would have been sent. Contiguous tensors never overlap; callers check only
    the others.

    Raises:
        InvalidTypeError: ``tensor`` is not dense (a sparse or mkldnn layout).
        InvalidArgumentError: two elements of ``tensor`` are one memory location.
    """
    if tensor.layout is not torch.strided:
        raise InvalidTypeError(
            f"{op}: {what} has layout {tensor.layout}; collectives take dense tensors: pass {what}.to_dense()"
        )
    for size, stride in zip(tensor.shape, tensor.stride()):
        if stride == 0 and size > 1:
            raise InvalidArgumentError(
                f"{op}: {what} has overlapping memory (shape {tuple(tensor.shape)}, stride {tensor.stride()}: "
                f"several elements are one memory location, as after expand()), so the result cannot be "
                f"written into it; pass a tensor with memory of its own: {what}.contiguous() or {what}.clone()"
            )
