"""The reduction arithmetic every CPU plane shares: :class:`Op`, and how tensors fold under it.

What a reduction means on every CPU backend (mpi, gloo, the shared-memory plane's Python path,
the engine's derived collectives), written once: the operations (:class:`Op`), which dtypes
have which (:func:`check_reduction`, gloo's rules), half precision reduced in float32
(:data:`HALF`, :func:`widened`), bool as its bytes where a library has no bool type
(:func:`bool_as_bytes`), a fold in place (:func:`combine`), a fold of rows in rank order
(:func:`reduce_rows`) and AVERAGE as a sum divided (:func:`average`).
"""

from __future__ import annotations

import enum

import torch

from smddp.errors import InvalidTypeError


class Op(enum.Enum):
    """Reduction operations a communicator understands.

    Their order gives their codes (:data:`smddp.comm.mismatch.fingerprint.OPS`, the compiled core's
    ``R_*`` in ``_shm_fold.h``): a new one goes at the end. The bitwise ones (:data:`BITWISE`)
    take integer and bool tensors (:func:`check_reduction`).
    """

    SUM = "sum"
    AVERAGE = "average"
    MIN = "min"
    MAX = "max"
    PRODUCT = "product"
    BAND = "band"
    BOR = "bor"
    BXOR = "bxor"

    # Members are singletons compared by identity: hash them in C, not with Enum's Python
    # __hash__ (every collective looks its op up in a table).
    __hash__ = object.__hash__


def average(tensor: torch.Tensor, size: int) -> None:
    """Turn a SUM into smddp's AVERAGE in place: divide by ``size`` (integers round toward zero)."""
    if tensor.is_floating_point():
        tensor.div_(size)
    else:
        tensor.div_(size, rounding_mode="trunc")


#: Half-precision tensors are reduced in float32, then rounded once, on every CPU backend
#: (mpi, gloo, and the derived reduce-scatter): a result does not depend on the backend or
#: on rounding at each step. NCCL reduces in the dtype, as torch's NCCL group does.
HALF = (torch.float16, torch.bfloat16)


def widened(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself, or a float32 copy of a half-precision one, to reduce in."""
    return tensor.float() if tensor.dtype in HALF else tensor


#: The bitwise reductions: integer and bool tensors only, as gloo has them (NCCL has none).
BITWISE = frozenset({Op.BAND, Op.BOR, Op.BXOR})
#: The reductions of numbers, which every backend has.
ARITHMETIC = (Op.SUM, Op.AVERAGE, Op.MIN, Op.MAX, Op.PRODUCT)
_NOT_FOR_EVERY_DTYPE = BITWISE | {Op.AVERAGE}


def check_reduction(dtype: torch.dtype, op: Op, what: str = "all_reduce") -> None:
    """Refuse a reduction that tensors of ``dtype`` do not have, before anything is sent.

    gloo's rules, on every CPU plane: a bitwise op (``BAND``, ``BOR``, ``BXOR``) of
    floating-point or complex numbers (gloo: "Cannot use ReduceOp.BAND with non-integral
    dtype"), and AVERAGE of bools (gloo fails it; torch's NCCL group refuses it).

    Args:
        dtype: the tensors' dtype.
        op: the reduction.
        what: the collective, for the message.

    Raises:
        InvalidTypeError: naming the op and the dtype.
    """
    if op not in _NOT_FOR_EVERY_DTYPE:
        return
    if op is Op.AVERAGE:
        if dtype is torch.bool:
            raise InvalidTypeError(
                f"{what}: AVERAGE of bool tensors is refused (gloo fails it, torch's NCCL group refuses it); "
                f"use SUM (a logical or), MIN, MAX or a bitwise op, or convert to a number type")
    elif dtype.is_floating_point or dtype.is_complex:
        name = str(dtype).replace("torch.", "")
        raise InvalidTypeError(
            f"{what}: {op.name} of {name} tensors is refused, as by gloo: the bitwise reductions (BAND, BOR, "
            f"BXOR) take integer and bool tensors")


#: bool reduced as its bytes (0 and 1 as uint8) where a library has no bool type (MPI): SUM and
#: PRODUCT become MAX and MIN, a logical or and a logical and, as gloo's bool arithmetic (no
#: 1 + 1 = 2); MIN, MAX and the bitwise ops act on 0 and 1 as logic does.
_BOOL_AS_BYTES = {Op.SUM: Op.MAX, Op.PRODUCT: Op.MIN}


def bool_as_bytes(tensor: torch.Tensor, op: Op):
    """``(tensor, op)``, or for a bool tensor its uint8 view and the op that reduces it so.

    Check the pair first (:func:`check_reduction`: AVERAGE of bools is refused).
    """
    if tensor.dtype is torch.bool:
        return tensor.view(torch.uint8), _BOOL_AS_BYTES.get(op, op)
    return tensor, op


def combine(acc: torch.Tensor, incoming: torch.Tensor, op: Op) -> None:
    """Fold ``incoming`` into ``acc`` in place with ``op`` (AVERAGE folds as a sum).

    bool tensors fold as torch's bool arithmetic does: SUM an or, PRODUCT an and.
    """
    if op in (Op.SUM, Op.AVERAGE):
        acc.add_(incoming)
    elif op is Op.MIN:
        torch.minimum(acc, incoming, out=acc)
    elif op is Op.MAX:
        torch.maximum(acc, incoming, out=acc)
    elif op is Op.PRODUCT:
        acc.mul_(incoming)
    elif op is Op.BAND:
        acc.bitwise_and_(incoming)
    elif op is Op.BOR:
        acc.bitwise_or_(incoming)
    else:
        acc.bitwise_xor_(incoming)


def reduce_rows(rows: torch.Tensor, op: Op, out: torch.Tensor) -> None:
    """Reduce the rows of ``rows`` (``size x n``) in row order into ``out`` (``n`` elements).

    Args:
        rows: one row per rank, rank order.
        op: the reduction; AVERAGE divides the sum by the number of rows (integers truncate).
        out: where the result goes (any shape with ``n`` elements).
    """
    acc = rows[0].to(torch.float32 if rows.dtype in HALF else rows.dtype, copy=True)
    for row in rows[1:]:
        combine(acc, row, op)
    if op is Op.AVERAGE:
        average(acc, rows.shape[0])
    out.detach().copy_(acc.view(out.shape))
