"""Collectives that differ across ranks raise on every rank, with SMDDP_DEBUG unset.

Each test runs ``tests/scripts/mismatch_job.py`` (every case of issue 25: dtype, element
count, root, one operation against another, barrier against all_reduce, SUM against MAX, a
1M-element count) under a real launcher, and checks every rank's report: each rank raised
:class:`~smddp.errors.CollectiveMismatchError` with the same message, naming the odd rank and
what differs, and a correct all-reduce right after gives every rank the right sum (the plane
stays in step). The planes: shared memory (compiled core and Python path, ``mpirun -np 2`` and
``-np 3``, ``torchrun``), gloo pinned with ``SMDDP_CPU_PLANE=gloo``, where no rank may die
of a signal, and the hierarchical plane over two "hosts" made with ``SMDDP_HOST_ID``, where the
group is broken after a mismatch. A gather whose arguments only the root rejects is checked
on shared memory and gloo.
"""

from __future__ import annotations

import re
from typing import Dict, List, Tuple

import pytest

from launchers import mpirun, torchrun

SCRIPT = "tests/scripts/mismatch_job.py"
# The collective timeout of the jobs: a rank that waited for a peer that raised would end
# its job by it (the launcher's limit is what proves "no hang").
ENV = {"SMDDP_TIMEOUT": "20"}

# What each case's message must say (the last rank is the odd one out).
EXPECTED = {
    "dtype_float64": "(they differ in dtype)",
    "dtype_int32": "(they differ in dtype)",
    "count_all_reduce": "(they differ in element count)",
    "count_broadcast": "(they differ in element count)",
    "count_all_gather": "(they differ in element count)",
    "root": "(they differ in source rank)",
    "barrier_vs_all_reduce": "barrier() as sequence",
    "all_reduce_vs_broadcast": "broadcast(src=0, dtype=float32, numel=4)",
    "sum_vs_max": "(they differ in reduction op)",
    "count_1m": "numel=1048577",
}
SHM = "on the shared-memory plane"
GLOO = "on the gloo plane"


def _lines(output: str) -> List[str]:
    """The output's lines without torchrun's ``[default0]:`` prefix."""
    return [re.sub(r"^\[default\d+\]:", "", line) for line in output.splitlines()]


def reports(output: str, word: str) -> Dict[Tuple[str, int], str]:
    """``{(case, rank): rest of the line}`` of the lines that start with ``word``."""
    found = {}
    for line in _lines(output):
        parts = line.split(" ", 3)
        if parts[0] == word and len(parts) >= 3:
            found[(parts[1], int(parts[2]))] = parts[3] if len(parts) > 3 else ""
    return found


def check_every_case(result, size: int, plane: str) -> None:
    """Every case raised CollectiveMismatchError on every rank, and the job went on correctly."""
    raised, after = reports(result.output, "RAISED"), reports(result.output, "AFTER")
    ended = [line for line in _lines(result.stdout) if line.startswith("END ")]
    assert len(ended) == size, result.output
    total = float(sum(r + 1 for r in range(size)))  # each rank adds rank + 1
    for case, expected in EXPECTED.items():
        messages = {}
        for rank in range(size):
            line = raised.get((case, rank))
            assert line is not None, f"{case}: rank {rank} did not raise\n{result.output}"
            kind, _, message = line.partition(" ")
            assert kind == "CollectiveMismatchError", (case, rank, line)
            messages[rank] = message
        assert len(set(messages.values())) == 1, f"{case}: the ranks' messages differ: {messages}"
        message = messages[0]
        assert expected in message and plane in message, (case, message)
        odd = "1-2" if case == "root" and size == 3 else str(size - 1)
        assert f"Ranks that differ from rank 0: {odd}." in message, (case, message)
        for rank in range(size):
            assert after.get((case, rank)) == str([total] * 3), (case, rank, after.get((case, rank)))


@pytest.mark.mpi
@pytest.mark.parametrize("api", ["v1", "torch"])
@pytest.mark.parametrize("np", [2, 3])
def test_mismatches_raise_on_every_rank_shm(np, api):
    result = mpirun(np, [SCRIPT, api], timeout=180, env=ENV).check()
    check_every_case(result, np, SHM)


@pytest.mark.mpi
def test_python_path_raises_the_same():
    result = mpirun(2, [SCRIPT, "v1"], timeout=180, env={**ENV, "SMDDP_SHM_NATIVE": "0"}).check()
    check_every_case(result, 2, SHM)


def test_mismatches_raise_on_every_rank_torchrun():
    result = torchrun(2, [SCRIPT, "torch"], timeout=180, env=ENV).check()
    check_every_case(result, 2, SHM)


@pytest.mark.mpi
@pytest.mark.parametrize("np", [2, 3])
def test_gloo_plane_raises_instead_of_aborting(np):
    result = mpirun(np, [SCRIPT, "torch"], timeout=180, env={**ENV, "SMDDP_CPU_PLANE": "gloo"})
    # gloo's abort prints "terminate called after throwing an instance of 'gloo::EnforceNotMet'".
    assert "EnforceNotMet" not in result.output and "received signal" not in result.output, result.output
    result.check()  # every rank exited 0: none died of a signal
    check_every_case(result, np, GLOO)


@pytest.mark.mpi
@pytest.mark.parametrize("plane,words", [("auto", SHM), ("gloo", GLOO)])
def test_gather_whose_arguments_only_the_root_rejects(plane, words):
    # The root raises its argument error before sending, yet the call takes its sequence
    # number: its next collective (the all-reduce) meets the others' gather, and every rank
    # raises. The root is then one collective behind for good: the others' next all-reduce
    # finds no partner and fails (5 s timeout, or the root's exit) instead of pairing wrongly.
    env = {"SMDDP_TIMEOUT": "5", "SMDDP_CPU_PLANE": plane}
    result = mpirun(3, [SCRIPT, "torch", "gather_bad_root"], timeout=120, env=env)
    assert "EnforceNotMet" not in result.output, result.output
    raised, after = reports(result.output, "RAISED"), reports(result.output, "AFTER")
    root = raised.get(("gather_bad_root", 0), "")
    assert root.startswith("InvalidArgumentError gather: gather_list has 2 tensors"), result.output
    message = after.get(("gather_bad_root", 0), "")
    assert message.startswith("CollectiveMismatchError") and words in message, result.output
    assert "rank 0: all_reduce(op=SUM, dtype=float32, numel=3) as sequence 2" in message, message
    assert "rank 1-2: all_to_all_single(dtype=float32) as sequence 1" in message, message
    assert "Different sequence numbers" in message, message
    for rank in (1, 2):
        line = raised.get(("gather_bad_root", rank), "")
        assert line == message, (rank, line, message)
        failed = after.get(("gather_bad_root", rank), "")
        assert failed.split(" ", 1)[0] in ("CollectiveError", "CollectiveTimeout"), (rank, failed)


@pytest.mark.mpi
@pytest.mark.parametrize("plane,words", [("auto", SHM), ("gloo", GLOO)])
def test_coalesced_call_reports_its_first_mismatch(plane, words):
    # One Work stands for both all-reduces: wait() raises the first one's mismatch on every
    # rank (one plane sees it as a rank starts, another as it completes), the second one runs
    # on every rank, and so the ranks stay in step.
    result = mpirun(2, [SCRIPT, "torch", "coalesced"], timeout=120, env={**ENV, "SMDDP_CPU_PLANE": plane}).check()
    raised, after = reports(result.output, "RAISED"), reports(result.output, "AFTER")
    for rank in range(2):
        line = raised.get(("coalesced", rank), "")
        assert line.startswith("CollectiveMismatchError"), (rank, result.output)
        assert "(they differ in element count)" in line and words in line, line
        assert "rank 1: all_reduce(op=SUM, dtype=float32, numel=5) as sequence 1" in line, line
        assert after.get(("coalesced", rank)) == str([3.0] * 3), (rank, after)


@pytest.mark.mpi
def test_hierarchical_plane_mismatch_within_a_host_breaks_the_group():
    # Two "hosts" of two ranks; rank 3's 1M-element all-reduce (the hierarchical path) is one
    # element longer. Host 1's ranks compare fingerprints and raise; host 0's ranks agree with
    # each other and wait in the exchange between hosts until the timeout. Every later
    # collective of the group fails on every rank: nothing pairs wrongly.
    # Four ranks share two cores: with 5 s this failed 2 times in 7 while other jobs ran beside it.
    env = {"SMDDP_TIMEOUT": "10", "MISMATCH_RANKS_PER_HOST": "2"}
    result = mpirun(4, [SCRIPT, "v1", "count_1m"], timeout=120, env=env)
    raised, after = reports(result.output, "RAISED"), reports(result.output, "AFTER")
    for rank in (2, 3):
        line = raised.get(("count_1m", rank), "")
        assert line.startswith("CollectiveMismatchError") and SHM in line, (rank, result.output)
        assert ("rank 2: all_reduce(op=SUM, dtype=float32, numel=1048576) as sequence 1; "
                "rank 3: all_reduce(op=SUM, dtype=float32, numel=1048577)") in line, line
        assert after.get(("count_1m", rank), "").startswith(
            "CollectiveError the hierarchical CPU plane cannot go on"), (rank, after)
    for rank in (0, 1):
        assert raised.get(("count_1m", rank), "").startswith("CollectiveTimeout"), (rank, result.output)
        assert after.get(("count_1m", rank), "").startswith("CollectiveTimeout"), (rank, after)
