"""This process's host identity: the one definition of "the same host" in smddp.

Ranks with equal identities share a kernel, a shared-memory directory, a process-id namespace and
a network namespace: the CPU planes' host-mates (:mod:`smddp.comm.planes.layout`) and the stall
reports' "is that rank's process alive" (:mod:`smddp.comm.engine.stall`) both read it.
"""

from __future__ import annotations

import os
import socket
from typing import Mapping, Optional

from smddp import knobs

_BOOT_ID = "/proc/sys/kernel/random/boot_id"


def _namespace(kind: str) -> str:
    try:
        return os.readlink(f"/proc/self/ns/{kind}")
    except OSError:
        return "-"


def host_identity(env: Optional[Mapping[str, str]] = None) -> str:
    """This process's host identity: the one definition of "the same host" in smddp.

    Two processes with equal identities run on one kernel (its boot id), see one shared-memory
    directory (its device and inode: a segment one creates, the other can map), one process-id
    namespace (each can tell whether the other's pid is alive) and one network namespace (each
    reaches the other on loopback). ``SMDDP_HOST_ID`` replaces the host-name part (containers that
    share a host name but not their memory set it; a test can make hosts with it).

    Args:
        env: the environment ``SMDDP_HOST_ID`` and ``SMDDP_SHM_DIR`` are read from (default: the process's).
    """
    try:
        with open(_BOOT_ID) as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    try:
        st = os.stat(knobs.value("SMDDP_SHM_DIR", env))
        shm = f"{st.st_dev}:{st.st_ino}"
    except OSError:
        shm = "-"
    name = knobs.value("SMDDP_HOST_ID", env) or socket.gethostname()
    return f"{name}|{boot}|{shm}|{_namespace('pid')}|{_namespace('net')}"
