"""smddp's DistributedDataParallel under real launchers, and the main example.

``scripts/ddp_checks.py`` runs every DDP check in one job per world size (exact gradients
against single-process training, small buckets, different starting weights, ``no_sync``,
smddp's communication hook and a caller's own, issue order, ``join()`` with uneven inputs
(either divisor; smddp's DDP and torch's own on smddp's group),
``find_unused_parameters``, bfloat16, buffers, ``state_dict``, errors); each rank prints
``OK <rank> <check>``, and ``HOOK <rank> <plane> on|off``: whether smddp's hook reduced the
gradients (the shared-memory plane) or torch's path did (any other plane).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from launchers import RANKS, ROOT, mpirun, python, torchrun

CHECKS = {
    "before_init", "api", "errors", "exact", "exact_small_buckets_different_start", "exact_passthrough",
    "no_sync", "hook", "order", "join", "join_torch_ddp", "unused", "bfloat16", "buffers_broadcast", "buffers_local",
    "state_dict",
}
EXAMPLE = str(ROOT / "examples" / "train.py")


def passed_checks(output: str) -> dict:
    found: dict = {}
    for rank, name in re.findall(r"OK (\d+) ([a-z_0-9]+)", output):
        found.setdefault(int(rank), set()).add(name)
    return found


def assert_all_checks(result, np: int, backend: str, hook: str = "shm on") -> None:
    result.check()
    found = passed_checks(result.stdout)
    for rank in range(np):
        missing = CHECKS - found.get(rank, set())
        assert not missing, f"rank {rank} did not pass {sorted(missing)}\n{result.output}"
    done = {int(r): b for r, b in re.findall(r"DONE (\d+) ([a-z]+)", result.stdout)}
    assert done == {r: backend for r in range(np)}, result.output
    hooks = dict(re.findall(r"HOOK (\d+) ([a-z]+ [a-z]+)", result.stdout))
    assert hooks == {str(r): hook for r in range(np)}, result.output


@pytest.mark.mpi
@pytest.mark.parametrize("np", [2, 3])
def test_ddp_mpirun(np):
    assert_all_checks(mpirun(np, [str(RANKS / "ddp_checks.py")], timeout=240), np, "mpi")


@pytest.mark.mpi
def test_ddp_mpirun_mpi_plane_keeps_torchs_path():
    """Off the shared-memory plane smddp installs no hook: torch's path, the same checks."""
    result = mpirun(2, [str(RANKS / "ddp_checks.py")], timeout=240, env={"SMDDP_CPU_PLANE": "mpi"})
    assert_all_checks(result, 2, "mpi", hook="mpi off")


def test_ddp_torchrun_gloo():
    assert_all_checks(torchrun(2, [str(RANKS / "ddp_checks.py")], timeout=240), 2, "gloo")


def test_join_dividing_by_active_ranks_refused_without_python_callback_work():
    """Where torch lacks PythonCallbackWork, join(divide_by_initial_world_size=False) raises
    before anything is sent instead of hanging in backward (a world of one, torch's class hidden)."""
    code = (
        "import torch\n"
        "import smddp.torch.distributed as dist\n"
        "from smddp.torch.parallel import distributed as ddp_module\n"
        "dist.init_process_group()\n"
        "model = ddp_module.DistributedDataParallel(torch.nn.Linear(2, 2))\n"
        "with model.join(divide_by_initial_world_size=False):\n"
        "    model(torch.ones(1, 2)).sum().backward()\n"
        "print('ALLOWED')\n"
        "ddp_module.DETACHABLE = False\n"
        "try:\n"
        "    model.join(divide_by_initial_world_size=False)\n"
        "except ValueError as exc:\n"
        "    print('REFUSED', exc)\n"
        "with model.join():\n"
        "    model(torch.ones(1, 2)).sum().backward()\n"
        "print('DEFAULT ALLOWED')\n"
    )
    result = python(["-c", code], timeout=120).check()
    assert "ALLOWED" in result.stdout and "DEFAULT ALLOWED" in result.stdout, result.output
    assert "REFUSED join(divide_by_initial_world_size=False) needs torch's PythonCallbackWork" in result.stdout, \
        result.output


# --------------------------------------------------------------------------- the example
# Ranks share one stdout and print() writes a line's newline separately: match the records
# wherever they are, not line by line.
def epoch_losses(output: str) -> list:
    return [float(x) for x in re.findall(r"EPOCH \d+ loss (\d+\.\d{6})", output)]


def final_weights(output: str) -> dict:
    return {int(r): h for r, h in re.findall(r"WEIGHTS (\d+) ([0-9a-f]{64})", output)}


def assert_trained(result, np: int, epochs: int, model_dir: Path) -> None:
    result.check()
    losses = epoch_losses(result.stdout)
    assert len(losses) == epochs, result.output  # printed by rank 0 only
    assert losses[-1] < 0.5 * losses[0], f"the loss did not fall: {losses}"
    weights = final_weights(result.stdout)
    assert sorted(weights) == list(range(np)), result.output
    assert len(set(weights.values())) == 1, f"ranks ended with different weights: {weights}"
    assert f"Every rank holds the same weights ({np} of {np})" in result.stdout, result.output
    assert result.stdout.count("Saved ") == 1, result.output  # rank 0 alone saves
    state = torch.load(model_dir / "model.pt", weights_only=True)
    assert "fc2.weight" in state, list(state)


@pytest.mark.mpi
def test_example_mpirun(tmp_path):
    result = mpirun(2, [EXAMPLE, "--epochs", "3", "--model-dir", str(tmp_path)], timeout=180)
    assert_trained(result, 2, 3, tmp_path)
    assert "backend mpi" in result.stdout


def test_example_torchrun_gloo(tmp_path):
    result = torchrun(2, [EXAMPLE, "--epochs", "3", "--model-dir", str(tmp_path)], timeout=180)
    assert_trained(result, 2, 3, tmp_path)
    assert "backend gloo" in result.stdout


def test_example_single_process_with_data_dir(tmp_path):
    """A plain ``python train.py`` on a SageMaker-style channel holding ``train.pt``."""
    gen = torch.Generator().manual_seed(5)
    labels = torch.randint(0, 10, (600,), generator=gen)
    patterns = torch.randn(10, 1, 28, 28, generator=gen)
    images = patterns[labels] + torch.randn(600, 1, 28, 28, generator=gen)
    data_dir = tmp_path / "training"
    data_dir.mkdir()
    torch.save({"images": images, "labels": labels}, data_dir / "train.pt")
    model_dir = tmp_path / "model"
    result = python([EXAMPLE, "--epochs", "3", "--model-dir", str(model_dir)], timeout=120,
                    env={"SM_CHANNEL_TRAINING": str(data_dir)})
    assert_trained(result, 1, 3, model_dir)
    assert "1 process(es), backend local" in result.stdout and "600 images" in result.stdout, result.stdout
