"""The hierarchical CPU plane across two hosts made of network namespaces (root only)."""

from __future__ import annotations

import sys
import sysconfig
from pathlib import Path

import pytest

from launchers import RANKS, ROOT, rank_lines, run

sys.path.insert(0, str(ROOT / "benchmarks"))
from netns_hosts import NamespaceError, two_hosts  # noqa: E402

SMDDPRUN = str(Path(sysconfig.get_path("scripts")) / "smddprun")

pytestmark = pytest.mark.mpi


def test_every_collective_exact_on_two_hosts_of_two_ranks():
    try:
        hosts_cm = two_hosts()
        hosts = hosts_cm.__enter__()
    except NamespaceError as exc:
        pytest.skip(f"two namespace hosts cannot be made here: {exc}")
    try:
        cmd = [SMDDPRUN, "-H", "host1:2,host2:2", "--mpi-args", hosts.mpi_args,
               "-x", "PYTHONPATH", "-x", "OMP_NUM_THREADS", "-x", "SMDDP_SHM_SLOT_BYTES", "-x", "SMDDP_SHM_NATIVE",
               str(RANKS / "shm_checks.py"), "checks", "hierarchical"]
        # 64 KiB slots: the all-reduces above the hierarchical threshold run in several slices;
        # the compiled core's run, then the Python path's, which must give the same bits.
        results = {core: run(hosts.command(cmd), timeout=300,
                             env={"SMDDP_SHM_SLOT_BYTES": "65536", "SMDDP_SHM_NATIVE": flag})
                   for core, flag in (("native", "1"), ("python", "0"))}
    finally:
        hosts_cm.__exit__(None, None, None)
    for core, result in results.items():
        assert result.returncode == 0, result.output
        assert rank_lines(result.stdout, "CORE") == {r: core for r in range(4)}, result.output
    assert rank_lines(results["native"].stdout, "DIGEST") == rank_lines(results["python"].stdout, "DIGEST")
    result = results["native"]
    assert sorted(rank_lines(result.stdout, "PASSED")) == [0, 1, 2, 3], result.output
    digests = rank_lines(result.stdout, "DIGEST")
    assert len(set(digests.values())) == 1, digests
    where = {rank: line.split() for rank, line in rank_lines(result.stdout, "LOCAL").items()}
    assert {r: (int(w[0]), w[1]) for r, w in where.items()} == {
        0: (0, "host1"), 1: (1, "host1"), 2: (0, "host2"), 3: (1, "host2")}, where
    for rank, line in rank_lines(result.stdout, "PLANES").items():
        used = set(line.split(","))
        # Large all-reduces take the hierarchical path; small ones and the rest flat MPI.
        assert "all_reduce:hierarchical" in used and "all_reduce:mpi" in used, (rank, used)
        assert {u for u in used if not u.startswith("all_reduce")} <= {
            "all_gather:mpi", "broadcast:mpi", "barrier:mpi", "all_to_all_single:mpi",
            "reduce_scatter:mpi"}, (rank, used)
