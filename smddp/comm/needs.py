"""What to install for each backend's library, and whether it is importable: the one place these are written.

Every error about a missing library and smddp-info's table name them; the registry
(:mod:`smddp.comm`) re-exports them. Backends import them from here, never from the registry.
"""

import importlib.util

MPI_INSTALL = "pip install 'smddp[mpi]' (mpi4py and Open MPI)"
CUDA_INSTALL = (
    "pip install 'smddp[cuda12]' for a CUDA 12 build of torch (cupy-cuda12x and nvidia-nccl-cu12), or "
    "'smddp[cuda13]' for CUDA 13 (cupy-cuda13x and nvidia-nccl-cu13); torch.version.cuda says which"
)
TORCH_CUDA_INSTALL = "a CUDA build of torch (pip install torch --index-url https://download.pytorch.org/whl/cu128)"
XPU_INSTALL = (
    "a torch XPU build >= 2.8, which has XCCL (pip install torch --index-url "
    "https://download.pytorch.org/whl/xpu), or Intel's oneCCL bindings (pip install oneccl_bind_pt "
    "--extra-index-url https://pytorch-extension.intel.com/release-whl/stable/xpu/us/)"
)


def has_module(name: str) -> bool:
    """True if ``name`` can be imported here (found without importing it: importing mpi4py starts MPI)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False
