"""What every process smddp starts finds in its environment, checked on every rank of real jobs.

Each job runs ``tests/ranks/runtime_env.py``, which reports the variables SageMaker's runner
gives a process and then initializes ``torch.distributed`` through ``env://`` on them alone.
"""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import pytest

from launchers import _TAG, MPIRUN, RANKS, free_port, mpirun, rank_lines, run, torchrun

PROBE = str(RANKS / "runtime_env.py")
SMDDPRUN = [sys.executable, "-m", "smddp.launch"]
ALIAS = ["-m", "smddp.alias", PROBE, "--init"]


def reports(result, size: int) -> dict:
    result.check()
    found = {rank: json.loads(rest) for rank, rest in rank_lines(result.stdout, "RUNTIME").items()}
    assert sorted(found) == list(range(size)), result.output
    return found


def assert_sagemaker_runtime(found: dict, size: int, local_size: int, instance_type=None) -> None:
    """Every rank: its own RANK, the same WORLD_SIZE, one MASTER_ADDR:MASTER_PORT, env:// worked."""
    assert {r["MASTER_ADDR"] for r in found.values()} == {"127.0.0.1"}
    ports = {r["MASTER_PORT"] for r in found.values()}
    assert len(ports) == 1 and int(ports.pop()) > 0
    assert sorted(int(r["LOCAL_RANK"]) for r in found.values()) == list(range(local_size))
    for rank, r in found.items():
        assert (r["RANK"], r["WORLD_SIZE"], r["LOCAL_WORLD_SIZE"]) == (str(rank), str(size), str(local_size))
        assert r["SMDATAPARALLEL_LOCAL_RANK"] == r["LOCAL_RANK"]
        assert r["SAGEMAKER_INSTANCE_TYPE"] == instance_type
        assert (r["torch_rank"], r["torch_size"]) == (rank, size)
        assert r["sum"] == size * (size + 1) / 2  # all_reduce of rank + 1 over the world


@pytest.mark.mpi
def test_smddprun_under_mpirun():
    result = run([*SMDDPRUN, "--launcher", "mpirun", "-np", "2", PROBE, "--init"], timeout=120,
                 env={"SM_CURRENT_INSTANCE_TYPE": "ml.p4d.24xlarge"})
    assert_sagemaker_runtime(reports(result, 2), 2, 2, "ml.p4d.24xlarge")


def test_smddprun_without_mpirun():
    # smddprun's default on one host: no mpirun.
    result = run([*SMDDPRUN, "-np", "2", PROBE, "--init"], timeout=120)
    assert_sagemaker_runtime(reports(result, 2), 2, 2)


@pytest.mark.mpi
@pytest.mark.parametrize("np", [2, 3])
def test_plain_mpirun_through_the_alias(np):
    """No smddprun: rank 0 picks MASTER_ADDR/MASTER_PORT and sends them over MPI."""
    assert_sagemaker_runtime(reports(mpirun(np, ALIAS, timeout=120), np), np, np)


def test_torchrun_through_the_alias():
    assert_sagemaker_runtime(reports(torchrun(2, ALIAS, timeout=120), 2), 2, 2)


# ------------------------------------------------------------------ every init method, every launcher

INIT = str(RANKS / "init_methods.py")
MODES = ["default", "env", "tcp", "tcp-explicit", "file", "store", "v1-then-torch", "torch-then-v1"]


def assert_every_init_method(result, size: int, modes=MODES) -> None:
    result.check()
    found = {}
    for line in result.stdout.splitlines():
        parts = _TAG.sub("", line).split(None, 3)
        if len(parts) == 4 and parts[0] == "INIT":
            found[(int(parts[1]), parts[2])] = json.loads(parts[3])
    assert sorted(found) == sorted((r, m) for r in range(size) for m in modes), result.output
    for (rank, mode), r in found.items():
        assert r["torch"] == [rank, size] and r["v1"] == [rank, size], (mode, r)
        assert r["initialized"] == [True, True] and r["backend"] == "smddp", (mode, r)
        assert r["torch_sum"] == r["v1_sum"] == size * (size + 1) / 2, (mode, r)
        assert r["bcast"] == size - 1, (mode, r)


def _init_args(tmp_path):
    return [INIT, str(free_port()), str(free_port()), str(tmp_path)]


@pytest.mark.mpi
@pytest.mark.parametrize("np", [2, 3])
def test_init_methods_under_plain_mpirun(tmp_path, np):
    assert_every_init_method(mpirun(np, _init_args(tmp_path), timeout=180), np)


@pytest.mark.mpi
def test_init_methods_under_smddprun(tmp_path):
    assert_every_init_method(run([*SMDDPRUN, "-np", "2", *_init_args(tmp_path)], timeout=180), 2)


@pytest.mark.parametrize("mode", MODES)
def test_init_methods_under_torchrun(tmp_path, mode):
    assert_every_init_method(torchrun(2, [*_init_args(tmp_path), mode], timeout=180), 2, [mode])


# ------------------------------------------------------------------ bad input

@pytest.mark.parametrize("launcher", [pytest.param("mpirun", marks=pytest.mark.mpi), "local"])
@pytest.mark.parametrize("env, named", [
    ({"RANK": "5"}, ["RANK=5", "RANK=0 to RANK=1"]),
    ({"WORLD_SIZE": "3"}, ["WORLD_SIZE=3", "WORLD_SIZE=2"]),
])
def test_smddprun_names_a_rank_that_contradicts_it(launcher, env, named):
    result = run([*SMDDPRUN, "--launcher", launcher, "-np", "2", PROBE], timeout=60, env=env)
    assert result.returncode == 2, result.output
    for value in named:
        assert value in result.stderr, result.output
    assert "RUNTIME" not in result.stdout  # nothing started


@pytest.mark.mpi
def test_mpirun_names_a_rank_that_contradicts_it():
    result = mpirun(2, ["-m", "smddp.alias", PROBE], timeout=60, mpi_args=["-x", "RANK=1"])
    assert result.returncode != 0, result.output
    # Rank 0 is told it is RANK=1; rank 1 agrees with the launcher and would run, but the job ends.
    assert ("RANK=1 (environment) contradicts the launcher (Open MPI's mpirun), which started this process as rank 0 "
            "of 2 (RANK=0)") in result.stderr, result.output


@pytest.fixture
def held_port():
    """A port something else is listening on."""
    with socket.socket() as sock:
        sock.bind(("", 0))
        sock.listen()
        yield sock.getsockname()[1]


@pytest.mark.parametrize("launcher", [pytest.param("mpirun", marks=pytest.mark.mpi), "local"])
def test_smddprun_names_a_master_port_in_use(launcher, held_port):
    result = run([*SMDDPRUN, "--launcher", launcher, "-np", "2", PROBE, "--init"], timeout=60,
                 env={"MASTER_PORT": str(held_port)})
    assert result.returncode == 2, result.output
    assert f"MASTER_PORT={held_port} (environment) is already in use on this host" in result.stderr, result.output
    assert "RUNTIME" not in result.stdout


@pytest.mark.mpi
def test_plain_mpirun_names_a_master_port_in_use(held_port):
    """No smddprun to check first: rank 0 checks before the script runs, and the whole job ends."""
    result = mpirun(2, ["-m", "smddp.alias", PROBE, "--init"], timeout=60,
                    env={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(held_port)},
                    mpi_args=["-x", "MASTER_ADDR", "-x", "MASTER_PORT"])
    assert result.returncode != 0, result.output
    assert f"MASTER_PORT={held_port} (environment) is already in use on this host" in result.stderr, result.output
    assert "RUNTIME 0" not in result.stdout


@pytest.mark.mpi
def test_sagemaker_job_processes(tmp_path):
    """What smddp's SageMaker driver runs on each host: ``mpirun ... -x MASTER_ADDR ... python -m mpi4py
    _smddp_entry.py``, from the code channel smddp.sagemaker stages (MASTER_ADDR stands in for algo-1)."""
    from smddp.sagemaker import _package

    code = tmp_path / "code"
    code.mkdir()
    entry = _package.stage_code(str(code), Path(PROBE), None)
    framework = {"sagemaker_distributed_dataparallel_enabled": True, "sagemaker_instance_type": "ml.p4d.24xlarge"}
    driver_env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
                  "SAGEMAKER_INSTANCE_TYPE": "ml.p4d.24xlarge", "SM_FRAMEWORK_PARAMS": json.dumps(framework)}
    exports = [w for name in driver_env for w in ("-x", name)]
    result = run([MPIRUN, "-np", "2", "--oversubscribe", *exports, sys.executable, "-m", "mpi4py", entry, "--init"],
                 timeout=120, env=driver_env, cwd=str(code))
    found = reports(result, 2)
    assert_sagemaker_runtime(found, 2, 2, "ml.p4d.24xlarge")
    assert {r["MASTER_PORT"] for r in found.values()} == {driver_env["MASTER_PORT"]}
