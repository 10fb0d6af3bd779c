"""The CPU backends' registry: the one place a backend that moves CPU tensors is named.

Each entry says where the backend's communicator class lives and what it needs. The registry
(:data:`smddp.comm.BACKENDS`), the planes (:func:`smddp.comm.planes.choose.flat_class`) and the
subgroups (:mod:`smddp.comm.subgroups`) read it, so a new CPU backend is one entry here. Classes are
imported only when asked for (:func:`load`): importing ``mpi4py.MPI`` starts MPI.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Dict

from smddp.comm.needs import MPI_INSTALL
from smddp.errors import BackendUnavailableError


@dataclass(frozen=True)
class CpuBackend:
    """A backend that moves CPU tensors.

    Attributes:
        name: its name (``SMDDP_BACKEND``, ``init_process_group(backend=...)``).
        target: ``"module:Class"``, its communicator class.
        needs: what to install when it is missing.
        summary: one line for ``smddp-info``.
        planes: asked for by name, its CPU tensors go through the planes
            (:func:`smddp.comm.planes.choose.build`); False for ``local``, whose world of one serves
            every device itself.
    """

    name: str
    target: str
    needs: str
    summary: str
    planes: bool = True


_GLOO_NEEDS = "a torch build with gloo (every official wheel has it)"

#: Every CPU backend, by name.
CPU_BACKENDS: Dict[str, CpuBackend] = {
    backend.name: backend
    for backend in (
        CpuBackend("mpi", "smddp.comm.backends.mpi:MPICommunicator", MPI_INSTALL,
                   "MPI through mpi4py; CPU tensors; the default under an MPI launcher"),
        CpuBackend("gloo", "smddp.comm.backends.gloo:GlooCommunicator", _GLOO_NEEDS,
                   "torch's gloo; CPU tensors; the default under torchrun or without mpi4py"),
        CpuBackend("local", "smddp.comm.backends.local:LocalCommunicator", "nothing",
                   "a world of one process: no communication at all", planes=False),
    )
}

#: The CPU backend of a group of one rank (nothing to exchange).
ALONE = "local"
#: The CPU backend any group with a store can make (a subgroup of a backend that cannot make its own).
OVER_A_STORE = "gloo"


def load(name: str) -> type:
    """Import and return the communicator class of CPU backend ``name``.

    Raises:
        BackendUnavailableError: ``name`` is not a CPU backend (the message lists them).
        ImportError: the backend's module cannot be imported here.
    """
    backend = CPU_BACKENDS.get(name)
    if backend is None:
        *others, last = CPU_BACKENDS
        raise BackendUnavailableError(f"{name!r} is not a CPU backend; use {', '.join(others)} or {last}")
    module_name, class_name = backend.target.split(":")
    return getattr(importlib.import_module(module_name), class_name)
