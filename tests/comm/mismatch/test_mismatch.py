"""Collectives that differ across ranks raise on every rank, with SMDDP_DEBUG unset.

Each test runs ``tests/ranks/mismatch_job.py`` (every case of issue 25: dtype, element
count, root, one operation against another, barrier against all_reduce, SUM against MAX, a
1M-element count; issue 33's all-to-all splits that do not pair up and all-reduces on either side
of the hierarchical plane's 256 KB switch) under a real launcher, and checks every rank's report: each rank raised
:class:`~smddp.errors.CollectiveMismatchError` with the same message, naming the odd rank and
what differs, and a correct all-reduce right after gives every rank the right sum (the plane
stays in step). The planes: shared memory (compiled core and Python path, ``mpirun -np 2`` and
``-np 3``, ``torchrun``), gloo pinned with ``SMDDP_CPU_PLANE=gloo``, where no rank may die
of a signal, MPI pinned (its all-to-all), and the hierarchical plane over MPI and over gloo,
on two "hosts" made with ``SMDDP_HOST_ID`` and built differently, where all-reduces on either
side of the 256 KB switch and unpaired all-to-all splits raise on every rank and the group goes
on. A gather whose arguments only the root rejects is checked on shared memory and gloo.
"""

from __future__ import annotations

import re
from typing import Dict, List, Tuple

import pytest

from launchers import mpirun, torchrun

SCRIPT = "tests/ranks/mismatch_job.py"
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
    "band_vs_bor": "(they differ in reduction op)",
    "count_1m": "numel=1048577",
    "a2a_unpaired": "split sizes do not pair up",
    "switch_rank": "(they differ in element count)",
    "switch_host": "(they differ in element count)",
}
#: The cases every plane checks whatever it is: the hierarchical plane's all-reduces and all-to-all.
ACROSS_HOSTS = ["count_1m", "a2a_unpaired", "switch_rank", "switch_host"]
SHM = "on the shared-memory plane"
GLOO = "on the gloo plane"
MPI = "on the MPI plane"


def odd_ranks(case: str, size: int) -> str:
    """The ranks whose call differs from rank 0's, as the message names them."""
    if case == "root" and size == 3:
        return "1-2"
    if case == "switch_host":
        low = size // 2
        return str(low) if low == size - 1 else f"{low}-{size - 1}"
    return str(size - 1)


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


def check_every_case(result, size: int, plane: str, cases=tuple(EXPECTED), planes=None) -> None:
    """Every case raised CollectiveMismatchError on every rank, and the job went on correctly.

    ``planes``: the plane named by the message of a case checked elsewhere than ``plane``.
    """
    raised, after = reports(result.output, "RAISED"), reports(result.output, "AFTER")
    ended = [line for line in _lines(result.stdout) if line.startswith("END ")]
    assert len(ended) == size, result.output
    total = float(sum(r + 1 for r in range(size)))  # each rank adds rank + 1
    for case in cases:
        messages = {}
        for rank in range(size):
            line = raised.get((case, rank))
            assert line is not None, f"{case}: rank {rank} did not raise\n{result.output}"
            kind, _, message = line.partition(" ")
            assert kind == "CollectiveMismatchError", (case, rank, line)
            messages[rank] = message
        assert len(set(messages.values())) == 1, f"{case}: the ranks' messages differ: {messages}"
        message = messages[0]
        assert EXPECTED[case] in message and (planes or {}).get(case, plane) in message, (case, message)
        if case == "a2a_unpaired":
            assert f"rank 0 sends 2 elements to rank {size - 1}, which expects 3." in message, message
        else:
            assert f"Ranks that differ from rank 0: {odd_ranks(case, size)}." in message, (case, message)
        if case == "band_vs_bor":  # the op codes past the arithmetic ones, carried and named
            assert "all_reduce(op=BAND, dtype=int32" in message and "all_reduce(op=BOR, dtype=int32" in message, message
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
    # Without the compiled core, all-to-all goes through the flat communicator (MPI), which checks it.
    check_every_case(result, 2, SHM, planes={"a2a_unpaired": MPI})


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
def test_flat_mpi_plane_checks_all_to_all_splits():
    result = mpirun(2, [SCRIPT, "torch", "a2a_unpaired"], timeout=120, env={**ENV, "SMDDP_CPU_PLANE": "mpi"})
    assert "MPI_ERR" not in result.output, result.output
    check_every_case(result.check(), 2, MPI, cases=["a2a_unpaired"])


# Two "hosts" of two ranks, built differently: host 1 without the compiled core, with other sizes and
# another threshold (the group runs host 0's). Every case raises on every rank, before any step:
# an all-reduce's fingerprint (its byte count, hence its path) travels in the flat communicator's
# first exchange, on either side of the 256 KB switch, and so do an all-to-all's split sizes.
HOSTS = {"FAKE_RANKS_PER_HOST": "2", "FAKE_ENV_host1": "SMDDP_SHM_NATIVE=0 SMDDP_SHM_CHUNK_BYTES=262144 "
         "SMDDP_SHM_SLOT_BYTES=1048576 SMDDP_HIERARCHICAL_MIN_BYTES=65536 SMDDP_SHM_ONE_SHOT_MAX=1024"}


@pytest.mark.mpi
def test_hierarchical_plane_over_mpi_raises_on_every_rank_and_goes_on():
    result = mpirun(4, [SCRIPT, "v1", *ACROSS_HOSTS], timeout=240, env={**ENV, **HOSTS}).check()
    check_every_case(result, 4, MPI, cases=ACROSS_HOSTS)


def test_hierarchical_plane_over_gloo_raises_on_every_rank_and_goes_on():
    result = torchrun(4, [SCRIPT, "torch", *ACROSS_HOSTS], timeout=240, env={**ENV, **HOSTS}).check()
    check_every_case(result, 4, GLOO, cases=ACROSS_HOSTS)
