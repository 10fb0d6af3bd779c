"""A rank of an MPI job ends, and takes Open MPI's shared memory with it, when its launcher dies.

Open MPI's daemon (``prterun`` on the first host, ``prted`` on the others) starts the ranks
and, when the job ends, removes the shared-memory segments their ``sm`` transport created
(``/dev/shm/sm_segment.<host>.<uid>.<job>.<rank>``; ``vader_segment.*`` before Open MPI 5).
Killed outright, it does neither: the ranks run on to the end of their script and the segments
stay. So each rank smddp bootstraps under MPI watches the process that started it, from a
thread waiting on a pidfd (no polling); when that process is gone the rank

1. unlinks the Open MPI segments it has mapped (its own and its host-mates'; they belong to
   this job alone, and the job cannot go on without its daemon),
2. sends itself ``SIGTERM`` (a script's handler may save a checkpoint, as under SageMaker),
3. ends with ``SIGKILL`` :data:`GRACE_S` seconds later if it is still there.

``PR_SET_PDEATHSIG`` (what smddprun's own ranks use) is not enough here: it kills at once, with
no chance to clean up, and follows the parent *thread*, which in Open MPI's daemon may be a
helper thread that ends before the daemon does.
"""

from __future__ import annotations

import os
import select
import signal
import threading
import time
from typing import List, Optional

#: Seconds between the rank's ``SIGTERM`` to itself and its ``SIGKILL``.
GRACE_S = 3.0
#: Names of Open MPI's shared-memory segments (Open MPI 5, then 4).
OMPI_SEGMENT_PREFIXES = ("sm_segment.", "vader_segment.")
#: Seconds between checks of the parent where there is no pidfd (Linux before 5.3).
_POLL_S = 0.5


def mapped_segments(maps: str = "/proc/self/maps") -> List[str]:
    """Paths of the Open MPI segments this process maps that belong to this user."""
    found = set()
    try:
        with open(maps) as handle:
            lines = handle.read().splitlines()
    except OSError:
        return []
    for line in lines:
        fields = line.split(None, 5)
        path = fields[5] if len(fields) == 6 else ""
        if path.endswith(" (deleted)") or not os.path.basename(path).startswith(OMPI_SEGMENT_PREFIXES):
            continue
        try:
            if os.stat(path).st_uid == os.getuid():
                found.add(path)
        except OSError:
            continue
    return sorted(found)


def _wait_for_exit(pid: int, pidfd: Optional[int]) -> None:
    if pidfd is not None:
        select.select([pidfd], [], [])  # readable once the process has exited
        return
    while os.getppid() == pid:
        time.sleep(_POLL_S)


def _end_with(pid: int, pidfd: Optional[int]) -> None:
    _wait_for_exit(pid, pidfd)
    for path in mapped_segments():
        try:
            os.unlink(path)
        except OSError:
            pass  # already removed by a host-mate
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(GRACE_S)
    os.kill(os.getpid(), signal.SIGKILL)


def follow_parent() -> bool:
    """Watch the process that started this one; end this one as the module says when it dies.

    Returns:
        True when a watch was started (False: already orphaned, so nothing to follow).
    """
    parent = os.getppid()
    if parent == 1:
        return False
    pidfd = None
    if hasattr(os, "pidfd_open"):
        try:
            pidfd = os.pidfd_open(parent)
        except OSError:
            pidfd = None
    if os.getppid() != parent:  # it died before the pidfd was opened
        if pidfd is not None:
            os.close(pidfd)
        pidfd = None
    threading.Thread(target=_end_with, args=(parent, pidfd), name="smddp-follow-launcher", daemon=True).start()
    return True
