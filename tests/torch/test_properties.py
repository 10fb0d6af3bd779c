"""Property-based tests of the public API (hypothesis): a world of one here, and a real mpirun job.

Every generated call either matches the single-process reference exactly or raises the
documented exception for one of its bad arguments (see ``tests/ranks/api_properties.py``).
"""

from __future__ import annotations

import importlib.util
import time

import pytest

import smddp.torch.distributed as dist
from smddp.comm.engine.debug import DebugComparison

from launchers import RANKS, mpirun, rank_lines

_spec = importlib.util.spec_from_file_location("api_properties", RANKS / "api_properties.py")
props = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(props)

IN_PROCESS_EXAMPLES = 500
MPI_EXAMPLES = 150
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK",
                 "SLURM_PROCID", "SM_HOSTS", "SMDDP_BACKEND", "MASTER_ADDR", "MASTER_PORT", "SMDDP_DEBUG")


@pytest.fixture
def world_of_one(monkeypatch):
    for name in LAUNCHER_VARS:
        monkeypatch.delenv(name, raising=False)
    dist.init_process_group()
    assert dist.get_backend() == "local"
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("name", list(props.PROPERTIES))
def test_world_of_one(world_of_one, name):
    start = time.monotonic()
    ran = props.run(name, IN_PROCESS_EXAMPLES, 0, 1)
    print(f"hypothesis: {name}: {ran} cases in a world of one, {time.monotonic() - start:.1f} s")
    assert ran >= (12 if name == "barrier" else IN_PROCESS_EXAMPLES // 2)  # barrier has 12 distinct cases


def test_world_of_one_with_debug_checks(world_of_one, monkeypatch):
    # SMDDP_DEBUG's fingerprint exchange runs before every call; results must not change.
    # The real check runs, counted, so the test fails if SMDDP_DEBUG stopped checking.
    dist.destroy_process_group()
    monkeypatch.setenv("SMDDP_DEBUG", "1")
    checked = []
    real_check = DebugComparison.check

    def counted(self, seq, op_name, *args, **kwargs):
        checked.append(op_name)
        return real_check(self, seq, op_name, *args, **kwargs)

    monkeypatch.setattr(DebugComparison, "check", counted)
    dist.init_process_group()
    total = 0
    for name in props.PROPERTIES:
        before = len(checked)
        ran = props.run(name, 60, 0, 1)
        assert ran >= (12 if name == "barrier" else 30), (name, ran)
        assert len(checked) > before, f"SMDDP_DEBUG=1 checked none of {ran} {name} cases"
        total += ran
    print(f"hypothesis: {total} cases in a world of one with SMDDP_DEBUG=1, {len(checked)} checked")


@pytest.mark.mpi
def test_under_mpirun():
    start = time.monotonic()
    result = mpirun(2, ["tests/ranks/api_properties.py", str(MPI_EXAMPLES)], timeout=150,
                    env={"SMDDP_TIMEOUT": "30"}).check()
    done = rank_lines(result.stdout, "PROPERTIES_OK")
    assert sorted(done) == [0, 1], result.output
    assert done[0] == done[1]
    print(f"hypothesis: {done[0]} cases on each of 2 ranks under mpirun, {time.monotonic() - start:.1f} s")
