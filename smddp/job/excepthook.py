"""One failing rank ends the whole job; a broken job never hangs at exit.

- An uncaught exception on a rank of an MPI job prints its traceback, then calls
  ``MPI_Abort`` so that ``mpirun`` ends every rank within seconds instead of leaving them
  waiting in a collective. Elsewhere (torchrun, smddprun's own launcher) the rank exits
  non-zero and the launcher stops the others.
- At exit, each engine is told (see :meth:`smddp.comm.engine.Engine.at_exit`): a broken
  one (a collective timed out, failed or was interrupted) ends the process at once --
  ``MPI_Finalize`` with requests that never complete would wait forever -- and a healthy
  one leaves a note for ranks that may still wait for this one.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
import traceback
from typing import List, Optional

_IO_GRACE = 0.3
_lock = threading.Lock()
_installed = False
_exit_armed = False  # the exit handler, registered with the first engine (see watch)
_engines: List = []
#: ``"TypeError: ..."`` once an uncaught exception has reached the hook.
failure: Optional[str] = None


def mpi_running() -> bool:
    """True when this process has initialized MPI and not finalized it."""
    mpi = sys.modules.get("mpi4py.MPI")
    try:
        return mpi is not None and bool(mpi.Is_initialized()) and not mpi.Is_finalized()
    except Exception:  # noqa: BLE001 - a half-imported mpi4py counts as no MPI
        return False


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream must not stop the abort
            pass


def abort_mpi(code: int) -> None:
    """Under MPI, end every rank of the job (``MPI_Abort``); elsewhere only flush the output.

    The one way smddp ends an MPI job: the hook below, a broken engine at exit, smddprun's
    bootstrap and smddp-bench all come here.

    Args:
        code: the exit status.
    """
    _flush()
    if not mpi_running():
        return
    # mpirun forwards output through its daemon, which the abort stops: give it a
    # moment, or the traceback that explains the abort may be lost.
    time.sleep(_IO_GRACE)
    try:
        sys.modules["mpi4py.MPI"].COMM_WORLD.Abort(code)
    except Exception:  # noqa: BLE001 - already failing: the caller exits with the first error
        return


def abort_job(code: int = 1) -> None:
    """End this process now; under MPI, end every rank of the job (``MPI_Abort``).

    Args:
        code: the exit status.
    """
    abort_mpi(code)
    os._exit(code)


def _world_size() -> int:
    mpi = sys.modules.get("mpi4py.MPI")
    try:
        return mpi.COMM_WORLD.Get_size()
    except Exception:  # noqa: BLE001
        return 1


def _hook(previous):
    def hook(kind, value, tb) -> None:
        global failure
        failure = f"{kind.__name__}: {value}"[:300]
        previous(kind, value, tb)
        if mpi_running() and _world_size() > 1:
            rank = sys.modules["mpi4py.MPI"].COMM_WORLD.Get_rank()
            err = sys.__stderr__ or sys.stderr
            if sys.stderr is not err:
                # torch's own hook captures the traceback to prefix it with the rank and
                # prints it after this hook returns: too late, so print it here.
                text = "".join(traceback.format_exception(kind, value, tb))
                err.write("".join(f"[rank{rank}]: {line}\n" for line in text.splitlines()))
            err.write(f"smddp: rank {rank} ended with an uncaught {kind.__name__}; ending every rank of the "
                      f"job (MPI_Abort) so that none waits for it\n")
            abort_job(130 if issubclass(kind, KeyboardInterrupt) else 1)

    hook.smddp = True
    return hook


def install() -> None:
    """Install the uncaught-exception hook (idempotent)."""
    global _installed
    with _lock:
        if _installed:
            return
        _installed = True
        if not getattr(sys.excepthook, "smddp", False):
            sys.excepthook = _hook(sys.excepthook)


def watch(engine) -> None:
    """Call ``engine.at_exit(failure)`` when the interpreter exits.

    The exit handler is registered with the first engine, not when the hook is installed (as MPI
    starts): ``atexit`` runs handlers last-in first-out, and the engines' notes and waits at exit
    must run before the teardown that smddp's group creation registers just before its first
    engine (:func:`smddp.torch.groups.create`), which closes them.
    """
    global _exit_armed
    install()
    with _lock:
        _engines.append(engine)
        if not _exit_armed:
            _exit_armed = True
            atexit.register(_at_exit)


def forget(engine) -> None:
    """Stop watching ``engine`` (it was closed and is healthy)."""
    with _lock:
        if engine in _engines:
            _engines.remove(engine)


def _at_exit() -> None:
    with _lock:
        engines = list(_engines)
    for engine in engines:
        try:
            engine.at_exit(failure)
        except Exception as exc:  # noqa: BLE001 - exiting: report, never raise
            print(f"smddp: at exit: {exc}", file=sys.stderr)
