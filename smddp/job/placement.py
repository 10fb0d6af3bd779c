"""CPU placement: each rank of a host on its own share of the host's CPUs where the launcher bound none.

Open MPI's ``mpirun`` binds each rank to its own cores (``--bind-to core`` for two ranks, to a
package for more), Slurm's ``srun`` binds as its site configures; ``torchrun`` and smddprun's own
launcher bind no rank: each may run on any CPU, and Linux may keep two ranks of a host on one CPU
while another idles. Ranks that hand data to each other through shared memory wake each other, and
the scheduler then places the woken rank beside its waker (it expects them to share a cache): a job
can settle with its ranks on one CPU for its whole life, each waiting for it half the time, its
all-reduces several times slower (docs/performance.md, "Job to job": one torchrun job in ten, 7.4x
at 64 KB, gloo normal in it).

:func:`place` gives each rank of a host, under those launchers, its share of the CPUs the process may
run on, as Open MPI does for its ranks: the CPUs split into ``local_size`` contiguous blocks of whole
cores (a core's hyperthreads stay together), block ``local_rank`` to this rank, for every thread the
process has and every thread and process it starts later (they inherit it). Nothing is taken from a
rank that its own share does not give back to it: the whole host is still used, a script's threads
run on its rank's share. It does nothing where the launcher binds (mpirun, srun, SageMaker's mpirun),
where fewer CPUs than ranks are allowed (ranks must share), with one rank on the host, or with
``SMDDP_CPU_BIND=none``. Under ``SMDDP_DEBUG`` each rank says where it runs.
"""

from __future__ import annotations

import os
from typing import Dict, List, Optional, Sequence, Tuple

from smddp import knobs
from smddp.job.topology import Topology

#: The launchers that start ranks bound to no CPU, as :mod:`smddp.job.topology` names them (smddprun's own
#: launcher sets torchrun's variables and is named so too).
UNBOUND_LAUNCHERS = frozenset({"torchrun"})


def cores(allowed: Sequence[int], cpuinfo: Optional[str] = None) -> List[List[int]]:
    """The CPUs of ``allowed`` as cores: lists of hyperthreads, in the order of their first CPU.

    ``cpuinfo``: the text of ``/proc/cpuinfo`` (read if None); a CPU it does not name is a core of its own.
    """
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as handle:
                cpuinfo = handle.read()
        except OSError:
            cpuinfo = ""
    core_of: Dict[int, Tuple[str, str]] = {}
    for block in cpuinfo.split("\n\n"):
        fields = dict((k.strip(), v.strip()) for k, _, v in (line.partition(":") for line in block.splitlines()))
        if fields.get("processor", "").isdigit():
            cpu = int(fields["processor"])
            core_of[cpu] = (fields.get("physical id", "0"), fields.get("core id", str(cpu)))
    found: Dict[Tuple[str, str], List[int]] = {}
    for cpu in sorted(allowed):
        found.setdefault(core_of.get(cpu, ("cpu", str(cpu))), []).append(cpu)
    return sorted(found.values(), key=lambda threads: threads[0])


def share(allowed: Sequence[int], local_rank: int, local_size: int,
          cpuinfo: Optional[str] = None) -> Optional[List[int]]:
    """The CPUs of ``allowed`` that rank ``local_rank`` of ``local_size`` takes: contiguous blocks of
    whole cores, the first ``cores % local_size`` blocks a core larger; with fewer cores than ranks
    but enough CPUs, blocks of CPUs. None with fewer CPUs than ranks (they must share)."""
    if local_size < 1 or not 0 <= local_rank < local_size or len(allowed) < local_size:
        return None
    units = cores(allowed, cpuinfo)
    if len(units) < local_size:
        units = [[cpu] for cpu in sorted(allowed)]
    base, extra = divmod(len(units), local_size)
    start = local_rank * base + min(local_rank, extra)
    block = units[start:start + base + (1 if local_rank < extra else 0)]
    return sorted(cpu for threads in block for cpu in threads)


def _threads() -> List[int]:
    try:
        return [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:
        return [0]


def place(topology: Topology) -> Optional[str]:
    """Bind this process (each thread it has, and what it starts later) to its rank's share of the host's
    CPUs where the launcher bound none (see the module docstring).

    Returns:
        What it did or why not, for ``SMDDP_DEBUG``; None where nothing applies (one rank on the
        host, a launcher that binds, ``SMDDP_CPU_BIND=none``, no affinity calls on this system).
    """
    if topology.local_size < 2 or topology.launcher not in UNBOUND_LAUNCHERS:
        return None
    if knobs.value("SMDDP_CPU_BIND") == "none" or not hasattr(os, "sched_setaffinity"):
        return None
    allowed = sorted(os.sched_getaffinity(0))
    rank, local_rank, local_size = topology.rank, topology.local_rank, topology.local_size
    cpus = share(allowed, local_rank, local_size)
    if cpus is None:
        return (f"smddp: rank {rank}: left on {_cpus(allowed)}: {local_size} ranks on this host and "
                f"{len(allowed)} CPUs allowed, fewer CPUs than ranks (they share them)")
    for tid in _threads():
        try:
            os.sched_setaffinity(tid, cpus)
        except OSError:  # a thread that ended meanwhile
            pass
    return (f"smddp: rank {rank}: runs on {_cpus(cpus)}, local rank {local_rank}'s share of the "
            f"{len(allowed)} this host's ranks may use (torchrun and smddprun's own launcher bind no rank; "
            f"SMDDP_CPU_BIND=none leaves them to the OS)")


def _cpus(cpus: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` as ``CPUs 0-2,5`` (taskset's notation), ``[3]`` as ``CPU 3``."""
    out, run = [], []
    for cpu in sorted(cpus):
        if run and cpu != run[-1] + 1:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
            run = []
        run.append(cpu)
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ("CPUs " if len(cpus) > 1 else "CPU ") + ",".join(out)
