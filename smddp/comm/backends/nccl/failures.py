"""What a rank does once an NCCL collective failed or passed its deadline: torch's choices.

torch's ProcessGroupNCCL lets ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` choose, and smddp's ``nccl``
backend offers the same four, from ``SMDDP_NCCL_ASYNC_ERROR_HANDLING`` (else torch's variable,
else torch's default, 3):

====  =====================  =====================================================================
mode  name                   when a deadline passes or NCCL reports an error
====  =====================  =====================================================================
0     no handling            the error is recorded: the next call or wait raises it; the NCCL
                             communicator and the stalled kernels are left as they are
1     tear down              the communicator is aborted (``ncclCommAbort``), then the process ends
2     clean up only          the communicator is aborted; the process goes on and the next call or
                             wait raises (a host read of a result in between sees what the aborted
                             collective left in the tensor: un-reduced data)
3     skip clean-up          the process ends at once, without aborting (an abort can itself block
                             when a peer is gone); torch's default and smddp's
====  =====================  =====================================================================

The process ends through :func:`end_process`: the error on stderr, then
:func:`smddp.job.excepthook.abort_job` (under MPI, every rank of the job). An abort is given
:data:`ABORT_GRACE` seconds (:func:`abort_within`): one that does not return by then ends
the process too, as torch's heartbeat monitor ends a process whose watchdog is stuck.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any, Callable, Mapping, Optional

from smddp import knobs
from smddp.errors import InvalidArgumentError
from smddp.job import excepthook

ENV = "SMDDP_NCCL_ASYNC_ERROR_HANDLING"
TORCH_ENV = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
NO_HANDLING, TEAR_DOWN, CLEAN_UP_ONLY, SKIP_CLEAN_UP = 0, 1, 2, 3
_NAMES = {NO_HANDLING: "no handling", TEAR_DOWN: "tear down", CLEAN_UP_ONLY: "clean up only",
          SKIP_CLEAN_UP: "skip clean-up"}

#: Seconds an ``ncclCommAbort`` may take before the process is ended instead.
ABORT_GRACE = 60.0


def error_handling(env: Optional[Mapping[str, str]] = None) -> int:
    """The mode: ``SMDDP_NCCL_ASYNC_ERROR_HANDLING``, else ``TORCH_NCCL_ASYNC_ERROR_HANDLING``, else 3.

    Raises:
        InvalidArgumentError: a value other than 0, 1, 2 or 3 (the error names the variable).
    """
    mode = knobs.value(ENV, env)
    source = ENV
    if mode is None:
        text = (os.environ if env is None else env).get(TORCH_ENV, "").strip()
        source = TORCH_ENV
        try:
            mode = int(text) if text else SKIP_CLEAN_UP
        except ValueError:
            mode = -1
    if mode not in _NAMES:
        raise InvalidArgumentError(f"{source} must be 0, 1, 2 or 3 (torch's modes; see docs/backends.md), "
                                   f"got {mode!r}")
    return mode


def aborts(mode: int) -> bool:
    """True when ``mode`` aborts the NCCL communicator on a failure (1 and 2)."""
    return mode in (TEAR_DOWN, CLEAN_UP_ONLY)


def ends_process(mode: int) -> bool:
    """True when ``mode`` ends the process on a failure (1 and 3)."""
    return mode in (TEAR_DOWN, SKIP_CLEAN_UP)


def end_process(error: BaseException, rank: int, mode: int) -> None:
    """Say why on stderr, then end this process (under MPI, every rank of the job).

    Args:
        error: the failure.
        rank: this rank, for the message.
        mode: the error-handling mode that decided it.
    """
    err = sys.__stderr__ or sys.stderr
    try:
        err.write(f"smddp: rank {rank}: {type(error).__name__}: {error}\n"
                  f"smddp: ending this process ({ENV}={mode}, {_NAMES.get(mode, mode)}, torch's default "
                  f"for NCCL); set {ENV}=2 to abort the NCCL communicator and raise at the next call "
                  f"instead\n")
        err.flush()
    except Exception:  # noqa: BLE001 - ending anyway
        pass
    excepthook.abort_job(1)


def abort_within(comm: Any, grace: float, stuck: Callable[[], None]) -> bool:
    """``comm.abort()`` on a thread of its own; ``stuck()`` if it has not returned within ``grace`` s.

    Returns:
        True if the abort returned in time.
    """
    done = threading.Event()

    def run() -> None:
        try:
            comm.abort()
        except Exception:  # noqa: BLE001 - an abort that fails has still ended the communicator's use
            pass
        finally:
            done.set()

    threading.Thread(target=run, name="smddp-nccl-abort", daemon=True).start()
    if done.wait(grace):
        return True
    stuck()
    return False
