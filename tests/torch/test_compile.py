"""``torch.compile(DDP(model))`` on smddp's group trains as on gloo, bit for bit, under real launchers.

``scripts/compile_checks.py`` trains every variant in one job per launcher (torch's DDP and
smddp's, ``optimize_ddp`` on and off, the ``eager``, ``aot_eager`` and, where a C++ compiler is
on PATH, ``inductor`` backends) and prints each rank's parameter digests; a gloo job of the same
script under torchrun is the reference. Before smddp hid its group from dynamo
(``smddp._compat.opaque_to_dynamo``) every variant failed at its second step: DDP's bucket
rebuild called the group's Python ``broadcast`` while dynamo's frame hook was on.
"""

from __future__ import annotations

import re
import shutil
from collections import defaultdict

import pytest

from launchers import RANKS, mpirun, torchrun, untagged

SCRIPT = str(RANKS / "compile_checks.py")
STEPS = 4  # the script's
VARIANTS = {
    f"{kind}-ddp/optimize_ddp={optimize}/{backend}"
    for kind in ("torch", "smddp") for optimize in (True, False)
    for backend in ("eager", "aot_eager") + (("inductor",) if shutil.which("g++") else ())
} | {"torch-ddp/whole-step/eager", "smddp-ddp/whole-step/eager", "torch-ddp/compiled-autograd/aot_eager"}
_LINE = re.compile(r"^COMPILE (\d+) (\S+) (\d+) (\S+) ([0-9a-f]{16}) ([0-9a-f]{16})$", re.M)

pytestmark = pytest.mark.slow


def reports(result, backend: str, group: str) -> dict:
    """``{variant: {rank: (compiled forwards, smddp's hook, digest before, digest after)}}`` of a 2-rank job."""
    result.check()
    output = untagged(result.stdout)
    assert set(re.findall(r"^BACKEND \d+ (\S+ \S+)$", output, re.M)) == {f"{backend} {group}"}, result.output
    found = defaultdict(dict)
    for rank, variant, *fields in _LINE.findall(output):
        found[variant][int(rank)] = (int(fields[0]), *fields[1:])
    assert set(found) == VARIANTS and all(set(ranks) == {0, 1} for ranks in found.values()), result.output
    for variant, ranks in found.items():
        for rank, (compiled, _hook, before, after) in ranks.items():
            assert compiled == STEPS, f"{variant} rank {rank}: {compiled} of {STEPS} forwards compiled"
            assert after != before, f"{variant} rank {rank}: training changed nothing"
    return found


@pytest.fixture(scope="module")
def gloo():
    """The reference: the same script on torch's gloo under torchrun."""
    return reports(torchrun(2, [SCRIPT, "gloo"], timeout=300), "gloo", "ProcessGroup")


def assert_as_gloo(found: dict, gloo: dict) -> None:
    for variant in sorted(VARIANTS):
        for rank in (0, 1):
            _, hook, before, after = found[variant][rank]
            # smddp's class puts its communication hook in on the shared-memory plane (one host here)
            assert hook == ("on" if variant.startswith("smddp") else "-"), (variant, rank, hook)
            assert (before, after) == gloo[variant][rank][2:], f"{variant} rank {rank}: not gloo's parameters"


def test_compiled_ddp_torchrun(gloo):
    result = torchrun(2, [SCRIPT, "smddp"], timeout=300)
    assert_as_gloo(reports(result, "smddp", "SmddpProcessGroup"), gloo)


@pytest.mark.mpi
def test_compiled_ddp_mpirun(gloo):
    result = mpirun(2, [SCRIPT, "smddp"], timeout=300)
    assert_as_gloo(reports(result, "smddp", "SmddpProcessGroup"), gloo)
