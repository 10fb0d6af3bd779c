"""``smddprun``: start a data parallel job the way SageMaker's runner does, anywhere.

``smddprun -np N [options] script.py [args]`` (or ``-m module``) on one host starts the N
processes itself (:mod:`smddp.launch.local_job`): they meet at smddp's store on loopback and
all-reduce over shared memory, and the job opens no port on the network; output is tagged with
the rank and the whole job ends when one rank fails. Across hosts (``-H``, ``--hostfile``, a
Slurm allocation), with ``--mpi-args``, or with ``--launcher mpirun``, it runs ``mpirun`` with
the defaults that SageMaker uses and that make sense off SageMaker: root allowed, output tagged
with the rank, the whole job ended when one rank fails, oversubscription when N exceeds the
cores, and the environment that distributed training reads forwarded to every rank.

Every process starts in :mod:`smddp.launch.bootstrap`, which gives it the variables SageMaker's
runner gives its processes (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
``SMDATAPARALLEL_LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``, ``SAGEMAKER_INSTANCE_TYPE``)
and turns on the ``smdistributed`` import alias, so SageMaker scripts run unchanged.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import sysconfig
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from smddp import knobs
from smddp.errors import InvalidArgumentError, SMDDPError
from smddp.job import placement, runtime
from smddp.job.topology import LAUNCHER_PID_ENV, PORT, first_slurm_host
from smddp.launch.args import Options, parse_args
from smddp.launch.local_job import LocalJob
from smddp.launch.mpi_job import MPI, network_args, run_mpirun

#: Variables forwarded to every rank by name (when set), besides the prefixes below.
FORWARD_NAMES = (
    "PATH", "LD_LIBRARY_PATH", "PYTHONPATH", "PYTHONUNBUFFERED", "CUDA_VISIBLE_DEVICES",
    "OMP_NUM_THREADS", "MASTER_ADDR", "MASTER_PORT", "RDMAV_FORK_SAFE", "SAGEMAKER_INSTANCE_TYPE",
)
#: Prefixes of variables forwarded to every rank.
FORWARD_PREFIXES = ("SMDDP_", "NCCL_", "FI_", "SM_")
#: Set inside a batch system's allocation, whose hosts mpirun takes over.
_ALLOCATIONS = ("SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID")


class LaunchError(SMDDPError, RuntimeError):
    """The job cannot be started as asked (no mpirun for several hosts, a missing hostfile)."""


__all__ = ["LaunchError", "Options", "main", "parse_args"]


# ---------------------------------------------------------------- hosts and slots

def _host_slots(opts: Options) -> List[Tuple[str, Optional[int]]]:
    """``[(host, slots or None)]`` from ``-H`` or the hostfile; empty when neither was given."""
    pairs: List[Tuple[str, Optional[int]]] = []
    if opts.hosts:
        for item in filter(None, (h.strip() for h in opts.hosts.split(","))):
            host, _, slots = item.partition(":")
            pairs.append((host, int(slots) if slots.isdigit() else 1))
    elif opts.hostfile:
        try:
            with open(opts.hostfile) as handle:
                lines = handle.read().splitlines()
        except OSError as exc:
            raise LaunchError(f"cannot read hostfile {opts.hostfile!r}: {exc.strerror}") from None
        for line in lines:
            words = line.split("#", 1)[0].split()
            if words:
                match = re.search(r"\bslots=(\d+)", " ".join(words[1:]))
                pairs.append((words[0], int(match.group(1)) if match else None))
    return pairs


def physical_cores() -> int:
    """Physical cores this process may run on: what Open MPI counts as slots by default."""
    try:
        allowed = sorted(os.sched_getaffinity(0))
    except AttributeError:
        allowed = list(range(os.cpu_count() or 1))
    return len(placement.cores(allowed)) or 1


def default_nproc(slots: List[Tuple[str, Optional[int]]], env: Mapping[str, str]) -> int:
    """Processes to start when ``-np`` is not given: the hosts' slots, SM_NUM_GPUS, the GPUs, or 1."""
    if slots and all(n is not None for _, n in slots):
        return sum(n for _, n in slots)
    if env.get("SM_NUM_GPUS", "").isdigit() and int(env["SM_NUM_GPUS"]) > 0:
        return int(env["SM_NUM_GPUS"])
    try:
        import torch

        return max(torch.cuda.device_count(), 1)
    except ImportError:
        return 1


def _oversubscribed(nproc: int, slots: List[Tuple[str, Optional[int]]], env: Mapping[str, str]) -> bool:
    if not slots:
        return nproc > physical_cores() and not any(name in env for name in _ALLOCATIONS)
    if all(n is not None for _, n in slots):
        return nproc > sum(n for _, n in slots)
    return False


free_port = runtime.free_port


# ---------------------------------------------------------------- finding mpirun

def find_mpirun(env: Mapping[str, str]) -> Optional[str]:
    """The ``mpirun`` to use: ``$SMDDP_MPIRUN``, the one beside this Python, then PATH."""
    explicit = knobs.value("SMDDP_MPIRUN", env)
    if explicit:
        found = shutil.which(explicit, path=env.get("PATH"))
        if found is None:
            raise LaunchError(f"SMDDP_MPIRUN={explicit} (environment) is not an executable file here, nor one on "
                              f"PATH: point it at Open MPI's or MPICH's mpirun, or unset it")
        return found
    scripts = sysconfig.get_path("scripts")
    beside = os.path.join(scripts, "mpirun") if scripts else None
    if beside and os.access(beside, os.X_OK):
        return beside
    path = env.get("PATH", "")
    return shutil.which("mpirun", path=path) or shutil.which("mpiexec", path=path)


def identify_mpi(path: str) -> MPI:
    """Ask ``path --version`` which MPI it belongs to (Open MPI unless it says otherwise)."""
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        out = ""
    match = re.search(r"Open MPI\)?\s+(\d+)", out)
    if match:
        return MPI(path, "openmpi", int(match.group(1)))
    if re.search(r"HYDRA|MPICH|Intel\(R\) MPI", out):
        return MPI(path, "hydra")
    return MPI(path, "openmpi")


# ---------------------------------------------------------------- building commands

def _rank_program(opts: Options) -> List[str]:
    return [opts.python, "-m", "smddp.launch.bootstrap", *opts.program]


def single_host(opts: Options, env: Mapping[str, str]) -> bool:
    """True when the job surely runs on this machine alone: no hosts given, no batch allocation."""
    return not (opts.hosts or opts.hostfile or any(name in env for name in _ALLOCATIONS))


def _first_host(opts: Options, env: Mapping[str, str]) -> Optional[str]:
    """The job's first host, where rank 0 runs: from ``-H``/the hostfile, a Slurm allocation, or here."""
    slots = _host_slots(opts)
    if slots:
        return slots[0][0]
    if "SLURM_JOB_ID" in env:
        return first_slurm_host(env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or "")
    if single_host(opts, env):
        return "127.0.0.1"
    return None  # PBS or LSF decides: rank 0 sends its address to the others at start


def _check_user_ranks(env: Mapping[str, str], nproc: int) -> None:
    """A ``RANK``/``WORLD_SIZE`` exported by hand must describe the job smddprun starts."""
    size = env.get("WORLD_SIZE")
    if size not in (None, "") and size != str(nproc):
        raise LaunchError(f"WORLD_SIZE={size} is set, but smddprun starts {nproc} processes (WORLD_SIZE={nproc}): "
                          f"unset WORLD_SIZE or pass -np {size}")
    rank = env.get("RANK")
    if rank not in (None, "") and (rank != "0" or nproc > 1):
        raise LaunchError(f"RANK={rank} is set for every process, but smddprun gives each its own rank "
                          f"(RANK=0 to RANK={nproc - 1}): unset RANK")


def job_environment(opts: Options, env: Mapping[str, str], local: bool = False) -> Dict[str, str]:
    """The environment every rank starts from: ``env`` plus ``-x`` values and smddp's settings.

    Every rank meets at ``MASTER_ADDR`` (the first host: of ``-H``/the hostfile, of the Slurm
    allocation, else ``127.0.0.1``) and ``MASTER_PORT`` (a port free here), unless set.

    Args:
        opts: the command line.
        env: smddprun's own environment.
        local: smddprun starts the ranks itself (no mpirun).

    Raises:
        LaunchError: ``RANK``/``WORLD_SIZE`` contradict the job, or ``MASTER_PORT`` is taken here.
    """
    out = dict(env)
    for spec in opts.exports:
        name, sep, value = spec.partition("=")
        if sep:
            out[name] = value
    _check_user_ranks(out, opts.nproc or 1)
    if local:
        out.setdefault("MASTER_ADDR", "127.0.0.1")
    elif not out.get("MASTER_ADDR"):
        first = _first_host(opts, env)
        if first:
            out["MASTER_ADDR"] = first
    if out.get("MASTER_PORT"):
        given = any(spec.startswith("MASTER_PORT=") for spec in opts.exports)
        try:
            source = "smddprun -x" if given else "environment"
            port = knobs.read("MASTER_PORT", out["MASTER_PORT"], PORT, source,
                              "; or unset it, and smddprun picks a free one")
            if local or out.get("MASTER_ADDR") in ("127.0.0.1", "localhost", socket.gethostname(), socket.getfqdn()):
                runtime.check_port_free(port, source)
        except InvalidArgumentError as exc:
            raise LaunchError(str(exc)) from None
    else:
        out["MASTER_PORT"] = str(free_port())
    if local or single_host(opts, env):
        # As torchrun does: N processes each with a thread per core would fight over the cores.
        out.setdefault("OMP_NUM_THREADS", str(max(physical_cores() // (opts.nproc or 1), 1)))
    out.setdefault("PYTHONUNBUFFERED", "1")
    if not opts.alias:
        out["SMDDP_ALIAS_SMDISTRIBUTED"] = "0"
    return out


def _forwarded(opts: Options, env: Mapping[str, str]) -> List[str]:
    names = [n for n in env if n in FORWARD_NAMES or n.startswith(FORWARD_PREFIXES)]
    names += [spec.partition("=")[0] for spec in opts.exports]
    return sorted(set(names))


def mpirun_command(opts: Options, mpi: MPI, env: Mapping[str, str]) -> List[str]:
    """The full ``mpirun`` command line for ``opts``; ``env`` is :func:`job_environment`'s."""
    slots = _host_slots(opts)
    nproc = opts.nproc or default_nproc(slots, env)
    forwarded = _forwarded(opts, env)
    if mpi.flavor == "hydra":
        cmd = [mpi.path, "-n", str(nproc)]
        if opts.hosts:
            cmd += ["-hosts", opts.hosts]
        if opts.hostfile:
            cmd += ["-f", opts.hostfile]
        cmd += ["-prepend-rank", "-genvlist", ",".join(forwarded)]
    else:
        cmd = [mpi.path, "-np", str(nproc)]
        if opts.hosts:
            cmd += ["--host", opts.hosts]
        if opts.hostfile:
            cmd += ["--hostfile", opts.hostfile]
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            cmd.append("--allow-run-as-root")
        cmd.append("--tag-output")
        if _oversubscribed(nproc, slots, env):
            cmd.append("--oversubscribe")
        if mpi.major >= 5:
            cmd += ["--prtemca", "state_base_error_non_zero_exit", "1"]
        else:
            cmd += ["--mca", "orte_abort_on_non_zero_status", "1"]
        cmd += network_args(mpi, single_host(opts, env), env, opts.mpi_args)
        for name in forwarded:
            cmd += ["-x", name]
    return cmd + opts.mpi_args + _rank_program(opts)


def local_commands(opts: Options, env: Mapping[str, str]) -> List[Tuple[List[str], Dict[str, str]]]:
    """``[(command, environment)]`` of each rank when smddprun starts the processes itself."""
    nproc = opts.nproc or default_nproc([], env)
    commands = []
    for rank in range(nproc):
        rank_env = dict(env)
        rank_env.update(
            RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(nproc),
            GROUP_RANK="0", SMDATAPARALLEL_LOCAL_RANK=str(rank),
        )
        rank_env[LAUNCHER_PID_ENV] = str(os.getpid())
        commands.append((_rank_program(opts), rank_env))
    return commands


def _env_prefix(env: Mapping[str, str], base: Mapping[str, str]) -> List[str]:
    """``NAME=value`` words for the variables ``env`` sets or changes relative to ``base``."""
    return [f"{k}={v}" for k, v in env.items() if base.get(k) != v]


# ---------------------------------------------------------------- main

def _choose_mpi(opts: Options, env: Mapping[str, str]) -> Optional[MPI]:
    """The MPI that starts the job, None when smddprun starts the processes itself."""
    if opts.launcher == "local":
        return None
    if (opts.launcher == "auto" and single_host(opts, env) and not opts.mpi_args
            and not knobs.value("SMDDP_MPIRUN", env)):
        return None  # one host: nothing of MPI is needed, and mpirun's daemon listens on the network
    path = find_mpirun(env)
    if path is None:
        if opts.launcher == "mpirun":
            raise LaunchError("no mpirun found: pip install 'smddp[mpi]', or set SMDDP_MPIRUN")
        return None
    return identify_mpi(path)


def _run_local(opts: Options, env: Dict[str, str], explicit: bool) -> int:
    if opts.hosts or opts.hostfile:
        raise LaunchError("starting processes on other hosts needs mpirun: pip install 'smddp[mpi]'")
    commands = local_commands(opts, env)
    if not explicit and not single_host(opts, env):
        print(f"smddprun: no mpirun found; starting {len(commands)} processes on this host without MPI",
              file=sys.stderr, flush=True)
    if opts.mpi_args:
        print("smddprun: --mpi-args ignored: no mpirun found", file=sys.stderr, flush=True)
    if opts.dry_run:
        for cmd, rank_env in commands:
            rank_env.pop(LAUNCHER_PID_ENV)  # the lines run by hand have no launcher to follow
            print(shlex.join(_env_prefix(rank_env, os.environ) + cmd))
        return 0
    return LocalJob(commands).run()


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``smddprun`` and ``python -m smddp.launch``.

    Under mpirun this process stays mpirun's parent (:func:`smddp.launch.mpi_job.run_mpirun`): the
    signals it gets are passed on, mpirun ends when it dies, and it ends as mpirun ended.
    Returns the job's exit status.
    """
    opts = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        if opts.nproc is None:
            opts.nproc = default_nproc(_host_slots(opts), os.environ)
        mpi = _choose_mpi(opts, os.environ)
        env = job_environment(opts, os.environ, local=mpi is None)
        if mpi is None:
            return _run_local(opts, env, explicit=opts.launcher == "local")
        cmd = mpirun_command(opts, mpi, env)
    except (LaunchError, InvalidArgumentError) as exc:
        print(f"smddprun: error: {exc}", file=sys.stderr)
        return 2
    if opts.dry_run:
        print(shlex.join(_env_prefix(env, os.environ) + cmd))
        return 0
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        return run_mpirun(cmd, env)
    except OSError as exc:  # it is there and executable, but the system cannot run it
        explicit = knobs.value("SMDDP_MPIRUN", env)
        what = f"SMDDP_MPIRUN={explicit} (environment), {cmd[0]}" if explicit else f"mpirun ({cmd[0]})"
        print(f"smddprun: error: cannot run {what}: {exc.strerror or exc}; point SMDDP_MPIRUN at Open MPI's or "
              f"MPICH's mpirun, or unset it", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
