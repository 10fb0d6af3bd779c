"""What to install for each backend's library: the one place these hints are written.

Every error about a missing library and smddp-info's table name them; the registry
(:mod:`smddp.comm`) re-exports them. Backends import them from here, never from the registry.
"""

MPI_INSTALL = "pip install 'smddp[mpi]' (mpi4py and Open MPI)"
CUDA_INSTALL = (
    "pip install 'smddp[cuda]' (CuPy for CUDA 12: cupy-cuda12x; "
    "for CUDA 13 install cupy-cuda13x instead)"
)
TORCH_CUDA_INSTALL = "a CUDA build of torch (pip install torch --index-url https://download.pytorch.org/whl/cu128)"
XPU_INSTALL = (
    "a torch XPU build >= 2.8, which has XCCL (pip install torch --index-url "
    "https://download.pytorch.org/whl/xpu), or Intel's oneCCL bindings (pip install oneccl_bind_pt "
    "--extra-index-url https://pytorch-extension.intel.com/release-whl/stable/xpu/us/)"
)
