"""The process's limits that a job meets as it grows: its open files (``ulimit -n``).

A group holds file descriptors (its gloo connections, one per peer; its shared-memory segment's
mapping). Where a process runs out of them, gloo's own threads abort it (``gloo::EnforceNotMet
... accept: Too many open files``, a ``SIGABRT`` with no word of the limit), and the others wait for
it. So smddp looks before it makes a group, and refuses with the limit named instead.
"""

from __future__ import annotations

import os
import resource

from smddp.errors import ResourceLimitError

#: Descriptors kept free beyond a group's own: the script's files, a DataLoader's pipes, torch's.
MARGIN = 16


def open_files() -> int:
    """This process's open file descriptors (-1 where ``/proc`` cannot say)."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return -1


def check_open_files(needed: int, what: str, alive: int) -> None:
    """Raise unless this process can open ``needed`` more files and keep :data:`MARGIN` free.

    Args:
        needed: the descriptors ``what`` holds.
        what: what is being made, for the message (``"process group '7'"``).
        alive: the process groups this process holds now.

    Raises:
        ResourceLimitError: the soft limit (``ulimit -n``) would be passed; the message names it,
            what is open, and the groups alive.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    used = open_files()
    if soft == resource.RLIM_INFINITY or used < 0 or used + needed + MARGIN <= soft:
        return
    room = "" if hard == resource.RLIM_INFINITY or hard > soft else f" (the hard limit is {hard} too)"
    raise ResourceLimitError(
        f"{what} needs about {needed} more open files and this process has {used} open of its limit of {soft} "
        f"(ulimit -n){room}, with {alive} process groups alive: raise the limit (ulimit -n {max(4 * soft, 4096)} "
        f"in the launcher's shell, or the container's nofile limit), or destroy the groups no longer used "
        f"(torch.distributed.destroy_process_group(group))")
