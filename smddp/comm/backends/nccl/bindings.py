"""CuPy's NCCL module (``cupy.cuda.nccl``): loading it, its data type and operation codes, the
reductions it has not (:func:`check_op`), and the dtypes NCCL has no type for, sent as torch's
NCCL group sends them (:func:`on_the_wire`)."""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from smddp.comm.backends.devices import CUDA_INSTALL
from smddp.comm.reduction import BITWISE, Op
from smddp.errors import BackendUnavailableError, InvalidArgumentError, InvalidTypeError

#: NCCL's ``ncclDataType_t`` values (nccl.h), used where CuPy lacks the constant
#: (older CuPy has no ``NCCL_BFLOAT16``).
_DTYPE_CODES: Dict[torch.dtype, Tuple[str, int]] = {
    torch.int8: ("NCCL_INT8", 0),
    torch.uint8: ("NCCL_UINT8", 1),
    torch.int32: ("NCCL_INT32", 2),
    torch.int64: ("NCCL_INT64", 4),
    torch.float16: ("NCCL_FLOAT16", 6),
    torch.float32: ("NCCL_FLOAT32", 7),
    torch.float64: ("NCCL_FLOAT64", 8),
    torch.bfloat16: ("NCCL_BFLOAT16", 9),
}

#: NCCL's ``ncclRedOp_t`` values (nccl.h).
_OP_CODES: Dict[Op, Tuple[str, int]] = {
    Op.SUM: ("NCCL_SUM", 0),
    Op.PRODUCT: ("NCCL_PROD", 1),
    Op.MAX: ("NCCL_MAX", 2),
    Op.MIN: ("NCCL_MIN", 3),
    Op.AVERAGE: ("NCCL_AVG", 4),
}

def check_op(op: Optional[Op], what: str = "collective") -> None:
    """Refuse a reduction NCCL has not, by name, before anything is sent: the bitwise ones
    (``BAND``, ``BOR``, ``BXOR``), as torch's NCCL group refuses them (a ValueError).

    Raises:
        InvalidArgumentError: ``op`` is a bitwise reduction.
    """
    if op in BITWISE:
        raise InvalidArgumentError(
            f"{what}: {op.name} is refused on NCCL, as by torch's NCCL group: NCCL has no bitwise reductions "
            f"(it has SUM, AVG, MIN, MAX and PRODUCT); reduce such tensors as CPU tensors, which the CPU plane "
            f"serves with BAND, BOR and BXOR")


#: ``nccl.get_version()`` of NCCL 2.10, which added ``ncclAvg`` and ``ncclBfloat16``
#: (the code is major * 10000 + minor * 100 + patch since 2.9).
NCCL_2_10 = 21000

#: Complex tensors travel as their real view (``torch.view_as_real``), as torch's NCCL group
#: sends them; only the reductions that act on each real number alone apply.
COMPLEX = frozenset({torch.complex64, torch.complex128})
_COMPLEX_OPS = (Op.SUM, Op.AVERAGE)
#: float8 tensors travel as bytes (NCCL's uint8), as torch's NCCL group sends them; no reduction.
FLOAT8 = frozenset(getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, name))
#: The dtypes the ``nccl`` backend takes besides those NCCL has a type for: bool (as uint8),
#: complex (as its real view) and float8 (as bytes). int16 has no NCCL type and is refused,
#: as torch's NCCL group refuses it.
CONVERTED = frozenset({torch.bool}) | COMPLEX | FLOAT8


def on_the_wire(tensor: torch.Tensor, op: Optional[Op] = None, what: str = "collective"):
    """What NCCL moves for ``tensor``, and the reduction it applies: torch's NCCL group's rules.

    - bool: its bytes as uint8; SUM becomes MAX (a logical or that cannot overflow), MIN,
      MAX and PRODUCT act on 0 and 1 as logic does; AVERAGE is refused.
    - complex64/complex128: the real view (twice the elements, float32/float64); SUM and
      AVERAGE only (MIN, MAX and PRODUCT of complex numbers are not those of their parts).
    - float8: its bytes as uint8; moved (broadcast, gathers, all_to_all), never reduced.
    - any other dtype: itself, unchanged.

    Args:
        tensor: a contiguous tensor.
        op: the reduction, or None for a collective that moves data only.
        what: the collective's name, for errors.

    Returns:
        ``(wire, op)``: a view of ``tensor``'s memory (writes land in ``tensor``) and the op.

    Raises:
        InvalidTypeError: AVERAGE on bool, or a reduction of float8 (a TypeError, as torch's).
        InvalidArgumentError: MIN, MAX or PRODUCT of complex numbers, or a bitwise reduction of any
            dtype (:func:`check_op`; a ValueError, as torch's).
    """
    check_op(op, what)
    dtype = tensor.dtype
    if dtype not in CONVERTED:
        return tensor, op
    if dtype is torch.bool:
        if op is Op.AVERAGE:
            raise InvalidTypeError(f"{what}: AVERAGE of bool tensors is refused, as by torch's NCCL group; "
                                   f"use SUM (a logical or), MIN or MAX, or convert to a number type")
        return tensor.view(torch.uint8), (Op.MAX if op is Op.SUM else op)
    if dtype in COMPLEX:
        if op is not None and op not in _COMPLEX_OPS:
            raise InvalidArgumentError(f"{what} does not support {op.name} on complex tensors (as torch's "
                                       f"NCCL group); SUM and AVERAGE work on them")
        return torch.view_as_real(tensor).flatten(), op
    if op is not None:
        raise InvalidTypeError(f"{what}: {dtype} tensors are moved, not reduced, on NCCL (as by torch's "
                               f"NCCL group); reduce them in float16, bfloat16 or float32")
    return tensor.view(torch.uint8), op


def load_nccl():
    """CuPy's NCCL module, ``cupy.cuda.nccl``.

    Raises:
        BackendUnavailableError: CuPy is not installed, or it cannot load libnccl (the
            message says what to install, and that ``torch-nccl`` needs neither).
    """
    try:
        from cupy.cuda import nccl
    except Exception as exc:  # noqa: BLE001 - CuPy raises ImportError, or RuntimeError without CUDA
        raise BackendUnavailableError(
            f"the 'nccl' backend needs CuPy, which cannot be imported ({exc}): {CUDA_INSTALL}. "
            f"Or set SMDDP_BACKEND=torch-nccl to use torch's own NCCL group."
        ) from exc
    if not getattr(nccl, "available", True) or not hasattr(nccl, "NcclCommunicator"):
        raise BackendUnavailableError(
            "CuPy is installed but cannot load the NCCL library (libnccl.so.2): import torch first "
            "(CUDA builds of torch bring NCCL), or pip install nvidia-nccl-cu12 (CUDA 13: "
            "nvidia-nccl-cu13), or run: python -m cupyx.tools.install_library --library nccl --cuda 12.x. "
            "Or set SMDDP_BACKEND=torch-nccl to use torch's own NCCL group."
        )
    return nccl


def nccl_dtypes(nccl) -> Dict[torch.dtype, int]:
    """torch dtype to NCCL data type code, from CuPy's constants where it has them."""
    return {dtype: int(getattr(nccl, name, code)) for dtype, (name, code) in _DTYPE_CODES.items()}


def nccl_ops(nccl, version: int) -> Dict[Op, Optional[int]]:
    """:class:`Op` to NCCL reduction code; AVERAGE maps to None before NCCL 2.10 (sum, then divide)."""
    ops: Dict[Op, Optional[int]] = {op: int(getattr(nccl, name, code)) for op, (name, code) in _OP_CODES.items()}
    if version < NCCL_2_10:
        ops[Op.AVERAGE] = None
    return ops


