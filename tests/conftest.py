"""The suite's markers, the helpers' folder on the import path, and the skips that say why.

tests/README.md maps each part of smddp/ to its tests; ``-m unit`` is the fast tier (in-process
tests, no job started).
"""
import sys
from pathlib import Path

import pytest

# The helpers (launchers, the NCCL stand-in) import as top-level modules from every test folder.
sys.path.insert(0, str(Path(__file__).resolve().parent / "helpers"))


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped on CPU machines)")
    config.addinivalue_line("markers", "mpi: needs mpirun and mpi4py")
    config.addinivalue_line("markers", "slow: takes more than a few seconds")
    config.addinivalue_line("markers", "unit: in-process, starts no job (the fast tier: pytest -m unit)")


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        has_cuda = False
    skip_gpu = pytest.mark.skip(reason="no CUDA GPU on this machine (gpu tests run where one is lent)")
    skip_mpi = pytest.mark.skip(reason="mpirun or mpi4py not installed: pip install 'smddp[mpi]'")
    from launchers import MPIRUN

    has_mpi = MPIRUN is not None
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        has_mpi = False
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)
        if "mpi" in item.keywords and not has_mpi:
            item.add_marker(skip_mpi)
