"""May the ranks of a host read and write each other's memory? The set-up probe of the single-copy path.

The compiled core's large all-reduces on one host read the peers' buffers and write the result
into them directly, with cross-memory attach (``process_vm_readv`` / ``process_vm_writev``,
``_shm_cma.h``), instead of copying through the shared segment. The kernel allows that only
where one process may ptrace the other: the same user and group (or ``CAP_SYS_PTRACE``), a
``kernel.yama.ptrace_scope`` of 0 or 1 for related processes, a seccomp profile that lets the
calls through (Docker's default refuses them without ``CAP_SYS_PTRACE``). So it is tried, never
assumed: when a group is made each rank publishes :func:`offer` in its layout proposal, reads
and writes back every host-mate's probe word with :func:`refusal`, and votes; a host takes the
path only if every one of its ranks reached every other (:func:`smddp.comm.planes.layout.agree`).
"""

from __future__ import annotations

import errno
import os
from typing import Any, Mapping, Optional

try:
    from smddp.comm.planes import _shm_native as native
except ImportError:  # not built: no single copy (the plane runs its Python path)
    native = None


def offer() -> Optional[dict]:
    """What this rank publishes for its host-mates' probe: its pid and its probe word's address and
    value; None where the compiled core is not built or the platform has no cross-memory attach."""
    if native is None or not native.HAVE_CMA:
        return None
    address, token = native.probe_word()
    return {"pid": os.getpid(), "addr": address, "token": token}


_LIMITS = {"pid": 1 << 31, "addr": 1 << 64, "token": 1 << 63}


def valid(entry: Any) -> bool:
    """True if ``entry`` (read from the store) is None or an :func:`offer`: a pid, an address and a
    token, each a non-negative int in its range."""
    if entry is None:
        return True
    return (isinstance(entry, dict) and set(entry) == set(_LIMITS)
            and all(type(entry[key]) is int and 0 <= entry[key] < limit for key, limit in _LIMITS.items()))


def refusal(peer: Mapping[str, int]) -> str:
    """"" if this process may read and write the memory of the host-mate that published ``peer``
    (its :func:`offer`), else why not: a real read of its probe word, which must hold its token,
    and a write of the same value back."""
    if native is None or not native.HAVE_CMA:
        return "no cross-memory attach here"
    if peer["pid"] == os.getpid():
        return "the same process"
    err = native.probe(peer["pid"], peer["addr"], peer["token"])
    if err == errno.EINVAL:
        return "its probe word holds another value: not the process that published it"
    if err == errno.EPERM:
        return ("Operation not permitted: the kernel allows it between processes of one user and group, "
                "or with CAP_SYS_PTRACE, and Yama's ptrace_scope or a seccomp profile may refuse it too")
    return os.strerror(err) if err else ""
