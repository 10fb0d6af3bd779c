"""The Work of smddp's ProcessGroup: one object, complete in C++ whoever waits or polls.

tests/ranks/work_checks.py, on every rank: a Work nobody waits on turns complete in torch's
C++ ``isCompleted()`` and its C++ future holds the result (a future callback sees it too);
``wait(timeout)`` raises when the timeout passes and leaves the collective in flight; every
collective of torch's API gives a future with its result.
"""

from __future__ import annotations

import pytest

from launchers import mpirun, rank_lines, torchrun

SCRIPT = "tests/ranks/work_checks.py"


def assert_all_ranks_passed(result, size: int) -> None:
    assert result.returncode == 0, result.output
    assert not rank_lines(result.stdout, "FAIL"), result.output
    passed = rank_lines(result.stdout, "PASSED")
    assert sorted(passed) == list(range(size)), result.output


def test_work_torchrun():
    assert_all_ranks_passed(torchrun(2, [SCRIPT], timeout=240), 2)


@pytest.mark.mpi
@pytest.mark.parametrize("np", [2, 3])
def test_work_mpirun(np):
    assert_all_ranks_passed(mpirun(np, [SCRIPT], timeout=240), np)
