"""The exceptions smddp raises.

Every error is an :class:`SMDDPError` and also the built-in exception that fits, so
``except ValueError`` keeps working in code written for ``torch.distributed``.
"""

from __future__ import annotations


class SMDDPError(Exception):
    """Root of every exception smddp raises."""


class NotInitializedError(SMDDPError, RuntimeError):
    """A collective or query was called before ``init_process_group()``."""


class InvalidGroupError(SMDDPError, ValueError):
    """A process group other than ``group.WORLD`` was passed."""


class InvalidArgumentError(SMDDPError, ValueError):
    """An argument has the right type but a value the operation cannot use."""


class InvalidTypeError(SMDDPError, TypeError):
    """An argument has the wrong type (a non-tensor, an unsupported dtype)."""


class BackendUnavailableError(SMDDPError, RuntimeError):
    """The requested backend is unknown, or its library or device is missing here."""


class ResourceLimitError(SMDDPError, OSError):
    """The process is at one of its limits (open files, ``ulimit -n``): the message names it and what to do."""


class UnsafePathError(SMDDPError, PermissionError):
    """A directory smddp would write private files into belongs to another user, or others can write to it."""


class CollectiveError(SMDDPError, RuntimeError):
    """A collective failed, or the job is broken after an earlier failure."""


class CollectiveMismatchError(CollectiveError):
    """Ranks called different collectives: raised on every rank, naming the ranks and what differs.

    The shared-memory plane checks every collective (kind, dtype, element count, root,
    reduction op, sequence number); ``SMDDP_DEBUG=1`` checks every plane, shapes too. The
    collective was not run, and the job can go on (docs/troubleshooting.md says where not).
    """


class CollectiveTimeout(CollectiveError, TimeoutError):
    """A collective did not complete within the process group's timeout."""


class WaitTimeout(CollectiveTimeout):
    """A ``Work.wait(timeout)`` passed before its collective completed.

    The collective stays in flight and the job is not broken: a later ``wait()`` may see it
    complete (torch's semantics for a wait's own timeout).
    """


__all__ = [
    "SMDDPError",
    "NotInitializedError",
    "InvalidGroupError",
    "InvalidArgumentError",
    "InvalidTypeError",
    "BackendUnavailableError",
    "UnsafePathError",
    "CollectiveError",
    "CollectiveMismatchError",
    "CollectiveTimeout",
    "WaitTimeout",
]
