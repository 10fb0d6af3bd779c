"""Who am I: rank, sizes and rendezvous address, read from the launcher's environment.

:func:`discover` is a pure function of an environment mapping, so every launcher's
variables are checked by a table of cases (``tests/job/test_topology.py``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Mapping, Optional, Tuple

from smddp import knobs
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


#: Each launcher in words, for errors.
_LAUNCHERS = {"torchrun": "torchrun", "smddprun": "smddprun", "openmpi": "Open MPI's mpirun",
              "mpich": "MPICH's or Intel MPI's launcher", "pmix": "the PMIx launcher", "slurm": "Slurm's srun",
              "sagemaker": "SageMaker"}
#: Who sets each launcher's variables, for errors: ``WORLD_SIZE=0 (set by torchrun)``.
_SETTERS = {**{key: f"set by {words}" for key, words in _LAUNCHERS.items()}, "environment": "environment"}
#: A number of processes (a world, a host) and an index among them, as the launchers' variables hold them.
_COUNT = knobs.Whole(1, 1 << 24)
_INDEX = knobs.Whole(0, (1 << 24) - 1)
#: A TCP port the other ranks can connect to.
PORT = knobs.Whole(1, 65535)
#: The variables each source gives rank, size, local rank and local size in (errors name them).
_NAMES = {
    "torchrun": ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
    "openmpi": ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                "OMPI_COMM_WORLD_LOCAL_SIZE"),
    "mpich": ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    "pmix": ("PMIX_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    "slurm": ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID", "SLURM_STEP_TASKS_PER_NODE"),
    "explicit": ("rank", "world_size", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
    "sagemaker": ("SM_CURRENT_HOST", "SM_HOSTS", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
}


def _env_setter(env: Mapping[str, str]) -> str:
    """Who set ``RANK``, ``WORLD_SIZE``, ``LOCAL_*`` and ``MASTER_*`` in this process, for errors."""
    if _TORCHRUN_MARK in env:
        return _SETTERS["torchrun"]
    if LAUNCHER_PID_ENV in env:
        return _SETTERS["smddprun"]
    return _SETTERS["environment"]


def _int(env: Mapping[str, str], *names: str, rule: knobs.Whole = _INDEX, source: str = "environment") -> Optional[int]:
    """The first of ``names`` set in ``env``, read by smddp's one parser (:func:`smddp.knobs.read`).

    Raises:
        InvalidArgumentError: it is not a whole number within ``rule`` (the error names it and ``source``).
    """
    for name in names:
        value = env.get(name)
        if value not in (None, ""):
            return knobs.read(name, value, rule, source, f"; {_WHAT_TO_DO}")
    return None


_WHAT_TO_DO = "the launcher that set it, or whoever exported it by hand, must set it right (or unset it)"


def _port(env: Mapping[str, str]) -> Optional[int]:
    return _int(env, "MASTER_PORT", rule=PORT, source=_env_setter(env))


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
        by = _SETTERS["openmpi"]
        r = _int(env, "OMPI_COMM_WORLD_RANK", source=by)
        local_size = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", rule=_COUNT, source=by) or 1
        return Topology(
            r, _int(env, "OMPI_COMM_WORLD_SIZE", rule=_COUNT, source=by) or 1,
            _int(env, "OMPI_COMM_WORLD_LOCAL_RANK", source=by) or 0,
            local_size, r // local_size, master_addr, master_port, "openmpi",
        )
    if "PMI_RANK" in env and "PMI_SIZE" in env:
        by = _SETTERS["mpich"]
        r = _int(env, "PMI_RANK", source=by)
        local_size = _int(env, "MPI_LOCALNRANKS", rule=_COUNT, source=by) or 1
        return Topology(
            r, _int(env, "PMI_SIZE", rule=_COUNT, source=by), _int(env, "MPI_LOCALRANKID", source=by) or 0,
            local_size, r // local_size, master_addr, master_port, "mpich",
        )
    if "PMIX_RANK" in env:
        # PMIx exports no size; the MPI library has it. Slurm or the PMI size may say.
        by = _SETTERS["pmix"]
        r = _int(env, "PMIX_RANK", source=by)
        size = _int(env, "PMI_SIZE", "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", rule=_COUNT, source=by) or r + 1
        local_size = _int(env, "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE", rule=_COUNT, source=by) or 1
        return Topology(
            r, size, _int(env, "MPI_LOCALRANKID", "SLURM_LOCALID", source=by) or 0, local_size,
            _int(env, "SLURM_NODEID", source=by) or r // local_size, master_addr, master_port, "pmix",
        )
    if "SLURM_PROCID" in env and "SLURM_STEP_NUM_TASKS" in env:
        # SLURM_STEP_NUM_TASKS is set by srun only: a batch script's own shell is not a job.
        by = _SETTERS["slurm"]
        r = _int(env, "SLURM_PROCID", source=by)
        node = _int(env, "SLURM_NODEID", source=by) or 0
        local_size = _slurm_tasks_on_node(env.get("SLURM_STEP_TASKS_PER_NODE", ""), node) or 1
        addr, port = _slurm_master(env)
        return Topology(
            r, _int(env, "SLURM_STEP_NUM_TASKS", rule=_COUNT, source=by), _int(env, "SLURM_LOCALID", source=by) or 0,
            local_size, node, master_addr or addr, master_port or port, "slurm",
        )
    return None


def _check_agrees(env: Mapping[str, str], topo: Topology) -> None:
    """A ``RANK``/``WORLD_SIZE`` set by hand must say what the launcher says."""
    for name, value, rule in (("RANK", topo.rank, _INDEX), ("WORLD_SIZE", topo.size, _COUNT)):
        given = _int(env, name, rule=rule)
        if given is not None and given != value:
            raise InvalidArgumentError(
                f"{name}={given} (environment) contradicts the launcher ({_LAUNCHERS[topo.launcher]}), which "
                f"started this process as rank {topo.rank} of {topo.size} ({name}={value}); unset {name} or "
                f"launch with {name}={value}"
            )


def _check_ranges(topo: Topology, source: str) -> None:
    """The rank within the world and the local rank within the host, else an error naming the variables."""
    rank, size, local_rank, local_size = _NAMES.get(topo.launcher, ("rank", "size", "local rank", "local size"))
    if not 0 <= topo.rank < topo.size:
        remedy = "pass both as the job has them" if topo.launcher == "explicit" else _WHAT_TO_DO
        raise InvalidArgumentError(
            f"{rank}={topo.rank} ({source}) is outside the world: {rank} takes a whole number from 0 to "
            f"{topo.size - 1} ({size}={topo.size}); {remedy}")
    if not 0 <= topo.local_rank < max(topo.local_size, 1):
        raise InvalidArgumentError(
            f"{local_rank}={topo.local_rank} ({source}) is outside its host: {local_rank} takes a whole number "
            f"from 0 to {topo.local_size - 1} ({local_size}={topo.local_size}); {_WHAT_TO_DO}")


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
        ValueError: only one of ``rank``/``world_size`` was given.
        InvalidArgumentError: a variable is not a whole number in its range (a size of at least 1,
            a rank from 0, a ``MASTER_PORT`` from 1 to 65535), the rank is outside the world or the
            local rank outside its host (each error names the variable, its value and the launcher
            that set it); or ``RANK`` or ``WORLD_SIZE`` was set by hand and contradicts the MPI
            launcher or Slurm (the message names both values).
    """
    master_addr = env.get("MASTER_ADDR") or None
    master_port = _port(env)
    topo: Optional[Topology] = None

    source = _env_setter(env)
    if (rank is None) != (world_size is None):
        raise ValueError("pass both rank and world_size, or neither")
    if rank is not None and world_size is not None:
        if not isinstance(world_size, int) or world_size < 1:
            raise InvalidArgumentError(
                f"world_size={world_size!r} (init_process_group's argument) is not a number of processes: "
                f"world_size takes a whole number from 1")
        local_size = _int(env, "LOCAL_WORLD_SIZE", rule=_COUNT, source=source) or world_size
        topo = Topology(
            rank, world_size, _int(env, "LOCAL_RANK", source=source) or rank % local_size, local_size,
            rank // local_size, master_addr, master_port, "explicit",
        )
        source = "init_process_group's argument"
    else:
        topo = _launcher_topology(env, master_addr, master_port)
        own = _TORCHRUN_MARK in env or LAUNCHER_PID_ENV in env  # torchrun / smddprun set RANK themselves
        if "RANK" in env and "WORLD_SIZE" in env and (topo is None or own):
            size = _int(env, "WORLD_SIZE", rule=_COUNT, source=source)
            local_size = _int(env, "LOCAL_WORLD_SIZE", rule=_COUNT, source=source) or size
            r = _int(env, "RANK", source=source)
            topo = Topology(
                r, size, _int(env, "LOCAL_RANK", source=source) or 0, local_size,
                _int(env, "GROUP_RANK", source=source) or r // local_size, master_addr, master_port, "torchrun",
            )
        elif topo is not None:
            _check_agrees(env, topo)
            source = _SETTERS[topo.launcher]
    if topo is None and "SM_HOSTS" in env and "SM_CURRENT_HOST" in env:
        hosts = json.loads(env["SM_HOSTS"])
        if len(hosts) > 1:
            node = hosts.index(env["SM_CURRENT_HOST"])
            port = master_port or _int(env, "SM_MASTER_PORT", rule=PORT, source=_SETTERS["sagemaker"]) or 7777
            topo = Topology(node, len(hosts), 0, 1, node, master_addr or hosts[0], port, "sagemaker")

    if topo is None:
        topo = Topology(master_addr=master_addr, master_port=master_port)
    _check_ranges(topo, _SETTERS["sagemaker"] if topo.launcher == "sagemaker" else source)
    return topo
