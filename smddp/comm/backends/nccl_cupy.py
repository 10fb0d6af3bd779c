"""CuPy's NCCL module (``cupy.cuda.nccl``): loading it, and its data type and operation codes."""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from smddp.comm.backends.devices import CUDA_INSTALL
from smddp.comm.base import Op
from smddp.errors import BackendUnavailableError

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

#: ``nccl.get_version()`` of NCCL 2.10, which added ``ncclAvg`` and ``ncclBfloat16``
#: (the code is major * 10000 + minor * 100 + patch since 2.9).
NCCL_2_10 = 21000




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


