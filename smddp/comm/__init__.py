"""smddp's communication: the registry that picks a backend, and the parts beneath it.

- :mod:`smddp.comm.engine`: runs every collective (order, checks, deadlines, failures);
- :mod:`smddp.comm.backends`: one communicator module per library (the CPU ones named once, in
  :mod:`smddp.comm.backends.cpu`);
- :mod:`smddp.comm.planes`: a group's CPU communicator, shared memory composed over the flat one;
- :mod:`smddp.comm.algorithms`: collectives built from the engine's own;
- :mod:`smddp.comm.base` (the communicator interface), :mod:`smddp.comm.reduction` (what a
  reduction means), :mod:`smddp.comm.waiting` (the wait loop), :mod:`smddp.comm.subgroups`
  (subgroups) and :mod:`smddp.comm.store` (the job's store).

Selection order: ``init_process_group(backend=...)``, then the ``SMDDP_BACKEND``
environment variable, then :func:`choose_backend`'s automatic choice. Modules are
imported only when their backend is chosen (importing ``mpi4py.MPI`` starts MPI).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
from dataclasses import dataclass
from typing import Callable, Dict, Mapping, Optional, Tuple

from smddp import knobs
from smddp.comm.backends.cpu import CPU_BACKENDS
from smddp.comm.needs import CUDA_INSTALL, MPI_INSTALL, TORCH_CUDA_INSTALL, XPU_INSTALL, has_module  # noqa: F401 - re-exported
from smddp.errors import BackendUnavailableError
from smddp.job.topology import Topology


@dataclass(frozen=True)
class BackendInfo:
    """A registered backend: where its class lives and what it needs."""

    name: str
    target: str  # "module:Class"; a delegating backend's: "module:function" (see create_delegate)
    device: str  # the device type whose tensors it moves ("cpu", "cuda", "xpu")
    needs: str  # what to install when it is missing
    summary: str
    #: It hands its device's tensors to torch's own backend object as they come (the delegated
    #: route, :mod:`smddp.comm.backends.torch_native`); the engine then serves CPU tensors only.
    delegated: bool = False


#: Every backend, by name: the CPU ones from their registry (:mod:`smddp.comm.backends.cpu`), the
#: device ones below.
BACKENDS: Dict[str, BackendInfo] = {
    name: BackendInfo(name, backend.target, "cpu", backend.needs, backend.summary)
    for name, backend in CPU_BACKENDS.items()
}


def register(info: BackendInfo) -> None:
    """Add or replace a backend in the registry."""
    BACKENDS[info.name] = info


# Device backends. The delegating ones hand their device's tensors to torch's own backend object
# (smddp/comm/backends/torch_native.py); nccl moves them itself, through CuPy; each pairs with a CPU
# communicator for CPU tensors (smddp/comm/backends/devices.py).
_NATIVE = "smddp.comm.backends.torch_native:create"
for _info in (
    BackendInfo("torch-nccl", _NATIVE, "cuda", TORCH_CUDA_INSTALL,
                "CUDA tensors handed to torch's own ProcessGroupNCCL as they come; the default on CUDA",
                delegated=True),
    BackendInfo("nccl", "smddp.comm.backends.nccl.communicator:NCCLCommunicator", "cuda", CUDA_INSTALL,
                "NCCL through CuPy, smddp's own stream and lifetime rules, stall reports and SMDDP_DEBUG "
                "checks on CUDA tensors (opt-in: SMDDP_BACKEND=nccl)"),
    BackendInfo("xccl", _NATIVE, "xpu", XPU_INSTALL,
                "Intel GPUs: XPU tensors handed to torch's XCCL, else oneCCL's bindings; the default on XPU",
                delegated=True),
    BackendInfo("ccl", _NATIVE, "xpu", XPU_INSTALL,
                "Intel's oneccl_bindings_for_pytorch, handed XPU tensors (CPU ones where there is no XPU)",
                delegated=True),
    BackendInfo("torch-gloo", _NATIVE, "cpu", "a torch build with gloo (every official wheel has it)",
                "CPU tensors handed to torch's own ProcessGroupGloo as they come: the GPU's route on a CPU, "
                "without smddp's planes", delegated=True),
):
    register(_info)


@dataclass(frozen=True)
class Probe:
    """What this machine has, as far as backend selection is concerned.

    :func:`probe` fills it from the running process; tests build it by hand to cover
    machines that are not here.
    """

    cuda: bool = False
    xpu: bool = False
    mpi4py: bool = False
    cupy: bool = False
    xccl: bool = False
    ccl: bool = False


def probe() -> Probe:
    """Look at this process: devices torch sees and the communication libraries importable."""
    import torch
    import torch.distributed as tdist

    xpu = bool(getattr(torch, "xpu", None) and torch.xpu.is_available())
    is_xccl = getattr(tdist, "is_xccl_available", None)
    return Probe(
        cuda=torch.cuda.is_available(),
        xpu=xpu,
        mpi4py=has_module("mpi4py"),
        cupy=has_module("cupy"),
        xccl=bool(is_xccl and is_xccl()),
        ccl=has_module("oneccl_bindings_for_pytorch"),
    )


# Automatic choice per accelerator; the first whose condition holds wins.
_AUTO: Tuple[Tuple[str, Callable[[Probe, Topology], bool]], ...] = (
    ("torch-nccl", lambda found, topology: found.cuda),  # CuPy's nccl is the opt-in, installed or not
    ("xccl", lambda found, topology: found.xpu and (found.xccl or found.ccl)),
)

def _device_backend_missing(name: str, found: Probe) -> Optional[str]:
    """Why device backend ``name`` cannot run on a machine like ``found``; None if it can."""
    no_cuda = "torch sees no CUDA GPU (torch.cuda.is_available() is False: no GPU, or a CPU build of torch)"
    if name == "nccl":
        if not found.cuda:
            return f"the 'nccl' backend needs a CUDA GPU, and {no_cuda}; use 'gloo' or 'mpi' for CPU tensors"
        if not found.cupy:
            return (f"the 'nccl' backend needs CuPy, which is not installed: {CUDA_INSTALL}; or leave "
                    f"SMDDP_BACKEND unset for 'torch-nccl' (torch's own NCCL group, the default, no CuPy needed)")
    elif name == "torch-nccl" and not found.cuda:
        return f"the 'torch-nccl' backend needs a CUDA GPU, and {no_cuda}; use 'gloo' or 'mpi' for CPU tensors"
    elif name == "xccl":
        if not found.xpu:
            return "the 'xccl' backend needs an Intel GPU, and torch sees none (torch.xpu.is_available() is False)"
        if not (found.xccl or found.ccl):
            return f"the 'xccl' backend needs oneCCL, and this torch has no XCCL: install {XPU_INSTALL}"
    elif name == "ccl" and not found.ccl:
        return f"the 'ccl' backend needs Intel's oneccl_bindings_for_pytorch: install {XPU_INSTALL}"
    return None


def choose_backend(requested: Optional[str], env: Mapping[str, str], topology: Topology, found: Probe) -> str:
    """The backend to use.

    Args:
        requested: ``init_process_group(backend=...)``, or None.
        env: the environment (``SMDDP_BACKEND`` is read from it).
        topology: this process's topology.
        found: what this machine has (:func:`probe`).

    Returns:
        A name in :data:`BACKENDS`.

    Automatic choice: a world of one without a launcher is ``local``; on CUDA ``torch-nccl``
    (CuPy's ``nccl`` is an opt-in, installed or not); on an Intel GPU ``xccl``; otherwise ``mpi``
    under an MPI launcher with mpi4py, else ``gloo``.

    Raises:
        BackendUnavailableError: the name is unknown (the message lists the valid ones), a
            device backend was asked for where its device or library is missing, or the
            machine has an Intel GPU and no oneCCL (each message says what to install).
    """
    name = requested or knobs.value("SMDDP_BACKEND", env)
    if name in (None, "", "auto", "smddp"):
        if not topology.distributed and topology.size == 1:
            return "local"
        for candidate, applies in _AUTO:
            if candidate in BACKENDS and applies(found, topology):
                return candidate
        if found.xpu:
            raise BackendUnavailableError(
                f"this machine has an Intel GPU but no oneCCL (this torch has no XCCL and "
                f"oneccl_bindings_for_pytorch is not installed): install {XPU_INSTALL}; or set SMDDP_BACKEND=gloo "
                f"to use CPU tensors only"
            )
        return "mpi" if topology.mpi and found.mpi4py else "gloo"
    name = name.lower().replace("_", "-")
    if name not in BACKENDS:
        raise BackendUnavailableError(
            f"unknown backend {name!r}; valid backends: {', '.join(sorted(BACKENDS))} (or 'auto')"
        )
    missing = _device_backend_missing(name, found)
    if missing is not None:
        raise BackendUnavailableError(missing)
    return name


def backend_class(name: str):
    """Import and return the communicator class of backend ``name`` (a delegating backend's: its
    delegate factory, :func:`smddp.comm.backends.torch_native.create`).

    Raises:
        BackendUnavailableError: unknown name, or its library is not installed (the
            message says what to install).
    """
    info = BACKENDS.get(name)
    if info is None:
        raise BackendUnavailableError(
            f"unknown backend {name!r}; valid backends: {', '.join(sorted(BACKENDS))}"
        )
    module_name, class_name = info.target.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise BackendUnavailableError(
            f"the {name!r} backend cannot be loaded ({exc}); install it with: {info.needs}"
        ) from exc
    return getattr(module, class_name)


def create_communicators(name: str, ctx) -> Dict[str, object]:
    """Build backend ``name``'s communicators: device type to communicator.

    CPU tensors get :func:`smddp.comm.planes.choose.build`'s communicator: the backend's own (``mpi``,
    ``gloo``) composed with the fastest plane the group's layout allows (shared memory
    within a host), under any launcher. A delegating backend (``torch-nccl``, ``xccl``, ...)
    gets that CPU communicator alone: its device's tensors go to torch's own backend object
    (:func:`create_delegate`). A device backend's class may define ``build(ctx)`` returning
    several (it adds the CPU communicator through ``ctx.cpu``); otherwise one instance serves
    its device types. The CPU-plane settings are read from the environment here, once per
    world group.

    Raises:
        BackendUnavailableError: as :func:`backend_class`, or the backend cannot start here.
    """
    from smddp.comm.planes import choose  # imports torch: not at the registry's import

    found = choose.settings()
    cpu_backend = CPU_BACKENDS.get(name)
    if cpu_backend is not None and cpu_backend.planes:
        return {"cpu": choose.build(name, ctx, found)}
    companion = choose.companion(ctx.topology, has_module("mpi4py"), found)
    if BACKENDS[name].delegated:
        return {"cpu": choose.build(companion, ctx, found)}
    cls = backend_class(name)
    ctx = dataclasses.replace(ctx, cpu=lambda c: choose.build(companion, c, found))
    build = getattr(cls, "build", None)
    if build is not None:
        return build(ctx)
    comm = cls(ctx)
    return {device: comm for device in cls.device_types}


def create_delegate(name: str, ctx, cpu, group_name: str = "", ranks=None, parent=None):
    """torch's own backend object to which backend ``name`` hands its device's tensors; None when
    ``name`` does not delegate.

    Args:
        name: the group's backend.
        ctx: the group's context.
        cpu: the group's CPU communicator (:func:`create_communicators`): its ranks have met, and
            its local rank picks this rank's device where no launcher counted one.
        group_name: the group's name as torch registered it.
        ranks: a subgroup's global ranks (None: the world).
        parent: a subgroup's world delegate to split from (torch's rule: the world is bound to a
            device), else None.

    Returns:
        A :class:`smddp.comm.backends.torch_native.Delegate`, or None.

    Raises:
        BackendUnavailableError: the device or its library is missing (the message says what to install).
    """
    if not BACKENDS[name].delegated:
        return None
    topology = dataclasses.replace(ctx.topology, local_rank=cpu.local_rank, local_size=cpu.local_size)
    ctx = dataclasses.replace(ctx, topology=topology, layout=getattr(cpu, "layout", None))
    return backend_class(name)(name, ctx, group_name, ranks, parent)
