"""A host's ranks on shares of its CPUs (``smddp.job.placement``): the split, from a machine's ``/proc/cpuinfo``.

The launched jobs (each rank's CPUs under torchrun and smddprun's own launcher, and left alone
with ``SMDDP_CPU_BIND=none``) are in tests/comm/planes/test_every_launcher.py.
"""

from __future__ import annotations

import pytest

from smddp.job import placement
from smddp.job.topology import Topology

pytestmark = pytest.mark.unit


def cpuinfo(cores: int, threads: int, sockets: int = 1) -> str:
    """``/proc/cpuinfo`` of a machine numbered as Linux numbers x86 hyperthreads: CPU ``c`` and
    ``c + cores * sockets`` are the two threads of one core."""
    blocks = []
    total = cores * sockets
    for thread in range(threads):
        for socket in range(sockets):
            for core in range(cores):
                cpu = thread * total + socket * cores + core
                blocks.append(f"processor\t: {cpu}\nphysical id\t: {socket}\ncore id\t\t: {core}\n")
    return "\n".join(blocks)


def test_two_ranks_on_two_cpus_take_one_each():
    info = cpuinfo(2, 1)
    assert [placement.share([0, 1], r, 2, info) for r in range(2)] == [[0], [1]]


def test_hyperthreads_of_a_core_stay_together():
    info = cpuinfo(4, 2)  # CPUs 0-3 and their siblings 4-7
    shares = [placement.share(list(range(8)), r, 2, info) for r in range(2)]
    assert shares == [[0, 1, 4, 5], [2, 3, 6, 7]]


def test_uneven_split_gives_the_first_ranks_a_core_more_and_uses_every_cpu():
    info = cpuinfo(5, 1, sockets=2)  # 10 cores
    shares = [placement.share(list(range(10)), r, 3, info) for r in range(3)]
    assert [len(s) for s in shares] == [4, 3, 3]
    assert sorted(c for s in shares for c in s) == list(range(10))


def test_fewer_cores_than_ranks_splits_the_cpus():
    info = cpuinfo(2, 2)  # 2 cores, 4 CPUs, 4 ranks: one hyperthread each
    assert [placement.share([0, 1, 2, 3], r, 4, info) for r in range(4)] == [[0], [1], [2], [3]]


def test_fewer_cpus_than_ranks_shares_them_all():
    assert placement.share([0, 1], 0, 3, cpuinfo(2, 1)) is None


def test_only_the_allowed_cpus_are_split():
    # taskset -c 2-5 torchrun ...: the ranks split what the launcher was given
    shares = [placement.share([2, 3, 4, 5], r, 2, cpuinfo(8, 1)) for r in range(2)]
    assert shares == [[2, 3], [4, 5]]


def test_a_cpu_cpuinfo_does_not_name_is_a_core_of_its_own():
    assert placement.cores([0, 1, 2], "") == [[0], [1], [2]]


@pytest.mark.parametrize("topology", [
    Topology(rank=0, size=2, local_rank=0, local_size=2, launcher="openmpi"),  # mpirun binds its ranks
    Topology(rank=0, size=2, local_rank=0, local_size=2, launcher="slurm"),
    Topology(rank=0, size=2, local_rank=0, local_size=1, launcher="torchrun"),  # alone on its host
])
def test_nothing_is_placed_where_the_launcher_binds_or_the_rank_is_alone(topology):
    assert placement.place(topology) is None


def test_none_leaves_placement_to_the_os(monkeypatch):
    monkeypatch.setenv("SMDDP_CPU_BIND", "none")
    assert placement.place(Topology(rank=0, size=2, local_rank=0, local_size=2, launcher="torchrun")) is None
