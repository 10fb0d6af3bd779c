"""The first code each process started by ``smddprun`` runs, before the user's script.

``python -m smddp.launch.bootstrap [-m module | script.py] [args]`` gives the process what
SageMaker's runner gives it, then runs the program as ``python script.py args`` would:

- ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``SMDATAPARALLEL_LOCAL_RANK``,
  ``MASTER_ADDR``, ``MASTER_PORT`` and ``SAGEMAKER_INSTANCE_TYPE`` from the launcher's own
  variables (:mod:`smddp.job.runtime`); values already set win, but a ``RANK`` or ``WORLD_SIZE``
  that contradicts the launcher ends the process with an error naming both;
- the ``smdistributed`` import alias (:mod:`smddp.launch.smdistributed`), unless
  ``SMDDP_ALIAS_SMDISTRIBUTED=0``;
- with SageMaker's data-parallel switch on and no GPU visible, what Hugging Face and
  accelerate need to train on CPU (:mod:`smddp.launch.sagemaker_switch`);
- an uncaught exception ends the whole MPI job (``MPI_Abort``, as ``python -m mpi4py`` does)
  instead of leaving the other ranks waiting in a collective, and a finalize that never returns;
- the process ends with what started it: smddprun itself (no mpirun), or the MPI launcher's
  daemon, which smddprun ends when it dies (:mod:`smddp.launch.parent_watch`);
- started by smddprun itself in a job of several processes, ``import mpi4py.MPI`` raises an
  ImportError that says to run under ``smddprun --launcher mpirun``: without a launcher, each
  process would start an MPI world of its own and train alone, silently.
"""

from __future__ import annotations

import faulthandler
import importlib.abc
import os
import runpy
import signal
import sys
import traceback
from typing import List, Optional, Sequence, Tuple

from smddp import knobs
from smddp.errors import InvalidArgumentError
from smddp.job import mca, runtime
from smddp.job.excepthook import abort_mpi
from smddp.job.topology import LAUNCHER_PID_ENV, Topology, discover
from smddp.launch import parent_watch, sagemaker_switch, smdistributed

__all__ = ["LAUNCHER_PID_ENV", "ALIAS_ENV", "main"]
#: ``0`` turns the smdistributed import alias off.
ALIAS_ENV = "SMDDP_ALIAS_SMDISTRIBUTED"
#: Seconds a rank that fails before MPI started tries to start it to abort the job (_end_mpi_job).
_JOIN_MPI_S = 5.0
_watchdog_sink = None
#: Variables an MPI launcher gives each rank.
_MPI_RANK_VARIABLES = frozenset({"OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"})

_USAGE = "usage: python -m smddp.launch.bootstrap [-m module | script.py] [args ...]"


def _split(argv: Sequence[str]) -> Tuple[Optional[str], Optional[str], List[str]]:
    """``(script, module, args)`` from the command line; exactly one of script/module is set."""
    if not argv or argv[0] in ("-h", "--help"):
        raise SystemExit(_USAGE)
    if argv[0] == "-m":
        if len(argv) < 2:
            raise SystemExit(_USAGE)
        return None, argv[1], list(argv[2:])
    return argv[0], None, list(argv[1:])


def _prepare_environment() -> Topology:
    """Read this process's place in the job and export it; a contradiction ends the process."""
    try:
        topo = discover(os.environ)
        runtime.fill(os.environ, topo)
    except InvalidArgumentError as exc:
        print(f"smddp: error: {exc}", file=sys.stderr, flush=True)
        _end_mpi_job(2)
        raise SystemExit(2) from None
    except ValueError as exc:
        print(f"smddp: cannot read this process's rank ({exc}); assuming a world of one", file=sys.stderr)
        return Topology()
    return topo


def _end_mpi_job(code: int) -> None:
    """End every rank of an MPI launcher's job from a rank that fails before MPI started.

    The other ranks may already be inside MPI (MASTER_ADDR's broadcast, or their own init):
    Open MPI 5 does not always end them when this rank just exits, so this rank starts MPI and
    calls ``MPI_Abort``. If they are not inside MPI, starting it may wait for them forever, with
    the interpreter's lock held: faulthandler's own thread, which needs no lock, ends this
    process after ``_JOIN_MPI_S`` seconds, and the launcher ends the job on that exit.
    """
    if not _MPI_RANK_VARIABLES.intersection(os.environ):
        return
    global _watchdog_sink
    _watchdog_sink = open(os.devnull, "w")  # noqa: SIM115 - must outlive this call
    faulthandler.dump_traceback_later(_JOIN_MPI_S, exit=True, file=_watchdog_sink)
    mca.one_host_defaults()
    try:
        from mpi4py import MPI  # noqa: F401 - importing it initializes MPI
    except Exception:  # noqa: BLE001 - no usable MPI: the launcher ends the job on our exit
        faulthandler.cancel_dump_traceback_later()
        return
    abort_mpi(code)
    faulthandler.cancel_dump_traceback_later()


class _NoMpiWorld(importlib.abc.MetaPathFinder):
    """Refuses ``mpi4py.MPI`` in a rank that smddprun started without an MPI launcher."""

    def __init__(self, size: int):
        self.size = size

    def find_spec(self, fullname, path=None, target=None):  # noqa: ARG002 - the finder protocol
        if fullname != "mpi4py.MPI":
            return None
        raise ImportError(
            f"mpi4py.MPI: this process is one of {self.size} that smddprun started without mpirun, so MPI "
            f"would see a world of 1 process in each. smddp's own collectives need no MPI; a script "
            f"that uses mpi4py itself must run under MPI: smddprun --launcher mpirun ...",
            name=fullname,
        )


def _guard_mpi4py(topo: Topology) -> None:
    """Make ``import mpi4py.MPI`` fail loudly in a rank smddprun started itself (see :class:`_NoMpiWorld`)."""
    if os.environ.get(LAUNCHER_PID_ENV) and topo.size > 1 and not _MPI_RANK_VARIABLES.intersection(os.environ):
        sys.meta_path.insert(0, _NoMpiWorld(topo.size))


def _follow_launcher() -> None:
    """End this process when what started it dies (Linux), so none is orphaned.

    Started by smddprun itself: ``SIGTERM`` when smddprun dies. Started by an MPI launcher:
    :func:`smddp.launch.parent_watch.follow_parent` (Open MPI's segments removed, then ``SIGTERM``).
    """
    if not sys.platform.startswith("linux"):
        return
    pid = os.environ.get(LAUNCHER_PID_ENV)
    if not pid:
        if _MPI_RANK_VARIABLES.intersection(os.environ):
            parent_watch.follow_parent()
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if str(os.getppid()) != pid:  # the launcher died before prctl took effect
        os._exit(128 + int(signal.SIGTERM))


def _user_traceback(exc: BaseException) -> None:
    """Print ``exc`` without the frames of this module and runpy."""
    tb = exc.__traceback__
    hidden = {__file__, runpy.__file__, "<frozen runpy>"}
    while tb is not None and tb.tb_frame.f_code.co_filename in hidden:
        tb = tb.tb_next
    traceback.print_exception(type(exc), exc, tb)
    sys.stderr.flush()


def _run(script: Optional[str], module: Optional[str], args: List[str]) -> None:
    if module is not None:
        sys.argv = [module, *args]
        sys.path[0] = os.getcwd()
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        sys.argv = [script, *args]
        sys.path[0] = os.path.dirname(os.path.realpath(script))
        runpy.run_path(script, run_name="__main__")


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Prepare this process and run the user's program in it.

    Args:
        argv: ``[-m module | script.py] [args]``; defaults to ``sys.argv[1:]``.

    Raises:
        SystemExit: with the program's exit status.
    """
    script, module, args = _split(sys.argv[1:] if argv is None else argv)
    _follow_launcher()
    topo = _prepare_environment()
    _guard_mpi4py(topo)
    if knobs.value(ALIAS_ENV):
        smdistributed.enable(note=topo.rank == 0)
    sagemaker_switch.apply()
    try:
        _run(script, module, args)
    except SystemExit as exc:
        code = exc.code
        if code not in (None, 0):
            abort_mpi(code if isinstance(code, int) else 1)
        raise
    except KeyboardInterrupt as exc:
        _user_traceback(exc)
        abort_mpi(128 + int(signal.SIGINT))
        # Die of SIGINT, as Python does, so that callers see how the process ended.
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        raise SystemExit(128 + int(signal.SIGINT)) from None
    except BaseException as exc:  # noqa: BLE001 - every failure must end the job
        _user_traceback(exc)
        abort_mpi(1)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
