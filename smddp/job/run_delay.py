"""Run delay: the time a process's main thread was runnable but not running (waiting for a CPU).

A job whose CPUs are taken (more busy threads than CPUs on the host, another job on the same
cores, or a virtual machine's CPUs taken by its host) runs every collective slower, and stays so
while they are taken: in the job-to-job runs of docs/performance.md ("Job to job"), every job that
was slow for smddp was slow for Open MPI in the same processes, and its ranks had waited for a CPU
20-80% of the wall time, against 0-5% in the fast jobs. No library's change gets a job out of that;
the job can see it and say so. Linux counts it per thread: the second field of
``/proc/<pid>/schedstat`` (nanoseconds runnable but not running). Under ``SMDDP_DEBUG=1`` every rank
reports its main thread's share of the world group's life when the group is destroyed.
"""

from __future__ import annotations

import time
from typing import Optional

#: From this share of the wall time waiting for a CPU, the report says the CPUs were taken.
TAKEN = 0.10

_SCHEDSTAT = "/proc/self/schedstat"  # the thread group leader's: the main thread's


def read(path: str = _SCHEDSTAT) -> Optional[int]:
    """The run delay (ns) of the thread whose ``schedstat`` is at ``path``; None where Linux does not say."""
    try:
        with open(path) as f:
            return int(f.read().split()[1])
    except (OSError, IndexError, ValueError):
        return None


class Meter:
    """The main thread's run delay from now on.

    Args:
        path: the ``schedstat`` file to read (the main thread's by default).
    """

    def __init__(self, path: str = _SCHEDSTAT):
        self._path = path
        self._start = time.monotonic()
        self._delay = read(path)

    def share(self) -> Optional[tuple]:
        """``(share, seconds)``: the share of the ``seconds`` since the meter began that the thread
        waited for a CPU; None where Linux does not say."""
        now, delay = time.monotonic(), read(self._path)
        if delay is None or self._delay is None or now <= self._start:
            return None
        seconds = now - self._start
        return max(0.0, (delay - self._delay) / 1e9 / seconds), seconds

    def report(self, rank: int) -> Optional[str]:
        """The ``SMDDP_DEBUG`` line for ``rank``: its share, and what to change where it is
        :data:`TAKEN` or more; None where Linux does not say."""
        found = self.share()
        if found is None:
            return None
        share, seconds = found
        line = (f"smddp: rank {rank}: its main thread waited for a CPU {share:.0%} of the {seconds:.1f} s since "
                f"init_process_group (run delay, /proc/self/schedstat)")
        if share < TAKEN:
            return line
        return (f"{line}: this job's CPUs were taken, and its collectives were slower by as much: more busy "
                f"threads than CPUs (fewer ranks per host, OMP_NUM_THREADS, DataLoader workers), another job "
                f"on the same cores, or a virtual machine's CPUs taken by its host (steal time in top)")
