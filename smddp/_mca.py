"""Open MPI settings that keep an MPI job on one host off the network.

On one host Open MPI's ranks need nothing but shared memory between them (the ``btl``
transports ``self,sm``; ``self,vader`` before Open MPI 5), yet by default each rank also opens
the TCP transport, which listens on every interface (ports from 1024). Where smddp starts MPI
(smddprun's ``mpirun`` command line, :func:`smddp._mpi_job.network_args`) or initializes it in
a rank (the first ``from mpi4py import MPI`` smddp runs: :func:`one_host_defaults` just before
it), the job's ranks get shared memory only, unless the user chose the transports: on mpirun's
command line (``--mca btl ...``, which reaches the ranks as ``OMPI_MCA_btl``), in the
environment, or in an Open MPI parameter file. The user's choice always wins.

Open MPI 5's daemon (``prterun``) listens on every interface whatever it is told:
docs/security.md says why, and what was tried.
"""

from __future__ import annotations

import os
import re
from typing import List, Mapping, MutableMapping, Optional, Sequence

#: The variable Open MPI reads its ``btl`` setting from (``mpirun --mca btl X`` sets it in the ranks).
BTL_ENV = "OMPI_MCA_btl"
_BTL_LINE = re.compile(r"^\s*btl\s*=", re.MULTILINE)


def one_host_btl(major: int) -> str:
    """The transports a one-host job needs under Open MPI ``major``: itself and shared memory."""
    return "self,sm" if major >= 5 else "self,vader"


def _param_files(env: Mapping[str, str]) -> List[str]:
    """The parameter files Open MPI reads in a process with environment ``env``."""
    listed = env.get("OMPI_MCA_mca_base_param_files")
    if listed:
        return [path for path in listed.split(os.pathsep) if path and path != "none"]
    files = [os.path.join(os.path.expanduser("~"), ".openmpi", "mca-params.conf")]
    if env.get("OPAL_PREFIX"):
        files.append(os.path.join(env["OPAL_PREFIX"], "etc", "openmpi-mca-params.conf"))
    return files


def user_chose_btl(env: Mapping[str, str], mpirun_args: Sequence[str] = ()) -> bool:
    """True when the user set Open MPI's ``btl``: in ``mpirun_args``, ``env`` or a parameter file.

    Args:
        env: the environment mpirun or the rank starts with.
        mpirun_args: the user's own mpirun arguments (smddprun's ``--mpi-args``).
    """
    words = list(mpirun_args)
    for i, word in enumerate(words[:-1]):
        if word in ("--mca", "-mca", "--omca", "-omca") and words[i + 1] == "btl":
            return True
    if BTL_ENV in env:
        return True
    for path in _param_files(env):
        try:
            with open(path) as handle:
                if _BTL_LINE.search(handle.read()):
                    return True
        except OSError:
            continue
    return False


def _openmpi_major(env: Mapping[str, str]) -> int:
    """Open MPI's major version from ``OMPI_VERSION`` (which Open MPI 5's launcher sets), else 4."""
    match = re.match(r"(\d+)\.", env.get("OMPI_VERSION", ""))
    return int(match.group(1)) if match else 4


def one_host_defaults(env: Optional[MutableMapping[str, str]] = None) -> None:
    """Call just before smddp's first ``from mpi4py import MPI`` in a process (it initializes MPI).

    In a rank of an Open MPI job whose ranks all run on this host (``OMPI_COMM_WORLD_LOCAL_SIZE``
    equals ``OMPI_COMM_WORLD_SIZE``), sets ``OMPI_MCA_btl`` to shared memory only, so that the
    rank opens no TCP listener, unless the user chose the transports (:func:`user_chose_btl`).
    Anywhere else (another MPI, a job across hosts) it changes nothing.

    Args:
        env: the environment MPI will read; ``os.environ`` by default.
    """
    env = os.environ if env is None else env
    size, local_size = env.get("OMPI_COMM_WORLD_SIZE"), env.get("OMPI_COMM_WORLD_LOCAL_SIZE")
    if not size or size != local_size or user_chose_btl(env):
        return
    env[BTL_ENV] = one_host_btl(_openmpi_major(env))
