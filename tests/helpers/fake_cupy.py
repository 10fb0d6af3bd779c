"""A stand-in for ``cupy.cuda.nccl`` with only what smddp calls when it loads NCCL (no GPU, no NCCL).

For tests of loading, codes and the unique id's exchange; the communicator's calls run on
:mod:`nccl_standin` instead.
"""

from __future__ import annotations

import sys
import types

#: A unique id as CuPy < 14 returned it on x86 (a tuple of signed chars).
X86_ID = tuple([-44, -58, 67, 96, 0, 127, -128, 2] + [0] * 120)  # CuPy < 14 on x86: signed char


def fake_cupy(monkeypatch, *, available=True, bf16=True, uid=None, version=22703):
    """Install a stand-in for ``cupy.cuda.nccl`` (only what smddp calls at load time)."""
    nccl = types.ModuleType("cupy.cuda.nccl")
    nccl.available = available
    constants = dict(NCCL_INT8=0, NCCL_UINT8=1, NCCL_INT32=2, NCCL_INT64=4, NCCL_FLOAT16=6, NCCL_FLOAT32=7,
                     NCCL_FLOAT64=8, NCCL_SUM=0, NCCL_PROD=1, NCCL_MAX=2, NCCL_MIN=3, NCCL_AVG=4)
    if bf16:
        constants["NCCL_BFLOAT16"] = 9
    for key, value in constants.items():
        setattr(nccl, key, value)
    if available:
        nccl.NcclCommunicator = object
    calls = []

    def get_unique_id():
        calls.append("get_unique_id")
        return uid

    nccl.get_unique_id = get_unique_id
    nccl.get_version = lambda: version
    nccl.calls = calls
    cuda = types.ModuleType("cupy.cuda")
    cuda.nccl = nccl
    cupy = types.ModuleType("cupy")
    cupy.cuda = cuda
    for name, module in (("cupy", cupy), ("cupy.cuda", cuda), ("cupy.cuda.nccl", nccl)):
        monkeypatch.setitem(sys.modules, name, module)
    return nccl
