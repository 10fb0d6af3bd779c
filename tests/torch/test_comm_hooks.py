"""torch's algorithms on DDP (communication hooks, ZeRO) train as on gloo, under real launchers.

``tests/ranks/hook_checks.py`` trains with torch's PowerSGD hook ten times in a row on smddp's
group and on a gloo group of the same job, then with a bucket per layer, and checks ``then``
callbacks that start synchronous and asynchronous all-reduces; then torch's fp16 compression
hook, post-local SGD with a periodic model averager over subgroups, and ZeroRedundancyOptimizer.
Before smddp ran futures' callbacks off its progress thread (:mod:`smddp.comm.engine.completer`),
PowerSGD hung until the collective deadline (a callback waited, on the progress thread, for an
all-reduce only that thread would complete).
With a bucket per layer gloo itself hangs or mixes collectives up (the callbacks race backward's
next all-reduce); smddp numbers a callback's collectives right after their parent's on every
rank (:meth:`smddp.comm.engine.Engine.chain`), and equals gloo whose hook waits for its future.

On 2 ranks the results are gloo's bit for bit. On 3 ranks a sum's rounding depends on the order
in which a backend adds the ranks' values (gloo's ring and smddp's planes differ): every rank of a
group must hold the same bits, and smddp's must be close to gloo's.
"""

from __future__ import annotations

import re
import sys
from collections import defaultdict

import pytest

from launchers import RANKS, mpirun, run, torchrun, untagged

SCRIPT = str(RANKS / "hook_checks.py")
TRAININGS = 10  # the script's
_DIGEST = re.compile(r"^DIGEST (\d+) (\S+) (\S+) ([0-9a-f]{16})$", re.M)
ENV = {"SMDDP_TIMEOUT": "120"}  # a hang is a failure, well before the test's own timeout

pytestmark = pytest.mark.slow


def digests(result, size: int) -> dict:
    """``{(group, check): {rank: digest}}`` of a job that passed its checks on every rank."""
    result.check()
    output = untagged(result.stdout)
    assert len(re.findall(r"^PASSED \d+ ", output, re.M)) == size, result.output
    found = defaultdict(dict)
    for rank, group, check, value in _DIGEST.findall(output):
        found[(group, check)][int(rank)] = value
    checks = {f"powersgd/{n}" for n in range(TRAININGS)} | {"powersgd-buckets", "fp16", "localsgd", "zero"}
    assert set(found) == {(group, check) for group in ("smddp", "gloo") for check in checks}, result.output
    assert all(len(ranks) == size for ranks in found.values()), result.output
    return found


def assert_as_gloo(found: dict, size: int) -> None:
    for (group, check), ranks in found.items():
        assert len(set(ranks.values())) == 1, f"{group} {check}: ranks differ: {ranks}"
        if group == "smddp" and size == 2:
            assert ranks == found[("gloo", check)], f"{check}: smddp {ranks}, gloo {found[('gloo', check)]}"


@pytest.mark.parametrize("size", [2, 3])
def test_powersgd_and_chained_callbacks_under_torchrun(size):
    assert_as_gloo(digests(torchrun(size, [SCRIPT], timeout=420, env=ENV), size), size)


@pytest.mark.mpi
@pytest.mark.parametrize("size", [2, 3])
def test_powersgd_and_chained_callbacks_under_mpirun(size):
    assert_as_gloo(digests(mpirun(size, [SCRIPT], timeout=420, env=ENV), size), size)


@pytest.mark.mpi
def test_powersgd_and_chained_callbacks_under_smddprun():
    result = run([sys.executable, "-m", "smddp.launch", "-np", "2", SCRIPT], timeout=420, env=ENV)
    assert_as_gloo(digests(result, 2), 2)
