"""The shared-memory plane's segment: created, reserved, mapped by every rank, unlinked.

Shared memory per host: ``4096 + local_size * 2 * SMDDP_SHM_SLOT_BYTES`` bytes (default
slot 4 MiB: 8 MiB per rank). The segment is unlinked as soon as every rank has mapped it,
so a job killed with ``kill -9`` leaves nothing in /dev/shm; a segment left by a crash
during set-up (its creator's pid gone) is removed by the next job's set-up.
:mod:`smddp.comm.backends.shm` runs the collectives over it.
"""

from __future__ import annotations

import mmap
import os
import platform
import re
import socket
import uuid
from typing import List, Optional, Tuple

from smddp import knobs

#: Bytes of one buffer; each rank has two.
SLOT_BYTES = knobs.value("SMDDP_SHM_SLOT_BYTES")
SHM_DIR = knobs.value("SMDDP_SHM_DIR")
#: Bytes before the buffers: the ranks' epoch words and pids.
HEADER = 4096
_PREFIX = "smddp-shm-"


def supported() -> bool:
    """True where the shared-memory plane may run (x86-64 Linux with a /dev/shm)."""
    return platform.machine().lower() in ("x86_64", "amd64") and os.path.isdir(SHM_DIR)


def segment_bytes(local_size: int, slot: int = SLOT_BYTES) -> int:
    """Bytes of the segment for ``local_size`` ranks."""
    return HEADER + local_size * 2 * slot


def alive(pid: int) -> bool:
    """True while process ``pid`` exists (this host)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale(directory: str = SHM_DIR) -> List[str]:
    """Remove smddp segments whose creating process is gone; returns the names removed."""
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        m = re.match(re.escape(_PREFIX) + r".*-p(\d+)$", name)
        if m and not alive(int(m.group(1))):
            try:
                os.unlink(os.path.join(directory, name))
                removed.append(name)
            except OSError:
                pass
    return removed


def _create(name: str, nbytes: int) -> Optional[str]:
    """Create and reserve segment ``name``; None (with a reason) when /dev/shm is too small."""
    path = os.path.join(SHM_DIR, name)
    sweep_stale()
    stat = os.statvfs(SHM_DIR)
    free = stat.f_bavail * stat.f_frsize
    if free < nbytes:
        return f"{SHM_DIR} has {free >> 20} MiB free and the shared-memory plane needs {nbytes >> 20} MiB"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        # Reserve the pages now: a full tmpfs is an error here, not a SIGBUS mid-collective.
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        os.close(fd)
        os.unlink(path)
        return f"{SHM_DIR} cannot hold {nbytes >> 20} MiB ({exc.strerror})"
    os.close(fd)
    return None


def map_segment(host, group: str, nbytes: int) -> Tuple[str, mmap.mmap]:
    """Create a segment of ``nbytes`` for one host's ranks and map it on every one of them.

    Args:
        host: the host's set-up channel (:class:`smddp.comm.backends.hostmates.HostChannel`):
            its ``rank``, ``size``, ``publish``, ``read`` and ``barrier``.
        group: a name for the group (part of the segment's name).
        nbytes: the segment's size (:func:`segment_bytes`).

    Returns:
        The segment's name and this rank's mapping of it (the file is already unlinked).

    Raises:
        OSError: a rank of the host cannot map it (/dev/shm too small, or not the same
            /dev/shm): raised on every rank of the host.
    """
    if host.rank == 0:
        hostname = re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname())[:40]
        job = os.environ.get("OMPI_COMM_WORLD_JOBID") or os.environ.get("SLURM_JOB_ID") or uuid.uuid4().hex[:8]
        name = f"{_PREFIX}{job}-{hostname}-{group}-{uuid.uuid4().hex[:6]}-p{os.getpid()}"
        reason = _create(name, nbytes)
        host.publish("segment", "!" + reason if reason is not None else name)
    published = host.read("segment")
    if published.startswith("!"):
        raise OSError(published[1:])
    name = published
    path = os.path.join(SHM_DIR, name)
    mapping = None
    try:
        fd = os.open(path, os.O_RDWR)
        try:
            mapping = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
    except OSError as exc:
        host.publish(f"mapped/{host.rank}", f"local rank {host.rank}: {exc}")
    else:
        host.publish(f"mapped/{host.rank}", "")
    # Unlink once every rank has tried: from now on no crash can leave it behind.
    failures = [reason for reason in (host.read(f"mapped/{r}") for r in range(host.size)) if reason]
    if host.rank == 0:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    if failures:
        if mapping is not None:
            mapping.close()
        raise OSError("; ".join(failures))
    return name, mapping
