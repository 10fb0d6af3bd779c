"""CUDA: the ``nccl`` backend (NCCL through CuPy) and ``torch-nccl``, on a real GPU.

Every test carries the ``gpu`` marker: on a machine without CUDA, conftest skips it and
says why. On a GPU machine (README, "On a machine without internet")::

    pip install --no-index --no-deps --no-build-isolation -e .    # or: pip install -e '.[dev,cuda13]'
    pytest -m gpu

``pytest -m gpu`` also runs tests/torch/test_fsdp.py's FSDP1 and FSDP2 (``fully_shard``) on CUDA
(a world of one on a one-GPU machine); torch's DDP on smddp's world of one is
:func:`test_ddp_training_on_cuda` here; ``python benchmarks/gpu_allreduce.py`` measures the
``nccl`` backend beside torch's NCCL group.

Each test runs tests/ranks/gpu_worker.py in a fresh process (``python tests/ranks/gpu_worker.py
CHECK BACKEND``) under plain ``python`` and ``mpirun -np 1`` (and ``-np <GPUs>`` where a
machine has several). Workers build every rank's inputs from seeds, so each knows the exact
answer without communicating, print ``CHECK <rank> <name>`` per passed check and
``PASSED <rank> <count>`` at the end, and save their results so a test can compare the
``nccl`` backend with torch's own NCCL group.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from launchers import RANKS

pytestmark = pytest.mark.gpu

WORKER = RANKS / "gpu_worker.py"


# ============================================================================ the tests
def _cupy_or_skip() -> None:
    try:
        import cupy  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means the backend cannot run
        pytest.skip(f"CuPy is not importable ({exc}): pip install 'smddp[cuda12]' ('smddp[cuda13]' on CUDA 13)")


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _run(check: str, backend: str, tmp_path: Path, launcher: str = "python", np: int = 1, env=None):
    from launchers import mpirun, python, rank_lines

    env = {"SMDDP_GPU_OUT": str(tmp_path), **(env or {})}
    args = [str(WORKER), check, backend]
    if launcher == "mpirun":
        if not _has_mpi():
            pytest.skip("mpirun or mpi4py not installed: pip install 'smddp[mpi]'")
        result = mpirun(np, args, timeout=600, env=env)
    else:
        result = python(args, timeout=600, env=env)
    result.check()
    passed = rank_lines(result.stdout, "PASSED")
    assert sorted(passed) == list(range(np)), result.output
    return result


def _has_mpi() -> bool:
    import shutil

    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return False
    return shutil.which("mpirun") is not None


def _load(tmp_path: Path, backend: str, check: str, rank: int = 0) -> dict:
    return torch.load(tmp_path / f"{check}-{backend}-rank{rank}.pt", map_location="cpu")


def _assert_same(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), what
    for key in a:
        x, y = a[key], b[key]
        if x.is_complex():
            x, y = torch.view_as_real(x), torch.view_as_real(y)
        if x.dtype.is_floating_point:
            tol = 2e-2 if x.dtype in (torch.float16, torch.bfloat16) else 1e-6
            torch.testing.assert_close(x.double(), y.double(), rtol=tol, atol=tol, msg=f"{what}: {key}")
        else:
            assert torch.equal(x, y), f"{what}: {key}"


@pytest.mark.parametrize("launcher", ["python", "mpirun"])
def test_nccl_every_collective_and_op(launcher, tmp_path):
    _cupy_or_skip()
    result = _run("collectives", "nccl", tmp_path, launcher)
    assert "CHECK 0 backend/nccl" in result.stdout


def test_nccl_side_stream_every_collective(tmp_path):
    _cupy_or_skip()
    _run("collectives", "nccl", tmp_path, env={"SMDDP_NCCL_STREAM": "side"})


@pytest.mark.parametrize("launcher", ["python", "mpirun"])
def test_torch_nccl_every_collective_and_op(launcher, tmp_path):
    _run("collectives", "torch-nccl", tmp_path, launcher)


def test_nccl_gives_the_results_of_torchs_nccl_group(tmp_path):
    _cupy_or_skip()
    _run("collectives", "nccl", tmp_path)
    _run("collectives", "torch-nccl", tmp_path)
    _assert_same(_load(tmp_path, "nccl", "collectives"), _load(tmp_path, "torch-nccl", "collectives"),
                 "nccl vs torch-nccl")


@pytest.mark.parametrize("mode", ["current", "side"])
def test_stream_ordering_without_host_sync(mode, tmp_path):
    _cupy_or_skip()
    result = _run("streams", "nccl", tmp_path, env={"SMDDP_NCCL_STREAM": mode})
    assert "CHECK 0 streams/before" in result.stdout and "CHECK 0 streams/other_stream" in result.stdout


def test_torch_nccl_stream_ordering(tmp_path):
    _run("streams", "torch-nccl", tmp_path)


@pytest.mark.parametrize("launcher", ["python", "mpirun"])
def test_ddp_training_on_cuda(launcher, tmp_path):
    _cupy_or_skip()
    _run("ddp", "nccl", tmp_path, launcher)


def test_ddp_same_weights_as_torchs_nccl_group(tmp_path):
    _cupy_or_skip()
    _run("ddp", "nccl", tmp_path)
    _run("ddp", "torch-nccl", tmp_path)
    _assert_same(_load(tmp_path, "nccl", "ddp"), _load(tmp_path, "torch-nccl", "ddp"), "DDP weights")


def test_every_gpu_of_the_machine(tmp_path):
    """One rank per GPU under mpirun: real communication between devices."""
    _cupy_or_skip()
    if _gpus() < 2:
        pytest.skip(f"needs 2 or more GPUs, this machine has {_gpus()}")
    _run("collectives", "nccl", tmp_path, "mpirun", np=_gpus())
    _run("collectives", "torch-nccl", tmp_path, "mpirun", np=_gpus())
    for r in range(_gpus()):
        _assert_same(_load(tmp_path, "nccl", "collectives", r), _load(tmp_path, "torch-nccl", "collectives", r),
                     f"rank {r}: nccl vs torch-nccl")
    _run("ddp", "nccl", tmp_path, "mpirun", np=_gpus())
    _run("streams", "nccl", tmp_path, "mpirun", np=_gpus())
    _run("hooks", "nccl", tmp_path, "mpirun", np=_gpus())  # SyncBatchNorm's statistics cross devices here


def test_nccl_deadline_does_not_fire_on_operations_that_complete(tmp_path):
    """Operations that finish (one behind a 0.5 s kernel) do not expire, even long after their deadline."""
    _cupy_or_skip()
    result = _run("deadlines", "nccl", tmp_path, env={"SMDDP_TIMEOUT": "2"})
    assert "CHECK 0 deadlines/not_expired" in result.stdout and "CHECK 0 deadlines/closed" in result.stdout


def test_nccl_deadline_with_clean_up_only_aborts_and_the_next_call_raises(tmp_path):
    """SMDDP_NCCL_ASYNC_ERROR_HANDLING=2: a collective queued behind a 6 s kernel misses its 1 s
    deadline; the watchdog aborts NCCL while the host does not wait, the next call raises
    CollectiveTimeout, and teardown returns: the script, which handled the error and destroyed
    its group, exits 0 (torch's CleanUpOnly leaves the process to the script as well)."""
    from launchers import python

    _cupy_or_skip()
    result = python([str(WORKER), "stall", "nccl"], timeout=120,
                    env={"SMDDP_TIMEOUT": "1", "SMDDP_NCCL_ASYNC_ERROR_HANDLING": "2"})
    assert result.returncode == 0, result.output
    for check in ("stall/host_did_not_wait", "stall/expired", "stall/next_call_raises", "stall/destroyed"):
        assert f"CHECK 0 {check}" in result.stdout, result.output


def test_nccl_deadline_by_default_ends_the_process(tmp_path):
    """torch's default (3): the watchdog reports the timeout and ends the process."""
    from launchers import python

    _cupy_or_skip()
    result = python([str(WORKER), "stall", "nccl"], timeout=120,
                    env={"SMDDP_TIMEOUT": "1", "SMDDP_NCCL_ASYNC_ERROR_HANDLING": ""})
    assert result.returncode == 1 and "STILL RUNNING" not in result.stdout, result.output
    assert "CHECK 0 stall/host_did_not_wait" in result.stdout, result.output
    assert "ending this process (SMDDP_NCCL_ASYNC_ERROR_HANDLING=3" in result.stderr, result.output


@pytest.mark.parametrize("backend", ["nccl", "torch-nccl"])
def test_device_id_is_the_groups_device(backend, tmp_path):
    """init_process_group(device_id=...) without set_device (on several GPUs: not the local rank)."""
    if backend == "nccl":
        _cupy_or_skip()
    result = _run("device", backend, tmp_path)
    assert "CHECK 0 device/device_id" in result.stdout, result.output


def test_bool_complex_and_a_ddp_bool_buffer_as_torchs_nccl_group(tmp_path):
    _cupy_or_skip()
    _run("dtypes", "nccl", tmp_path)
    _run("dtypes", "torch-nccl", tmp_path)
    _assert_same(_load(tmp_path, "nccl", "dtypes"), _load(tmp_path, "torch-nccl", "dtypes"), "nccl vs torch-nccl")


@pytest.mark.parametrize("backend", ["nccl", "torch-nccl"])
def test_the_host_never_waits_for_an_all_reduce_or_a_ddp_backward(backend, tmp_path):
    """Behind a 1 s kernel, ``all_reduce(async_op=True).wait()`` and DDP's ``backward()`` return
    at once (torch's NCCL group is the reference); the results are right once the GPU ran them."""
    if backend == "nccl":
        _cupy_or_skip()
    result = _run("host_free", backend, tmp_path)
    assert "CHECK 0 host_free/ddp_backward" in result.stdout, result.output


@pytest.mark.parametrize("backend", ["nccl", "torch-nccl"])
def test_all_reduces_captured_in_a_cuda_graph_replay_right(backend, tmp_path):
    if backend == "nccl":
        _cupy_or_skip()
    result = _run("graph", backend, tmp_path)
    assert "CHECK 0 graph/replays" in result.stdout, result.output


def test_nccl_explicit_request_without_cupy_names_the_extra(tmp_path):
    """With CuPy hidden, backend='nccl' fails naming the extra; auto falls back to torch-nccl."""
    result = _run("no_cupy", "nccl", tmp_path)
    assert "CHECK 0 no_cupy/fallback" in result.stdout


def test_torchs_compression_hooks_and_syncbatchnorm_as_on_torchs_nccl_group(tmp_path):
    """DDP with torch's fp16 and bf16 compression hooks, and SyncBatchNorm, train on smddp's
    ``nccl`` to what torch's NCCL group trains them to."""
    _cupy_or_skip()
    for backend in ("nccl", "torch-nccl"):
        result = _run("hooks", backend, tmp_path)
        assert all(f"CHECK 0 hooks/{name}" in result.stdout for name in ("fp16", "bf16", "syncbn")), result.output
    _assert_same(_load(tmp_path, "nccl", "hooks"), _load(tmp_path, "torch-nccl", "hooks"), "nccl vs torch-nccl")
