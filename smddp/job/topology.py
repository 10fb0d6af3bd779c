"""Who am I: rank, sizes and rendezvous address, read from the launcher's environment.

:func:`discover` is a pure function of an environment mapping, so every launcher's
variables are checked by a table of cases (``tests/job/test_topology.py``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Mapping, Optional, Tuple

from smddp.errors import InvalidArgumentError

#: Launchers that start processes through an MPI runtime (the ``mpi`` backend can run).
MPI_LAUNCHERS = frozenset({"openmpi", "mpich", "pmix"})
#: Set by smddprun's own launcher (no mpirun) to its pid in every process it starts.
LAUNCHER_PID_ENV = "SMDDP_LAUNCHER_PID"
#: Set by torchrun in every process it starts.
_TORCHRUN_MARK = "TORCHELASTIC_RUN_ID"
#: First port of Slurm jobs' rendezvous: the port is this plus the job id's last 4 digits,
#: as Lightning's SLURMEnvironment derives it, so every task agrees without communicating.
SLURM_BASE_PORT = 15000


@dataclass(frozen=True)
class Topology:
    """Where this process sits in the job.

    Attributes:
        rank: global rank, ``0 <= rank < size``.
        size: number of processes in the job.
        local_rank: rank among the processes on this host.
        local_size: number of processes on this host.
        node_rank: index of this host.
        master_addr: address of rank 0's host for TCP rendezvous, if the launcher gave one.
        master_port: port for TCP rendezvous, if the launcher gave one.
        launcher: ``"torchrun"``, ``"openmpi"``, ``"mpich"``, ``"pmix"``, ``"slurm"``,
            ``"sagemaker"``, ``"explicit"`` or ``"none"`` (a plain ``python script.py``).
    """

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1
    node_rank: int = 0
    master_addr: Optional[str] = None
    master_port: Optional[int] = None
    launcher: str = "none"

    @property
    def distributed(self) -> bool:
        """True when a launcher started this process as part of a job."""
        return self.launcher != "none"

    @property
    def mpi(self) -> bool:
        """True when an MPI runtime started this process."""
        return self.launcher in MPI_LAUNCHERS


def _int(env: Mapping[str, str], *names: str) -> Optional[int]:
    for name in names:
        value = env.get(name)
        if value not in (None, ""):
            try:
                return int(value)
            except ValueError as exc:
                raise ValueError(f"environment variable {name}={value!r} is not an integer") from exc
    return None


def _port(env: Mapping[str, str]) -> Optional[int]:
    return _int(env, "MASTER_PORT")


def _slurm_tasks_on_node(spec: str, node_id: int) -> Optional[int]:
    """Tasks on node ``node_id`` from Slurm's compressed ``"2(x3),1"`` form."""
    index = 0
    for part in spec.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not match:
            return None
        count, repeat = int(match.group(1)), int(match.group(2) or 1)
        if node_id < index + repeat:
            return count
        index += repeat
    return None


def first_slurm_host(nodelist: str) -> Optional[str]:
    """First host of a Slurm node list such as ``"gpu[003-005,9],cpu1"``."""
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist)
    if not match:
        return None
    prefix, ranges = match.group(1), match.group(2)
    if ranges is None:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def _slurm_master(env: Mapping[str, str]) -> Tuple[Optional[str], Optional[int]]:
    """Rank 0's host (first of the step's or job's node list) and the port derived from the job id."""
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_NODELIST") or env.get("SLURM_JOB_NODELIST") or ""
    job = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID") or ""
    port = SLURM_BASE_PORT + int(job[-4:]) if job.isdigit() else None
    return first_slurm_host(nodelist), port


def _launcher_topology(
    env: Mapping[str, str], master_addr: Optional[str], master_port: Optional[int],
) -> Optional[Topology]:
    """The topology from an MPI launcher's or Slurm's own variables, or None."""
    if "OMPI_COMM_WORLD_RANK" in env:
        # OMPI_COMM_WORLD_NODE_RANK is a rank among a node's processes, not the node's index:
        # the index is derived, exact for the usual by-slot placement.
        r = _int(env, "OMPI_COMM_WORLD_RANK")
        local_size = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE") or 1
        return Topology(
            r, _int(env, "OMPI_COMM_WORLD_SIZE") or 1, _int(env, "OMPI_COMM_WORLD_LOCAL_RANK") or 0,
            local_size, r // local_size, master_addr, master_port, "openmpi",
        )
    if "PMI_RANK" in env and "PMI_SIZE" in env:
        r = _int(env, "PMI_RANK")
        local_size = _int(env, "MPI_LOCALNRANKS") or 1
        return Topology(
            r, _int(env, "PMI_SIZE"), _int(env, "MPI_LOCALRANKID") or 0, local_size,
            r // local_size, master_addr, master_port, "mpich",
        )
    if "PMIX_RANK" in env:
        # PMIx exports no size; the MPI library has it. Slurm or the PMI size may say.
        r = _int(env, "PMIX_RANK")
        size = _int(env, "PMI_SIZE", "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS") or r + 1
        local_size = _int(env, "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE") or 1
        return Topology(
            r, size, _int(env, "MPI_LOCALRANKID", "SLURM_LOCALID") or 0, local_size,
            _int(env, "SLURM_NODEID") or r // local_size, master_addr, master_port, "pmix",
        )
    if "SLURM_PROCID" in env and "SLURM_STEP_NUM_TASKS" in env:
        # SLURM_STEP_NUM_TASKS is set by srun only: a batch script's own shell is not a job.
        r = _int(env, "SLURM_PROCID")
        node = _int(env, "SLURM_NODEID") or 0
        local_size = _slurm_tasks_on_node(env.get("SLURM_STEP_TASKS_PER_NODE", ""), node) or 1
        addr, port = _slurm_master(env)
        return Topology(
            r, _int(env, "SLURM_STEP_NUM_TASKS"), _int(env, "SLURM_LOCALID") or 0, local_size,
            node, master_addr or addr, master_port or port, "slurm",
        )
    return None


def _check_agrees(env: Mapping[str, str], topo: Topology) -> None:
    """A ``RANK``/``WORLD_SIZE`` set by hand must say what the launcher says."""
    for name, value in (("RANK", topo.rank), ("WORLD_SIZE", topo.size)):
        given = _int(env, name)
        if given is not None and given != value:
            raise InvalidArgumentError(
                f"{name}={given} contradicts the launcher ({topo.launcher}), which started this process as "
                f"rank {topo.rank} of {topo.size} ({name}={value}); unset {name} or launch with {name}={value}"
            )


def discover(
    env: Mapping[str, str],
    rank: Optional[int] = None,
    world_size: Optional[int] = None,
) -> Topology:
    """Read the job's topology from ``env``; the first source that matches wins.

    Sources, in order: explicit ``rank``/``world_size``; the launcher's own variables: Open
    MPI (``OMPI_COMM_WORLD_*``), MPICH and Intel MPI (``PMI_RANK``, ``PMI_SIZE``,
    ``MPI_LOCALRANKID``, ``MPI_LOCALNRANKS``), PMIx (``PMIX_RANK``), Slurm's ``srun``
    (``SLURM_PROCID``, ``SLURM_STEP_NUM_TASKS``, ``SLURM_LOCALID``); torchrun's ``RANK``,
    ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` (they win over an MPI launcher's only
    when torchrun or smddprun itself started the process, e.g. torchrun inside an ``mpirun``
    job); SageMaker with several hosts and one process each (``SM_HOSTS``,
    ``SM_CURRENT_HOST``); otherwise a world of one.

    Under ``srun`` without ``MASTER_ADDR``/``MASTER_PORT`` the address is the first host of
    the step's node list and the port ``15000`` plus the job id's last four digits (as
    Lightning's ``SLURMEnvironment`` does), the same in every task.

    Args:
        env: the environment, usually ``os.environ``.
        rank: an explicit rank (``init_process_group(rank=...)``); needs ``world_size``.
        world_size: an explicit world size.

    Returns:
        The :class:`Topology` of this process.

    Raises:
        ValueError: a variable is not an integer, only one of ``rank``/``world_size`` was
            given, or the rank is outside the world.
        InvalidArgumentError: ``RANK`` or ``WORLD_SIZE`` was set by hand and contradicts the
            MPI launcher or Slurm (the message names both values).
    """
    master_addr = env.get("MASTER_ADDR") or None
    master_port = _port(env)
    topo: Optional[Topology] = None

    if (rank is None) != (world_size is None):
        raise ValueError("pass both rank and world_size, or neither")
    if rank is not None and world_size is not None:
        local_size = _int(env, "LOCAL_WORLD_SIZE") or world_size
        topo = Topology(
            rank, world_size, _int(env, "LOCAL_RANK") or rank % local_size, local_size,
            rank // local_size, master_addr, master_port, "explicit",
        )
    else:
        topo = _launcher_topology(env, master_addr, master_port)
        own = _TORCHRUN_MARK in env or LAUNCHER_PID_ENV in env  # torchrun / smddprun set RANK themselves
        if "RANK" in env and "WORLD_SIZE" in env and (topo is None or own):
            size = _int(env, "WORLD_SIZE")
            local_size = _int(env, "LOCAL_WORLD_SIZE") or size
            r = _int(env, "RANK")
            topo = Topology(
                r, size, _int(env, "LOCAL_RANK") or 0, local_size,
                _int(env, "GROUP_RANK") or r // local_size, master_addr, master_port, "torchrun",
            )
        elif topo is not None:
            _check_agrees(env, topo)
    if topo is None and "SM_HOSTS" in env and "SM_CURRENT_HOST" in env:
        hosts = json.loads(env["SM_HOSTS"])
        if len(hosts) > 1:
            node = hosts.index(env["SM_CURRENT_HOST"])
            topo = Topology(
                node, len(hosts), 0, 1, node, master_addr or hosts[0],
                master_port or _int(env, "SM_MASTER_PORT") or 7777, "sagemaker",
            )

    if topo is None:
        topo = Topology(master_addr=master_addr, master_port=master_port)
    if not 0 <= topo.rank < topo.size:
        raise ValueError(f"rank {topo.rank} is outside a world of size {topo.size} ({topo.launcher})")
    if not 0 <= topo.local_rank < max(topo.local_size, 1):
        raise ValueError(
            f"local rank {topo.local_rank} is outside a host of {topo.local_size} processes ({topo.launcher})"
        )
    return topo
