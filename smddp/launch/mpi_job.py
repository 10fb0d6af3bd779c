"""smddprun over mpirun: the options one host needs, and mpirun kept as smddprun's child.

smddprun used to ``exec`` mpirun: a ``kill -9`` of smddprun was then a ``kill -9`` of mpirun
(PRRTE's ``prterun``), which had no chance to stop its ranks or remove Open MPI's shared
memory segments (``/dev/shm/sm_segment.*``). Now smddprun stays mpirun's parent:

- mpirun gets ``SIGTERM`` when smddprun dies, whatever killed it (``PR_SET_PDEATHSIG``), and
  stops the job as it does on Ctrl-C: ranks ended, segments removed, within seconds;
- the signals smddprun receives are passed on to mpirun (a terminal's Ctrl-C already reaches
  both: it is not sent twice), and smddprun ends as mpirun ended: the same exit status, or
  the same signal, as when it was mpirun itself;
- each rank follows the process that started it (:mod:`smddp.launch.parent_watch`), for the case
  where mpirun itself is killed outright; smddprun then removes the directory of PMIx files
  mpirun could not (:func:`remove_left_session_dir`).
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import stat
import subprocess
import sys
from dataclasses import dataclass
from typing import List, Mapping, Sequence

from smddp.job.mca import one_host_btl, user_chose_btl
from smddp.job.sockets import check_interface, interface

#: Signals passed on to mpirun (those that end or control a job).
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
#: ``si_code`` of a signal the kernel sent itself: a terminal's Ctrl-C goes to the whole
#: foreground process group, mpirun included.
_SI_KERNEL = 0x80
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class MPI:
    """An ``mpirun`` and the command-line dialect it speaks."""

    path: str
    flavor: str  # "openmpi" or "hydra" (MPICH, Intel MPI)
    major: int = 0


def network_args(mpi: MPI, one_host: bool, env: Mapping[str, str], user_args: Sequence[str] = ()) -> List[str]:
    """Open MPI options that keep the job's MPI traffic off the network where it need not go.

    One host: the ranks talk through shared memory only (``--mca btl self,sm``; ``vader`` before
    Open MPI 5), so they open no TCP listener, unless the user chose the transports
    (:func:`smddp.job.mca.user_chose_btl`: in ``user_args``, ``env`` or a parameter file).
    ``SMDDP_SOCKET_IFNAME``: the TCP transport and the daemons' out-of-band channel use that
    interface only. Open MPI 5's daemon (PRRTE) listens on every interface whatever it is
    told, so on one host it still does: see docs/security.md. MPICH's hydra gets nothing here.

    Args:
        mpi: the mpirun that starts the job.
        one_host: every rank runs on this host.
        env: the environment mpirun starts with.
        user_args: the user's own mpirun arguments (``--mpi-args``).

    Raises:
        InvalidArgumentError: on one host, ``SMDDP_SOCKET_IFNAME`` names no interface of it.
    """
    if mpi.flavor != "openmpi":
        return []
    args: List[str] = []
    if one_host and not user_chose_btl(env, user_args):
        args += ["--mca", "btl", one_host_btl(mpi.major)]
    name = interface(env)
    if name:
        if one_host:
            check_interface(name)  # named here, not as prterun's "No network interfaces were found"
        else:
            args += ["--mca", "btl_tcp_if_include", name]
        args += ["--prtemca" if mpi.major >= 5 else "--mca", "oob_tcp_if_include", name]
    return args


def _die_with(parent: int) -> None:
    """In mpirun's process before it starts: take ``SIGTERM`` when ``parent`` (smddprun) dies."""
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM))
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # smddprun died before prctl took effect
        os._exit(128 + int(signal.SIGTERM))


def run_mpirun(cmd: Sequence[str], env: Mapping[str, str]) -> int:
    """Run ``cmd`` (an mpirun command line) as a child that ends with this process; wait for it.

    Returns:
        mpirun's exit status. When mpirun dies of a signal, this process kills itself with the
        same signal, as it would have died had it been mpirun.
    """
    signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED_SIGNALS)
    try:
        proc = subprocess.Popen(list(cmd), env=dict(env), preexec_fn=functools.partial(_die_with, os.getpid()))
    except BaseException:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED_SIGNALS)
        raise
    while proc.poll() is None:
        info = signal.sigtimedwait(FORWARDED_SIGNALS, 0.2)
        if info is not None and not (info.si_code == _SI_KERNEL and info.si_signo in (signal.SIGINT, signal.SIGQUIT)):
            try:
                proc.send_signal(info.si_signo)
            except ProcessLookupError:
                pass
    code = proc.returncode
    remove_left_session_dir(proc.pid, env)
    if code < 0:
        sys.stdout.flush()
        sys.stderr.flush()
        if -code not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(-code, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, [-code])
        os.kill(os.getpid(), -code)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED_SIGNALS)
    return 128 - code if code < 0 else code


def remove_left_session_dir(pid: int, env: Mapping[str, str]) -> None:
    """Remove ``$TMPDIR/ompi.<pid>``, the PMIx server's directory of mpirun ``pid``, if it is left.

    Open MPI 5's mpirun (PRRTE's ``prterun``) keeps its PMIx rendezvous files there and removes
    the directory as it exits; killed outright (``kill -9``, the out-of-memory killer) it cannot,
    and a later mpirun given the same pid (pids wrap: 32768 by default) fails at start with "The
    PMIx server's listener thread failed to start". Call it once ``pid`` has been reaped: no
    process has that pid then, so the directory is nobody's.

    Args:
        pid: mpirun's pid.
        env: the environment mpirun ran with (its ``TMPDIR``, else ``/tmp``).
    """
    path = os.path.join(env.get("TMPDIR") or "/tmp", f"ompi.{pid}")
    try:
        info = os.lstat(path)
    except OSError:
        return  # removed by mpirun itself, as it is whenever mpirun ends by itself
    if stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid():  # not a link, and ours
        shutil.rmtree(path, ignore_errors=True)
