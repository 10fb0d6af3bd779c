"""smddprun without mpirun: N ranks started on this machine and supervised together.

One rank fails or a signal comes, all stop; each rank's output is copied line by line, tagged
``[1,<rank>]<stdout>:`` as ``mpirun --tag-output`` does.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from typing import BinaryIO, Dict, List, Optional, Sequence, Tuple

#: Seconds between asking the ranks to stop and killing them.
STOP_GRACE_S = 3.0


def _pump(pipe: BinaryIO, sink: BinaryIO, prefix: bytes, lock: threading.Lock) -> None:
    """Copy ``pipe`` to ``sink`` line by line, each line tagged with ``prefix``."""
    try:
        for line in iter(pipe.readline, b""):
            if not line.endswith(b"\n"):
                line += b"\n"
            with lock:
                sink.write(prefix + line)
                sink.flush()
    except (OSError, ValueError):
        pass  # our own output is gone (a closed pipe): nothing left to copy to
    finally:
        pipe.close()


def _signal_group(procs: Sequence[subprocess.Popen], sig: int, everyone: bool = False) -> None:
    """Send ``sig`` to the process group of every rank still running.

    With ``everyone``, also to the groups of ranks that have exited: what they started
    (data loader workers, helpers) may still run there.
    """
    for proc in procs:
        if everyone or proc.poll() is None:
            try:
                os.killpg(proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass


def _exit_status(returncode: int) -> int:
    """A shell-style status: negative (killed by a signal) becomes 128 + signal."""
    return 128 - returncode if returncode < 0 else returncode


class LocalJob:
    """N ranks started here, supervised together: one fails or a signal comes, all stop.

    Each rank runs in its own session, so a terminal's Ctrl-C reaches smddprun only, which
    forwards it; ranks also end if smddprun itself dies (``SMDDP_LAUNCHER_PID``).
    """

    def __init__(self, commands: Sequence[Tuple[List[str], Dict[str, str]]], grace: float = STOP_GRACE_S):
        self.commands = list(commands)
        self.grace = grace
        self.procs: List[subprocess.Popen] = []
        self.received: Optional[int] = None
        self._kill_at: Optional[float] = None

    def _on_signal(self, signum: int, _frame) -> None:
        if self.received is not None:  # a second Ctrl-C: stop waiting
            _signal_group(self.procs, signal.SIGKILL)
        self.received = signum
        _signal_group(self.procs, signum, everyone=True)
        self._kill_at = self._kill_at or time.monotonic() + self.grace

    def _start(self, out: BinaryIO, err: BinaryIO) -> List[threading.Thread]:
        lock = threading.Lock()
        for cmd, env in self.commands:
            if self.received is not None:
                break
            self.procs.append(subprocess.Popen(
                cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, start_new_session=True,
            ))
        pumps = []
        for rank, proc in enumerate(self.procs):
            for pipe, sink, tag in ((proc.stdout, out, "stdout"), (proc.stderr, err, "stderr")):
                thread = threading.Thread(
                    target=_pump, args=(pipe, sink, f"[1,{rank}]<{tag}>: ".encode(), lock), daemon=True,
                )
                thread.start()
                pumps.append(thread)
        return pumps

    def _supervise(self) -> int:
        failed: Optional[Tuple[int, int]] = None
        killed = False
        while True:
            codes = [proc.poll() for proc in self.procs]
            if all(code is not None for code in codes):
                break
            if failed is None and self.received is None:
                for rank, code in enumerate(codes):
                    if code not in (None, 0):
                        failed = (rank, _exit_status(code))
                        print(f"smddprun: rank {rank} exited with status {failed[1]}; stopping the other ranks",
                              file=sys.stderr, flush=True)
                        _signal_group(self.procs, signal.SIGTERM, everyone=True)
                        self._kill_at = time.monotonic() + self.grace
                        break
            if not killed and self._kill_at is not None and time.monotonic() >= self._kill_at:
                _signal_group(self.procs, signal.SIGKILL, everyone=True)
                killed = True
            time.sleep(0.05)
        if self._kill_at is not None and not killed:
            _signal_group(self.procs, signal.SIGKILL, everyone=True)  # whatever the ranks left behind
        if self.received is not None:
            return 128 + self.received
        if failed is None:  # every rank ended within one poll: the first that failed speaks
            failed = next(((r, _exit_status(c)) for r, c in enumerate(codes) if c != 0), None)
        return 0 if failed is None else failed[1]

    def run(self, out: Optional[BinaryIO] = None, err: Optional[BinaryIO] = None) -> int:
        """Start every rank, copy their output, wait; returns the job's exit status."""
        stops = [s for s in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None)) if s is not None]
        previous = {s: signal.signal(s, self._on_signal) for s in stops}
        try:
            pumps = self._start(out or sys.stdout.buffer, err or sys.stderr.buffer)
            status = self._supervise()
            for thread in pumps:
                thread.join(timeout=2.0)
            return status
        finally:
            _signal_group(self.procs, signal.SIGKILL)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
