"""FSDP on smddp's world, and every ``torch.distributed`` collective on the smddp group.

The multi-process tests run ``tests/ranks/fsdp_checks.py`` under real launchers; each rank
checks its results against expectations it computes locally (see the script). The in-process
tests cover what needs no peers: the local reduction, joined handles, and errors raised
before any communication.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as tdist

import smddp
import smddp.torch.distributed as dist
from smddp.comm.algorithms import derived
from smddp.comm.reduction import BITWISE, Op

from launchers import assert_all_ranks_passed, mpirun, python, rank_lines

SCRIPT = "tests/ranks/fsdp_checks.py"
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK",
                 "SLURM_PROCID", "SM_HOSTS", "SMDDP_BACKEND", "MASTER_ADDR", "MASTER_PORT")


# ============================================================================ launched jobs
@pytest.mark.mpi
@pytest.mark.parametrize("np", [2, 3])
def test_fsdp_and_collectives_under_mpirun(np, tmp_path):
    """fully_shard equals whole-batch training; checkpoints load; every collective is right."""
    result = mpirun(np, [SCRIPT, "collectives", "train", str(tmp_path)], timeout=240)
    assert_all_ranks_passed(result, np, at_least=60)
    for name in ("fully_shard per layer and root equals whole-batch training",
                 "fully_shard root only equals whole-batch training",
                 "torch.compile over fully_shard equals whole-batch training",
                 "sharded checkpoint saves and loads (torch.distributed.checkpoint)",
                 "full checkpoint saves on rank 0 and loads by broadcast",
                 "recv from any source", "functional all_gather_tensor"):
        assert f"CHECK 0 {name}" in result.stdout, result.output


@pytest.mark.mpi
def test_collectives_on_the_gloo_backend():
    """SMDDP_BACKEND=gloo: the same checks, point-to-point through gloo."""
    result = mpirun(2, [SCRIPT, "collectives"], timeout=240, env={"SMDDP_BACKEND": "gloo"})
    assert_all_ranks_passed(result, 2, at_least=55)


def test_world_of_one(tmp_path):
    """A plain ``python``: FSDP2 and every collective on a world of one (no MPI, no ports)."""
    result = python([SCRIPT, "collectives", "train", str(tmp_path)], timeout=240)
    assert_all_ranks_passed(result, 1, at_least=55)


@pytest.mark.mpi
def test_example_runs(tmp_path):
    path = tmp_path / "mnist_cnn.pt"
    args = ["--epochs", "1", "--train-samples", "256", "--test-samples", "128",
            "--save-model", "--save-path", str(path)]
    result = mpirun(2, ["examples/fsdp_train.py", *args], timeout=240).check()
    assert "Train Epoch: 1" in result.stdout and "Test set: Average loss" in result.stdout, result.output
    assert "FSDPNet(" in result.stdout, result.output
    state = torch.load(path, weights_only=True)
    assert state["fc1.weight"].shape == (32, 8 * 12 * 12)  # full, unsharded weights


@pytest.mark.gpu
def test_fsdp1_and_fsdp2_on_cuda(tmp_path):
    """FSDP1 (GPU only) and fully_shard on CUDA, one rank per visible GPU."""
    gpus = torch.cuda.device_count()
    args = [SCRIPT, "cuda"]
    result = mpirun(gpus, args, timeout=600) if gpus > 1 else python(args, timeout=600)
    assert_all_ranks_passed(result, max(gpus, 1), at_least=2)
    assert "CHECK 0 FSDP1 on CUDA equals whole-batch training" in result.stdout, result.output


# ============================================================================ in-process
@pytest.fixture
def world_of_one(monkeypatch):
    for name in LAUNCHER_VARS:
        monkeypatch.delenv(name, raising=False)
    dist.init_process_group()
    yield tdist.distributed_c10d._get_default_group()
    dist.destroy_process_group()


@pytest.mark.unit
@pytest.mark.parametrize("op,dtype", [(op, dtype) for op in Op for dtype in (torch.float32, torch.bfloat16, torch.int64)
                                      if op not in BITWISE or not dtype.is_floating_point])
def test_reduce_rows(op, dtype):
    g = torch.Generator().manual_seed(3)
    rows = torch.randint(1, 5, (3, 6), generator=g).to(dtype)
    out = torch.empty(2, 3, dtype=dtype)
    derived.reduce_rows(rows, op, out)
    if op in BITWISE:
        fold = {Op.BAND: torch.bitwise_and, Op.BOR: torch.bitwise_or, Op.BXOR: torch.bitwise_xor}[op]
        assert torch.equal(out, fold(fold(rows[0], rows[1]), rows[2]).view(2, 3))
        return
    wide = rows.double()
    want = {Op.SUM: wide.sum(0), Op.AVERAGE: wide.sum(0) / 3, Op.MIN: wide.min(0).values,
            Op.MAX: wide.max(0).values, Op.PRODUCT: wide.prod(0)}[op]
    if op is Op.AVERAGE and not dtype.is_floating_point:
        want = torch.div(wide.sum(0), 3, rounding_mode="trunc")
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), want.to(dtype).double().view(2, 3))


@pytest.mark.unit
@pytest.mark.parametrize("op", [op for op in Op if op is not Op.AVERAGE])
def test_reduce_rows_of_bools_is_logic(op):
    """bool rows fold as torch's bool arithmetic does: SUM and MAX an or, PRODUCT and MIN an and."""
    rows = torch.tensor([[True, True, False, False], [True, False, True, False], [True, False, False, False]])
    out = torch.empty(4, dtype=torch.bool)
    derived.reduce_rows(rows, op, out)
    any_, all_ = rows.any(0), rows.all(0)
    want = {Op.SUM: any_, Op.MAX: any_, Op.BOR: any_, Op.PRODUCT: all_, Op.MIN: all_, Op.BAND: all_,
            Op.BXOR: rows[0] ^ rows[1] ^ rows[2]}[op]
    assert torch.equal(out, want) and out.view(torch.uint8).max() <= 1


@pytest.mark.unit
def test_native_backend_and_name(world_of_one):
    pg = world_of_one
    assert isinstance(pg._get_backend(torch.device("cpu")), tdist.ProcessGroupGloo)
    assert "cpu" in pg.native_backends
    assert pg.group_name and pg.group_name == tdist.distributed_c10d._get_process_group_name(pg)


@pytest.mark.unit
def test_every_collective_on_a_world_of_one(world_of_one):
    t = torch.arange(4.0)
    out = torch.empty(4)
    tdist.reduce_scatter_tensor(out, t.clone(), op=tdist.ReduceOp.AVG)
    assert torch.equal(out, t)
    gathered = [torch.empty(4)]
    tdist.gather(t, gathered, dst=0)
    assert torch.equal(gathered[0], t)
    tdist.scatter(out, [t * 2], src=0)
    assert torch.equal(out, t * 2)
    outs = [torch.empty(4)]
    tdist.all_to_all(outs, [t * 3])
    assert torch.equal(outs[0], t * 3)


ERRORS = [
    ("reduce_scatter_tensor size", smddp.InvalidArgumentError,
     lambda: tdist.reduce_scatter_tensor(torch.empty(2), torch.empty(3))),
    ("reduce_scatter list length", smddp.InvalidArgumentError,
     lambda: tdist.reduce_scatter(torch.empty(2), [torch.empty(2), torch.empty(2)])),
    ("PREMUL_SUM", smddp.InvalidArgumentError,
     lambda: tdist.reduce_scatter_tensor(torch.empty(2), torch.empty(2), op=tdist._make_nccl_premul_sum(0.5))),
    ("gather list length", smddp.InvalidArgumentError,
     lambda: tdist.gather(torch.empty(2), [torch.empty(2), torch.empty(2)], dst=0)),
    ("gather element count", smddp.InvalidArgumentError,
     lambda: tdist.gather(torch.empty(2), [torch.empty(3)], dst=0)),
    ("scatter element count", smddp.InvalidArgumentError,
     lambda: tdist.scatter(torch.empty(2), [torch.empty(5)], src=0)),
    ("all_to_all list length", smddp.InvalidArgumentError,
     lambda: tdist.all_to_all([torch.empty(2)] * 2, [torch.empty(2)] * 2)),
    ("mixed dtypes", smddp.InvalidTypeError,
     lambda: tdist.reduce_scatter_tensor(torch.empty(2), torch.empty(2, dtype=torch.float64))),
]


@pytest.mark.unit
@pytest.mark.parametrize("name,error,call", ERRORS, ids=[e[0] for e in ERRORS])
def test_errors_before_communication(world_of_one, name, error, call):
    with pytest.raises(error):
        call()
    tdist.all_reduce(torch.ones(1))  # the job is not broken by an argument error


@pytest.mark.unit
def test_point_to_point_needs_a_peer(world_of_one):
    from smddp.torch import groups

    engine = groups.current().engine
    with pytest.raises(smddp.InvalidArgumentError, match="this rank"):
        derived.send(engine, torch.ones(2), 0, 0)
    with pytest.raises(smddp.InvalidArgumentError, match="tag"):
        derived.recv(engine, torch.ones(2), None, -1)


@pytest.mark.unit
def test_joined_completes_once_all_do(world_of_one):
    from smddp.torch import groups

    engine = groups.current().engine
    tensors = [torch.ones(2), torch.ones(3)]
    joined = derived.each(engine, lambda t: engine.all_reduce(t, Op.SUM, async_op=True), tensors)
    seen = []
    joined.add_done_callback(seen.append)
    joined.wait()
    assert joined.is_completed() and joined.exception() is None and seen == [joined]
    with pytest.raises(smddp.InvalidArgumentError, match="different lengths"):
        derived.each(engine, lambda a, b: None, [1, 2], [1])
    # No tensors at all: a handle that is done at once.
    assert derived.each(engine, lambda t: None, []).wait()


@pytest.mark.mpi
def test_joined_waits_for_handles_still_running(tmp_path):
    # Rank 1 joins each all_reduce only when rank 0 says so: rank 0's handle of both must stay
    # incomplete, its callback unrun, until the last of its handles completes.
    res = mpirun(2, ["tests/ranks/joined_pending.py", str(tmp_path)], timeout=120).check()
    assert sorted(rank_lines(res.stdout, "JOINED_OK")) == [0, 1], res.output
