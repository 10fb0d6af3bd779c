"""``torch.compile(DDP(model))`` on smddp's group trains as on gloo, bit for bit, under real launchers.

``tests/ranks/compile_checks.py`` trains every variant (``optimize_ddp`` on and off, the ``eager``,
``aot_eager`` and, where a C++ compiler is on PATH, ``inductor`` backends, a compiled step) and
prints each rank's parameter digests: torch's DDP (and compiled autograd over it) under torchrun,
smddp's DDP class under mpirun, as their users launch them; a gloo job of the same script under
torchrun is the reference. (Both launchers give smddp's group the same shared-memory plane here:
running every variant under both doubled the time and checked nothing more.) Before smddp hid its group from dynamo
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
    kind: {f"{kind}-ddp/optimize_ddp={optimize}/{backend}" for optimize in (True, False)
           for backend in ("eager", "aot_eager") + (("inductor",) if shutil.which("g++") else ())}
    | {f"{kind}-ddp/whole-step/eager"} | ({"torch-ddp/compiled-autograd/eager"} if kind == "torch" else set())
    for kind in ("torch", "smddp")
}
_LINE = re.compile(r"^COMPILE (\d+) (\S+) (\d+) (\S+) ([0-9a-f]{16}) ([0-9a-f]{16})$", re.M)

pytestmark = pytest.mark.slow


def reports(result, backend: str, group: str, kinds=("torch", "smddp")) -> dict:
    """``{variant: {rank: (compiled forwards, smddp's hook, digest before, digest after)}}`` of a 2-rank
    job that ran the variants of ``kinds``."""
    result.check()
    output = untagged(result.stdout)
    assert set(re.findall(r"^BACKEND \d+ (\S+ \S+)$", output, re.M)) == {f"{backend} {group}"}, result.output
    found = defaultdict(dict)
    for rank, variant, *fields in _LINE.findall(output):
        found[variant][int(rank)] = (int(fields[0]), *fields[1:])
    assert set(found) == set().union(*(VARIANTS[kind] for kind in kinds)), result.output
    assert all(set(ranks) == {0, 1} for ranks in found.values()), result.output
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
    for variant in sorted(found):
        for rank in (0, 1):
            _, hook, before, after = found[variant][rank]
            # smddp's class puts its communication hook in on the shared-memory plane (one host here)
            assert hook == ("on" if variant.startswith("smddp") else "-"), (variant, rank, hook)
            assert (before, after) == gloo[variant][rank][2:], f"{variant} rank {rank}: not gloo's parameters"


def test_compiled_ddp_torchrun(gloo):
    """torch's DDP, and compiled autograd over it, as torchrun users launch it."""
    result = torchrun(2, [SCRIPT, "smddp", "torch"], timeout=300)
    assert_as_gloo(reports(result, "smddp", "SmddpProcessGroup", ["torch"]), gloo)


@pytest.mark.mpi
def test_compiled_ddp_mpirun(gloo):
    """smddp's DDP class, as SageMaker scripts run it under mpirun."""
    result = mpirun(2, [SCRIPT, "smddp", "smddp"], timeout=300)
    assert_as_gloo(reports(result, "smddp", "SmddpProcessGroup", ["smddp"]), gloo)
