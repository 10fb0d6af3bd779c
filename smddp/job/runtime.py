"""The environment every process smddp starts finds, as a process of SageMaker's runner does.

Scripts written for SageMaker, and the libraries they use (Hugging Face, accelerate,
Lightning, AWS's examples), read these variables rather than asking a library::

    RANK  WORLD_SIZE  LOCAL_RANK  LOCAL_WORLD_SIZE  SMDATAPARALLEL_LOCAL_RANK
    MASTER_ADDR  MASTER_PORT  SAGEMAKER_INSTANCE_TYPE

:func:`fill` computes them from the launcher's own variables (:func:`smddp.job.topology.discover`)
at the start of every rank (``smddp.launch.bootstrap``); a value already set wins. Under an MPI
launcher without ``MASTER_ADDR``/``MASTER_PORT``, rank 0 chooses them and sends them to the
others with one MPI broadcast (as ``smddp.comm.store`` does for its own store).
"""

from __future__ import annotations

import errno
import json
import socket
from typing import Dict, Mapping, MutableMapping, Optional, Tuple

from smddp.errors import InvalidArgumentError
from smddp.job import mca, sockets
from smddp.job.topology import Topology
from smddp.job.wire import bcast_json

#: Every variable :func:`fill` may set, in the order the docs list them.
VARIABLES = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SMDATAPARALLEL_LOCAL_RANK",
    "MASTER_ADDR", "MASTER_PORT", "SAGEMAKER_INSTANCE_TYPE",
)
#: Launchers whose ``MASTER_PORT`` is already held by the launcher itself (torchrun's agent store).
_PORT_OWNED_BY_LAUNCHER = frozenset({"torchrun"})


def instance_type(env: Mapping[str, str]) -> Optional[str]:
    """The SageMaker instance type this process runs on, if the environment says.

    Read from ``SAGEMAKER_INSTANCE_TYPE``, ``SM_CURRENT_INSTANCE_TYPE``, ``SM_TRAINING_ENV``'s
    ``current_instance_type``, then ``SM_FRAMEWORK_PARAMS``' ``sagemaker_instance_type``.
    """
    for name in ("SAGEMAKER_INSTANCE_TYPE", "SM_CURRENT_INSTANCE_TYPE"):
        if env.get(name):
            return env[name]
    for name, key in (("SM_TRAINING_ENV", "current_instance_type"), ("SM_FRAMEWORK_PARAMS", "sagemaker_instance_type")):
        try:
            value = json.loads(env.get(name) or "{}").get(key)
        except (ValueError, AttributeError):
            continue
        if isinstance(value, str) and value:
            return value
    return None


def local_address(topo: Topology) -> str:
    """Rank 0's address for the other ranks: ``SMDDP_SOCKET_IFNAME``'s address when set, else
    loopback when the job is on one host, else the host name."""
    name = sockets.interface()
    if name:
        return sockets.interface_address(name)
    return sockets.LOOPBACK if topo.local_size >= topo.size else socket.getfqdn()


def free_port() -> int:
    """A TCP port free on every interface of this host right now."""
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def check_port_free(port: int, where: str) -> None:
    """Raise if a TCP ``port`` of this host is taken, before anything waits on it.

    Raises:
        InvalidArgumentError: the port is in use (the message names it and ``where`` it came from).
    """
    with socket.socket() as sock:
        # As TCPStore does: a port whose last connections linger in TIME_WAIT is still usable.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("", port))
        except OSError as exc:
            if exc.errno not in (errno.EADDRINUSE, errno.EACCES):
                raise
            reason = "already in use" if exc.errno == errno.EADDRINUSE else "not allowed"
            raise InvalidArgumentError(
                f"MASTER_PORT={port} ({where}) is {reason} on this host ({socket.gethostname()}): "
                f"choose a free port, or unset MASTER_PORT and let the launcher pick one"
            ) from None


def _master_over_mpi(topo: Topology, addr: Optional[str], port: Optional[int]) -> Tuple[Optional[str], Optional[int]]:
    """Rank 0's choice of the missing address and port, sent to every rank over MPI."""
    mca.one_host_defaults()
    try:
        from mpi4py import MPI
    except ImportError:
        return addr, port  # no MPI here: torch's env:// will say what is missing
    chosen = None
    if MPI.COMM_WORLD.Get_rank() == 0:
        chosen = [addr or local_address(topo), port or free_port()]
    # As JSON in a buffer broadcast: mpi4py's lowercase bcast would unpickle what arrives.
    got = bcast_json(MPI.COMM_WORLD, chosen, root=0)
    if not (isinstance(got, list) and len(got) == 2 and isinstance(got[0], str) and type(got[1]) is int):
        raise InvalidArgumentError(f"rank 0 sent a malformed master address over MPI: {got!r}")
    return got[0], got[1]


def fill(env: MutableMapping[str, str], topo: Topology) -> Dict[str, str]:
    """Set the variables of :data:`VARIABLES` that ``env`` lacks, for the process ``topo`` describes.

    Nothing is set for a process no launcher started (a plain ``python train.py`` is not a
    job), except ``SAGEMAKER_INSTANCE_TYPE`` when known. On rank 0, a ``MASTER_PORT`` that is
    already taken on this host is an error (unless the launcher is torchrun, whose own store
    holds it).

    Args:
        env: the environment to complete, usually ``os.environ``.
        topo: this process's topology, from :func:`smddp.job.topology.discover` on ``env``.

    Returns:
        The variables set, by name.

    Raises:
        InvalidArgumentError: ``MASTER_PORT`` is in use on rank 0's host.
    """
    added: Dict[str, str] = {}

    def put(name: str, value: object) -> None:
        if value is not None and not env.get(name):
            env[name] = added[name] = str(value)

    put("SAGEMAKER_INSTANCE_TYPE", instance_type(env))
    if not topo.distributed:
        return added
    put("RANK", topo.rank)
    put("WORLD_SIZE", topo.size)
    put("LOCAL_RANK", topo.local_rank)
    put("LOCAL_WORLD_SIZE", topo.local_size)
    put("SMDATAPARALLEL_LOCAL_RANK", topo.local_rank)
    addr = env.get("MASTER_ADDR") or topo.master_addr
    port = env.get("MASTER_PORT") or topo.master_port
    if topo.size == 1:
        addr, port = addr or "127.0.0.1", port or free_port()
    elif topo.mpi and not (addr and port):
        addr, port = _master_over_mpi(topo, addr, int(port) if port else None)
    put("MASTER_ADDR", addr)
    put("MASTER_PORT", port)
    if topo.rank == 0 and env.get("MASTER_PORT") and topo.launcher not in _PORT_OWNED_BY_LAUNCHER:
        where = "chosen from the Slurm job id" if "MASTER_PORT" in added and topo.launcher == "slurm" else "environment"
        check_port_free(int(env["MASTER_PORT"]), where)
    return added
