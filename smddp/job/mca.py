"""Open MPI settings that keep an MPI job on one host off the network.

On one host Open MPI's ranks need nothing but shared memory between them (the ``btl``
transports ``self,sm``; ``self,vader`` before Open MPI 5), yet by default each rank also opens
the TCP transport, which listens on every interface (ports from 1024). Where smddp starts MPI
(smddprun's ``mpirun`` command line, :func:`smddp.launch.mpi_job.network_args`) or initializes it in
a rank (the first ``from mpi4py import MPI`` smddp runs: :func:`one_host_defaults` just before
it), the job's ranks get shared memory only, unless the user chose the transports: on mpirun's
command line (``--mca btl ...``, which reaches the ranks as ``OMPI_MCA_btl``), in the
environment, or in an Open MPI parameter file. The user's choice always wins.

Shared memory only needs room for it: each rank's ``sm`` transport makes a segment of
``btl_sm_segment_size`` (16 MiB; ``btl_vader_segment_size``, 4 MiB, before Open MPI 5) in
``/dev/shm``, and refuses it where ``/dev/shm`` has less free space than that and 5% more
(Docker run with ``--shm-size=4m``, a small container). Open MPI alone then falls back to TCP;
with shared memory only, ``MPI_Init`` fails ("unable to reach each other ... BTLs attempted:
self"). So where ``/dev/shm`` cannot hold a segment, :func:`one_host_defaults` moves Open MPI's
segments to the job's own session directory (``$TMPDIR/ompi.<mpirun's pid>/<job>``: private
to the user, removed with the job), unless the user chose where they go: the job still opens
no TCP listener, and smddp's own shared-memory plane, which needs ``/dev/shm`` itself, warns
and leaves the CPU collectives to MPI (docs/troubleshooting.md).

Open MPI 5's daemon (``prterun``) listens on every interface whatever it is told:
docs/security.md says why, and what was tried.
"""

from __future__ import annotations

import os
import re
from typing import List, Mapping, MutableMapping, Optional, Sequence

from smddp.job import excepthook

#: The variable Open MPI reads its ``btl`` setting from (``mpirun --mca btl X`` sets it in the ranks).
BTL_ENV = "OMPI_MCA_btl"
#: Where Open MPI's ``sm`` (``vader``) transport puts its segments unless told otherwise.
SHM_DIR = "/dev/shm"
#: Open MPI's default size of each rank's segment: 16 MiB (Open MPI 5), 4 MiB before; never below 2 MiB.
_SEGMENT_BYTES, _VADER_SEGMENT_BYTES, _MIN_SEGMENT_BYTES = 16 << 20, 4 << 20, 2 << 20


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


def _user_value(env: Mapping[str, str], names: Sequence[str]) -> Optional[str]:
    """The value the user gave the Open MPI parameter ``names`` (one and its synonyms), or None.

    The environment (``OMPI_MCA_<name>``, which mpirun's ``--mca`` sets in the ranks) first,
    then the parameter files.
    """
    for name in names:
        if f"OMPI_MCA_{name}" in env:
            return env[f"OMPI_MCA_{name}"]
    line = re.compile(rf"^\s*(?:{'|'.join(map(re.escape, names))})\s*=\s*(.*?)\s*$", re.MULTILINE)
    for path in _param_files(env):
        try:
            with open(path) as handle:
                found = line.search(handle.read())
        except OSError:
            continue
        if found:
            return found.group(1)
    return None


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
    return _user_value(env, ("btl",)) is not None


def _openmpi_major(env: Mapping[str, str]) -> int:
    """Open MPI's major version from ``OMPI_VERSION`` (which Open MPI 5's launcher sets), else 4."""
    match = re.match(r"(\d+)\.", env.get("OMPI_VERSION", ""))
    return int(match.group(1)) if match else 4


def _room_for(directory: str, segment: int) -> bool:
    """Whether ``directory`` has the free space Open MPI asks for a segment of ``segment`` bytes.

    Open MPI's own check (``enough_space`` in its ``mmap`` shared-memory component) asks for the
    segment and 5% more; a page more covers the segment's header.
    """
    try:
        found = os.statvfs(directory)
    except OSError:
        return False
    return found.f_bavail * found.f_frsize >= segment + segment // 20 + 4096


def _fit_segments(env: MutableMapping[str, str], major: int) -> None:
    """Point Open MPI's segments at the job's session directory where ``/dev/shm`` cannot hold one."""
    names = ("btl_sm", "btl_vader") if major >= 5 else ("btl_vader",)
    if _user_value(env, [f"{name}_backing_directory" for name in names]) is not None:
        return
    asked = _user_value(env, [f"{name}_segment_size" for name in names])
    default = _SEGMENT_BYTES if major >= 5 else _VADER_SEGMENT_BYTES
    try:
        segment = max(int(asked, 0) if asked else default, _MIN_SEGMENT_BYTES)
    except ValueError:
        return  # Open MPI will say what it makes of the user's value
    # OMPI_FILE_LOCATION is this rank's directory in the job's session directory, which mpirun
    # made for the job alone (mode 0700) and removes when the job ends (smddprun too, when mpirun
    # was killed outright); the segments' files are the job's to remove as in /dev/shm.
    session = os.path.dirname(env.get("OMPI_FILE_LOCATION", "").rstrip("/"))
    if _room_for(SHM_DIR, segment) or not session or not _room_for(session, segment):
        return
    env[f"OMPI_MCA_{names[0]}_backing_directory"] = session


def one_host_defaults(env: Optional[MutableMapping[str, str]] = None) -> None:
    """Call just before smddp's first ``from mpi4py import MPI`` in a process (it initializes MPI).

    In a rank of an Open MPI job whose ranks all run on this host (``OMPI_COMM_WORLD_LOCAL_SIZE``
    equals ``OMPI_COMM_WORLD_SIZE``), sets ``OMPI_MCA_btl`` to shared memory only, so that the
    rank opens no TCP listener, unless the user chose the transports (:func:`user_chose_btl`);
    and where ``/dev/shm`` has no room for the rank's Open MPI segment, puts the segments in the
    job's session directory instead (``OMPI_MCA_btl_sm_backing_directory``), unless the user
    chose where they go. Anywhere else (another MPI, a job across hosts) it changes nothing.

    Every MPI that smddp starts comes through here, so this is also where smddp arms the one abort
    path (:func:`smddp.job.excepthook.install`): once MPI runs, an exception that leaves set-up (or
    anything after it) uncaught ends every rank with ``MPI_Abort``, where a plain exit would wait in
    ``MPI_Finalize`` for ranks that wait for this one.

    Args:
        env: the environment MPI will read; ``os.environ`` by default.
    """
    if env is None:  # this process's own MPI (a mapping given is only looked at)
        excepthook.install()
    env = os.environ if env is None else env
    size, local_size = env.get("OMPI_COMM_WORLD_SIZE"), env.get("OMPI_COMM_WORLD_LOCAL_SIZE")
    if not size or size != local_size:
        return
    major = _openmpi_major(env)
    if not user_chose_btl(env):
        env[BTL_ENV] = one_host_btl(major)
    _fit_segments(env, major)
