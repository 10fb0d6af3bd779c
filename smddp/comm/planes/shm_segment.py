"""The shared-memory plane's segment: created, reserved, mapped by every rank, unlinked.

Shared memory per host: ``4096 + local_size * 2 * SMDDP_SHM_SLOT_BYTES`` bytes (default
slot 4 MiB: 8 MiB per rank). Jobs make many groups, so what a process holds is bounded whatever
their number: a segment is made only if this process's segments stay within
``SMDDP_SHM_MAX_BYTES`` (512 MiB by default) and the directory keeps a quarter of its size free
(never its last bytes: a container's 64 MB ``/dev/shm`` is also what DataLoader workers use);
otherwise the group runs on its flat path (:class:`SegmentBounded`, on every rank of the host).
The segment is unlinked as soon as every rank has mapped it, so a job killed with ``kill -9``
leaves nothing in /dev/shm; a segment left by a crash
during set-up (its creator's pid gone) is removed by the next job's set-up.
:mod:`smddp.comm.planes.shm` runs the collectives over it.

Set-up is as clean as teardown. The name reaches the other ranks through the store, which
has no authentication, so a rank uses a name it read only if it is one smddp makes
(:func:`valid_name`), opens it only inside the shared-memory directory, without following a
link and without creating anything, and maps it only if it is a regular file of this user and
of the size the plane needs. Anything else is refused on every rank of the host, with an
error that says why; a missing file is reported as missing. The rank that created the segment
alone unlinks it, by its own name (never one read back), on every path: once every rank has
mapped it, when a rank could not, when the wait for them fails or times out, and when the
launcher ends the job meanwhile (mpirun and torchrun send ``SIGTERM`` to every rank once one
has died).
"""

from __future__ import annotations

import contextlib
import errno
import json
import mmap
import os
import platform
import re
import signal
import socket
import stat
import threading
import time
import uuid
from typing import Iterator, List, Optional, Tuple

from smddp import knobs
from smddp.errors import BackendUnavailableError, CollectiveTimeout

#: Bytes of one buffer; each rank has two.
SLOT_BYTES = knobs.value("SMDDP_SHM_SLOT_BYTES")
SHM_DIR = knobs.value("SMDDP_SHM_DIR")
#: The most bytes of segments this process maps at once.
MAX_BYTES = knobs.value("SMDDP_SHM_MAX_BYTES")
#: The part of the directory a new segment must leave free.
KEEP_FREE = 0.25
#: Bytes before the buffers: the ranks' epoch words and pids.
HEADER = 4096
_PREFIX = "smddp-shm-"
#: Every name smddp makes, and the only ones a rank opens: no '/', no '.', bounded.
_NAME = re.compile(re.escape(_PREFIX) + r"[A-Za-z0-9_-]{1,200}")
#: The creating process, and its pid namespace: only a process in the same one can judge it.
_CREATOR = re.compile(r".*-n(\d+)-p(\d+)")
_POLL_S = 0.002  # between two looks at the store while the creator waits (signals run meanwhile)


class SegmentBounded(OSError):
    """No segment for a group: this process's segments, or the directory's free space, are at their
    bound (the module says which). Raised on every rank of the host; the group runs on its flat path."""


_held_lock = threading.Lock()
_held = 0  # bytes of segments this process maps now


def held() -> int:
    """Bytes of segments this process maps now (every group's)."""
    return _held


def _hold(nbytes: int) -> None:
    global _held
    with _held_lock:
        _held += nbytes


def release(nbytes: int) -> None:
    """A segment of ``nbytes`` this process mapped is unmapped."""
    global _held
    with _held_lock:
        _held = max(0, _held - nbytes)


def _over_held(nbytes: int) -> Optional[str]:
    """Why this process may not map another ``nbytes`` (its bound), or None."""
    if _held + nbytes > MAX_BYTES:
        return (f"this process maps {_held >> 20} MiB of shared memory for its groups already and "
                f"SMDDP_SHM_MAX_BYTES={MAX_BYTES} ({MAX_BYTES >> 20} MiB) bounds it")
    return None


def supported() -> bool:
    """True where the shared-memory plane may run (x86-64 Linux with a /dev/shm)."""
    return platform.machine().lower() in ("x86_64", "amd64") and os.path.isdir(SHM_DIR)


def missing_dir() -> Optional[str]:
    """Why the plane is off where the user named its directory (``SMDDP_SHM_DIR`` set) and it is not
    one, with what to change; None otherwise (a machine without ``/dev/shm`` is no one's mistake)."""
    if os.path.isdir(SHM_DIR) or knobs.origin("SMDDP_SHM_DIR") != "environment":
        return None
    return (f"{_dir_words()} is not a directory: the shared-memory plane is off and this job's CPU "
            f"collectives take the flat path (slower); {_ELSEWHERE}, or unset it")


def segment_bytes(local_size: int, slot: int = SLOT_BYTES) -> int:
    """Bytes of the segment for ``local_size`` ranks."""
    return HEADER + local_size * 2 * slot


def valid_name(name: str) -> bool:
    """True if ``name`` is a segment name smddp makes: ``smddp-shm-`` and up to 200 letters,
    digits, ``_`` and ``-`` (so no path, no ``..``)."""
    return isinstance(name, str) and _NAME.fullmatch(name) is not None


def pid_namespace() -> str:
    """This process's pid namespace (the inode number of ``/proc/self/ns/pid``), "" where unknown."""
    try:
        link = os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""
    found = re.fullmatch(r"pid:\[(\d+)\]", link)
    return found.group(1) if found else ""


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
    """Remove smddp segments whose creating process is gone; returns the names removed.

    Only a segment made in this process's pid namespace is judged: a pid from another
    namespace (a container sharing this /dev/shm) names some other process here, or none,
    and its segment may belong to a live job.
    """
    removed: List[str] = []
    mine = pid_namespace()
    if not mine:
        return removed
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        creator = _CREATOR.fullmatch(name) if valid_name(name) else None
        if creator is not None and creator.group(1) == mine and not alive(int(creator.group(2))):
            try:
                os.unlink(os.path.join(directory, name))
                removed.append(name)
            except OSError:
                pass
    return removed


def _safe(text: str, limit: int) -> str:
    return re.sub(r"[^A-Za-z0-9_]", "_", text)[:limit] or "_"


def _new_name(group: str) -> str:
    """A fresh segment name: the job, host, group, a random id, the creator's pid namespace and pid."""
    job = os.environ.get("OMPI_COMM_WORLD_JOBID") or os.environ.get("SLURM_JOB_ID") or uuid.uuid4().hex[:8]
    return (f"{_PREFIX}{_safe(job, 24)}-{_safe(socket.gethostname(), 40)}-{_safe(group, 24)}-"
            f"{uuid.uuid4().hex[:6]}-n{pid_namespace() or 0}-p{os.getpid()}")


def _dir_words() -> str:
    """The segments' directory as messages name it: ``SMDDP_SHM_DIR=/dev/shm (the default)``."""
    return f"SMDDP_SHM_DIR={SHM_DIR} ({knobs.origin('SMDDP_SHM_DIR')})"


_ELSEWHERE = "point SMDDP_SHM_DIR at a directory on a tmpfs that this user can write"
_ENLARGE = "enlarge it (containers: docker run --shm-size=1g) or set SMDDP_SHM_SLOT_BYTES lower"


def _why(exc: OSError, nbytes: int) -> str:
    """Why the segment cannot be made in the directory, with the advice that fits ``exc``'s errno."""
    code, text = exc.errno, exc.strerror or str(exc)
    if code in (errno.ENOSPC, errno.EDQUOT):
        return f"{_dir_words()} cannot hold {nbytes >> 20} MiB ({text}: out of space, or of inodes): {_ENLARGE}"
    if code == errno.EROFS:
        return f"{_dir_words()} is read-only ({text}): {_ELSEWHERE}"
    if code in (errno.EACCES, errno.EPERM):
        return f"this user cannot create files in {_dir_words()} ({text}): {_ELSEWHERE}"
    if code == errno.EEXIST:
        return (f"a file of the segment's name is already in {_dir_words()} ({text}): something else makes "
                f"files named {_PREFIX}* there; {_ELSEWHERE}, of this job's own")
    if code in (errno.ENOENT, errno.ENOTDIR):
        return f"{_dir_words()} is not a directory ({text}): create it, or {_ELSEWHERE}"
    if code in (errno.EMFILE, errno.ENFILE):
        return f"this process cannot open another file ({text}): raise its limit (ulimit -n)"
    if code in (errno.EOPNOTSUPP, errno.EINVAL, errno.EFBIG):
        return f"{_dir_words()} cannot reserve {nbytes >> 20} MiB ({text}): {_ELSEWHERE}"
    return f"the segment cannot be made in {_dir_words()} ({text})"


def _create(path: str, nbytes: int) -> Optional[str]:
    """Create and reserve the segment at ``path``; None, or why it cannot be and what to do.

    Every failure of the directory or the file, whatever its errno, is a reason returned here, so
    that the creator publishes it to its host-mates (:func:`map_segment`) instead of leaving them
    waiting for a name that never comes.
    """
    sweep_stale()
    try:
        stat_fs = os.statvfs(SHM_DIR)
    except OSError as exc:
        return _why(exc, nbytes)
    free = stat_fs.f_bavail * stat_fs.f_frsize
    if free < nbytes:
        return (f"{_dir_words()} has {free >> 20} MiB free and the shared-memory plane needs "
                f"{nbytes >> 20} MiB: {_ENLARGE}")
    bound = _over_held(nbytes)
    if bound is not None:
        raise SegmentBounded(bound)
    total = stat_fs.f_blocks * stat_fs.f_frsize
    if free - nbytes < KEEP_FREE * total:
        raise SegmentBounded(
            f"{_dir_words()} has {free >> 20} MiB free of {total >> 20} MiB, and a segment of {nbytes >> 20} MiB "
            f"would leave less than a quarter of it (smddp never takes the last of it: other programs, "
            f"DataLoader workers among them, use it too)")
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        return _why(exc, nbytes)
    try:
        # Reserve the pages now: a full tmpfs is an error here, not a SIGBUS mid-collective.
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        _unlink(path)
        return _why(exc, nbytes)
    except BaseException:
        _unlink(path)
        raise
    finally:
        os.close(fd)
    return None


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


class _Refused(Exception):
    """A segment a rank must not use (an unsafe name, a link, not this user's regular file)."""


def _open_mapping(name: str, nbytes: int) -> mmap.mmap:
    """Map segment ``name`` of ``nbytes``, checked as the module says.

    Raises:
        _Refused: not a name smddp makes, a link, or not a regular file of this user of ``nbytes``.
        FileNotFoundError: there is no such segment.
        OSError: it cannot be opened or mapped.
    """
    if not valid_name(name):
        raise _Refused(f"the segment name read from the store, {name[:120]!r}, is not one smddp makes "
                       f"({_PREFIX} and letters, digits, '_', '-'): refused")
    try:
        # No O_CREAT: a reader never makes a file; O_NONBLOCK: a planted FIFO cannot block the open.
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _Refused(f"{SHM_DIR}/{name} is a symbolic link, not smddp's segment: refused") from None
        raise
    try:
        found = os.fstat(fd)
        if not stat.S_ISREG(found.st_mode) or found.st_uid != os.geteuid() or found.st_size != nbytes:
            raise _Refused(
                f"{SHM_DIR}/{name} is not a segment of this user of {nbytes} bytes (mode {found.st_mode:o}, "
                f"owner {found.st_uid}, {found.st_size} bytes): refused")
        return mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)


def _try_map(name: str, nbytes: int) -> Tuple[Optional[mmap.mmap], dict]:
    """``(mapping, {})``, or ``(None, report)``: what this rank publishes for its host-mates."""
    try:
        return _open_mapping(name, nbytes), {}
    except _Refused as exc:
        return None, {"error": str(exc), "fatal": True}
    except FileNotFoundError:
        return None, {"fatal": True, "error": (
            f"the segment {name} is missing from {SHM_DIR}: something removed it, or this rank does not "
            f"see the {SHM_DIR} of the rank that created it (containers: share one {SHM_DIR}, or set "
            f"SMDDP_CPU_PLANE=gloo)")}
    except OSError as exc:
        return None, {"error": str(exc), "fatal": False}
    except Exception as exc:  # noqa: BLE001 - whatever it is, the host-mates must hear of it
        return None, {"error": f"{type(exc).__name__}: {exc}", "fatal": True}


def _report(raw: str) -> dict:
    """A host-mate's published outcome: ``{}`` (mapped), or ``{"error": ..., "fatal": ...}``."""
    try:
        found = json.loads(raw)
    except ValueError:
        found = None
    if found == {} or (isinstance(found, dict) and isinstance(found.get("error"), str)):
        return found
    return {"error": f"a malformed report in the store ({raw[:80]!r})", "fatal": True}


@contextlib.contextmanager
def _unlinked_on_sigterm(path: str) -> Iterator[None]:
    """Unlink ``path`` first if ``SIGTERM`` ends the process meanwhile.

    When a rank dies during set-up, mpirun and torchrun end the others with ``SIGTERM`` while
    the creator still waits for it. Only the main thread can set a handler: elsewhere, or where
    the handler was set outside Python or ignores the signal, nothing changes. A Python handler
    that was there is called after the unlink, and put back afterwards.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)
    if previous is None or previous is signal.SIG_IGN:
        yield
        return

    def on_sigterm(signum, frame) -> None:
        _unlink(path)
        signal.signal(signal.SIGTERM, previous)
        if callable(previous):
            previous(signum, frame)
        else:
            os.kill(os.getpid(), signal.SIGTERM)  # the default action, now restored: end

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:
        if signal.getsignal(signal.SIGTERM) is on_sigterm:
            signal.signal(signal.SIGTERM, previous)


def _await_reports(host) -> List[dict]:
    """Every rank's outcome, waited for in short sleeps (so that signal handlers run).

    Raises:
        CollectiveTimeout: a rank did not report within the host's timeout.
    """
    keys = [f"mapped/{r}" for r in range(host.size)]
    started = time.monotonic()
    deadline = started + host.timeout.total_seconds()
    while not all(host.published(key) for key in keys):
        if time.monotonic() > deadline:
            late = [r for r, key in enumerate(keys) if not host.published(key)]
            # A host-mate that never came, as hostmates' own waits say it (open_plane lets it through:
            # not a /dev/shm problem; the engine makes it the collective's timeout).
            raise CollectiveTimeout(
                f"the shared-memory plane's set-up waited {time.monotonic() - started:.0f}s for local "
                f"ranks {late} (host ranks {host.mates.ranks}) to map its segment (removed now)")
        time.sleep(_POLL_S)
    return [_report(host.read(key)) for key in keys]


def _mapped(mapping: Optional[mmap.mmap], reports: List[dict]) -> mmap.mmap:
    """``mapping`` once every rank of the host mapped the segment; else the error, on every rank."""
    failures = [(r, found) for r, found in enumerate(reports) if found]
    if not failures:
        return mapping
    if mapping is not None:
        mapping.close()
    text = "; ".join(f"local rank {r}: {found['error']}" for r, found in failures)
    if all(found.get("bound") is True for _, found in failures):
        raise SegmentBounded(text)
    if any(found.get("fatal") for _, found in failures):
        raise BackendUnavailableError(f"the shared-memory plane cannot start: {text}")
    raise OSError(text)


def map_segment(host, group: str, nbytes: int) -> Tuple[str, mmap.mmap]:
    """Create a segment of ``nbytes`` for one host's ranks and map it on every one of them.

    Args:
        host: the host's set-up channel (:class:`smddp.comm.planes.hostmates.HostChannel`):
            its ``rank``, ``size``, ``timeout``, ``publish``, ``published`` and ``read``.
        group: a name for the group (part of the segment's name).
        nbytes: the segment's size (:func:`segment_bytes`).

    Returns:
        The segment's name and this rank's mapping of it (the file is already unlinked).

    Raises:
        OSError: the segment cannot be made (the directory too small, read-only, not writable by this
            user, not a directory; any errno: the message says which, and what to do), or a rank of the
            host cannot map it: raised on every rank of the host, each with the same reason.
        BackendUnavailableError: a rank refused the name it read, or found no such segment
            (the module says when): raised on every rank of the host.
        CollectiveTimeout: a rank of the host has not mapped it within the timeout (the creator).
    """
    if host.rank != 0:
        name = host.read("segment")
        if name.startswith("~"):
            raise SegmentBounded(name[1:])
        if name.startswith("!"):
            raise OSError(name[1:])
        bound = _over_held(nbytes)
        if bound is not None:  # this rank's own bound: every rank of the host goes without
            mapping, outcome = None, {"error": bound, "fatal": False, "bound": True}
        else:
            mapping, outcome = _try_map(name, nbytes)
        host.publish(f"mapped/{host.rank}", json.dumps(outcome))
        found = _mapped(mapping, [_report(host.read(f"mapped/{r}")) for r in range(host.size)])
        _hold(nbytes)
        return name, found
    name = _new_name(group)
    path = os.path.join(SHM_DIR, name)
    try:
        reason = _create(path, nbytes)
    except SegmentBounded as exc:
        host.publish("segment", f"~{exc}")  # the host-mates go without it too, for the same reason
        raise
    except BaseException as exc:
        # Whatever stopped it, the host-mates must not wait for a name that will not come: they
        # fall back, and this rank's error ends the job or is caught by its caller.
        host.publish("segment", f"!local rank 0 could not make the segment: {type(exc).__name__}: {exc}")
        raise
    if reason is not None:
        host.publish("segment", "!" + reason)
        raise OSError(reason)
    try:
        with _unlinked_on_sigterm(path):
            host.publish("segment", name)
            mapping, outcome = _try_map(name, nbytes)
            host.publish("mapped/0", json.dumps(outcome))
            reports = _await_reports(host)
    finally:
        # Every rank has mapped it, or will not: from now on no crash can leave it behind.
        _unlink(path)
    found = _mapped(mapping, reports)
    _hold(nbytes)
    return name, found
