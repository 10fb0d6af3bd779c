"""Every collective, every dtype and op, checked on every rank under real launchers."""

from __future__ import annotations

import pytest

from launchers import mpirun, rank_lines, torchrun

SCRIPT = "tests/ranks/collectives.py"


def assert_all_ranks_passed(result, size: int) -> None:
    result.check()
    passed = rank_lines(result.stdout, "PASSED")
    assert sorted(passed) == list(range(size)), result.output
    counts = set(passed.values())
    assert len(counts) == 1 and int(counts.pop()) >= 20, passed
    digests = rank_lines(result.stdout, "DIGEST")
    assert sorted(digests) == list(range(size)), result.output
    assert len(set(digests.values())) == 1, f"ranks disagree bit for bit: {digests}"


@pytest.mark.mpi
@pytest.mark.parametrize("np", [2, 3])
def test_mpi_backend(np):
    assert_all_ranks_passed(mpirun(np, [SCRIPT, "mpi"], timeout=240), np)


@pytest.mark.mpi
def test_mpi_backend_blocking_large_messages():
    """The other large-message path: MPI's blocking all-reduce on a worker thread."""
    env = {"SMDDP_MPI_LARGE_ALLREDUCE": "blocking"}
    assert_all_ranks_passed(mpirun(3, [SCRIPT, "mpi"], timeout=240, env=env), 3)


@pytest.mark.mpi
def test_gloo_backend_under_mpirun():
    """SMDDP_BACKEND=gloo under mpirun: the ranks meet over MPI, no MASTER_ADDR needed."""
    assert_all_ranks_passed(mpirun(2, [SCRIPT, "gloo"], timeout=240, env={"SMDDP_BACKEND": "gloo"}), 2)


def test_gloo_backend_under_torchrun():
    assert_all_ranks_passed(torchrun(2, [SCRIPT, "gloo"], timeout=240), 2)
