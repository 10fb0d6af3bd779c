"""The API's contract outside a multi-process job: errors before init, a world of one, v2 style."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch

import smddp
import smddp.torch.distributed as dist
from smddp import comm

from launchers import mpirun, python, rank_lines

LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK",
                 "SLURM_PROCID", "SM_HOSTS", "SMDDP_BACKEND", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def clean_env(monkeypatch):
    for name in LAUNCHER_VARS:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def world_of_one(clean_env):
    dist.init_process_group()
    yield
    dist.destroy_process_group()


CALLS_BEFORE_INIT = [
    ("get_rank", lambda: dist.get_rank()),
    ("get_world_size", lambda: dist.get_world_size()),
    ("get_local_rank", lambda: dist.get_local_rank()),
    ("get_local_size", lambda: dist.get_local_size()),
    ("get_backend", lambda: dist.get_backend()),
    ("all_reduce", lambda: dist.all_reduce(torch.ones(2))),
    ("broadcast", lambda: dist.broadcast(torch.ones(2), 0)),
    ("all_gather", lambda: dist.all_gather([torch.ones(2)], torch.ones(2))),
    ("all_to_all_single", lambda: dist.all_to_all_single(torch.ones(2), torch.ones(2))),
    ("barrier", lambda: dist.barrier()),
]


@pytest.mark.unit
@pytest.mark.parametrize("name,call", CALLS_BEFORE_INIT, ids=[c[0] for c in CALLS_BEFORE_INIT])
def test_before_init(clean_env, name, call):
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group") as info:
        call()
    assert isinstance(info.value, smddp.NotInitializedError)


@pytest.mark.unit
def test_ddp_before_init(clean_env):
    from smddp.torch.parallel import DistributedDataParallel

    with pytest.raises(smddp.NotInitializedError, match="init_process_group"):
        DistributedDataParallel(torch.nn.Linear(2, 2))


def test_world_of_one_in_a_fresh_process():
    result = python(["tests/ranks/world_of_one.py"]).check()
    assert "WORLD_OF_ONE_OK" in result.stdout


@pytest.mark.unit
def test_world_of_one_collectives(world_of_one):
    assert dist.is_initialized() and dist.get_backend() == "local"
    for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVERAGE, dist.ReduceOp.MIN, dist.ReduceOp.MAX):
        t = torch.arange(5, dtype=torch.int32)
        dist.all_reduce(t, op=op)
        assert torch.equal(t, torch.arange(5, dtype=torch.int32))
    out = [torch.empty(2, 2)]
    dist.all_gather(out, torch.eye(2))
    assert torch.equal(out[0], torch.eye(2))
    out = torch.empty(3)
    dist.all_to_all_single(out, torch.tensor([1.0, 2.0, 3.0]), [3], [3])
    assert out.tolist() == [1.0, 2.0, 3.0]
    handle = dist.broadcast(torch.ones(1), 0, async_op=True)
    assert handle.wait() and handle.is_completed()
    with pytest.raises(ValueError, match="src"):
        dist.broadcast(torch.ones(1), src=1)
    dist.init_process_group()  # a second call is a no-op
    assert dist.get_world_size() == 1


@pytest.mark.unit
def test_unknown_backend(clean_env):
    with pytest.raises(smddp.BackendUnavailableError, match="valid backends: .*gloo.*mpi") as info:
        dist.init_process_group(backend="carrier-pigeon")
    assert isinstance(info.value, RuntimeError)
    assert not dist.is_initialized()


@pytest.mark.unit
def test_missing_library_names_the_extra(monkeypatch):
    monkeypatch.setitem(comm.BACKENDS, "fake", comm.BackendInfo(
        "fake", "smddp_no_such_module:Comm", "cpu", "pip install 'smddp[fake]'", "test"))
    with pytest.raises(smddp.BackendUnavailableError, match=r"pip install 'smddp\[fake\]'"):
        comm.backend_class("fake")


@pytest.mark.unit
def test_bad_init_arguments(clean_env):
    with pytest.raises(TypeError, match="timedelta"):
        dist.init_process_group(timeout=30)
    with pytest.raises(TypeError, match="unexpected"):
        dist.init_process_group(bakend="mpi")
    assert not dist.is_initialized()


@pytest.mark.unit
def test_timeout_and_explicit_backend(clean_env):
    dist.init_process_group("local", timeout=timedelta(seconds=7))
    try:
        from smddp.torch import groups

        assert groups.current().engine.timeout == 7
    finally:
        dist.destroy_process_group()


@pytest.mark.unit
def test_a_repeated_init_asks_for_the_running_group_or_raises(clean_env):
    """Again with no arguments or the group's own: nothing changes. Anything else raises, naming
    it (tests/ranks/collectives.py checks the same on every rank of real jobs)."""
    from smddp.torch import groups

    store = torch.distributed.HashStore()
    dist.init_process_group("local", timeout=timedelta(seconds=7), store=store, rank=0, world_size=1)
    try:
        engine = groups.current().engine
        dist.init_process_group()
        dist.init_process_group("local", timeout=timedelta(seconds=7), store=store, rank=0, world_size=1)
        for asked, named in [({"timeout": timedelta(seconds=3)}, "timeout=0:00:03 (the group's: 0:00:07)"),
                             ({"backend": "gloo"}, "backend='gloo' (the group's: 'local')"),
                             ({"store": torch.distributed.HashStore()}, "store="),
                             ({"group_name": "other"}, "group_name='other' (the group's: none)")]:
            with pytest.raises(smddp.InvalidArgumentError, match="destroy_process_group") as info:
                dist.init_process_group(**asked)
            assert named in str(info.value)
        assert groups.current().engine is engine and engine.timeout == 7
    finally:
        dist.destroy_process_group()
    from smddp.torch import torch_smddp  # noqa: F401 - the v2 style: torch's init makes the group
    torch.distributed.init_process_group("smddp", store=torch.distributed.HashStore(), rank=0, world_size=1)
    try:
        dist.init_process_group()
        with pytest.raises(smddp.InvalidArgumentError, match="made by torch.distributed.init_process_group"):
            dist.init_process_group(init_method="env://")
    finally:
        dist.destroy_process_group()


@pytest.mark.unit
def test_error_hierarchy():
    assert issubclass(smddp.CollectiveTimeout, TimeoutError)
    assert issubclass(smddp.InvalidGroupError, ValueError)
    assert issubclass(smddp.InvalidTypeError, TypeError)
    for name in smddp.errors.__all__:
        assert issubclass(getattr(smddp, name), smddp.SMDDPError)


@pytest.mark.mpi
def test_v2_style_under_plain_mpirun():
    result = mpirun(2, ["tests/ranks/v2_style.py"], timeout=120).check()
    assert rank_lines(result.stdout, "V2_OK") == {0: "2", 1: "2"}


def test_v2_style_as_plain_python():
    """torch.distributed.init_process_group(backend="smddp") with no launcher: a world of one."""
    script = (
        "import torch, smddp.torch.torch_smddp, torch.distributed as d\n"
        "d.init_process_group(backend='smddp')\n"
        "t = torch.full((2,), 3.0); d.all_reduce(t)\n"
        "print('PLAIN_V2', d.get_rank(), d.get_world_size(), t.tolist())\n"
    )
    result = python(["-c", script]).check()
    assert "PLAIN_V2 0 1 [3.0, 3.0]" in result.stdout


@pytest.mark.mpi
@pytest.mark.parametrize("torch_kind", ["", "--old-torch"])
def test_destroy_closes_the_engine_and_init_may_follow(torch_kind):
    """Three init/destroy cycles in one process (torch's own test suite, notebooks, Trainer
    searches): each destroy closes smddp's engine, or the next init closes the one left open."""
    args = ["tests/ranks/reinit.py"] + ([torch_kind] if torch_kind else [])
    result = mpirun(2, args, timeout=120).check()
    assert set(rank_lines(result.stdout, "REINIT_OK")) == {0, 1}


@pytest.mark.unit
def test_torch_reduce_ops_map_to_smddp_ops():
    """Every form torch hands a ProcessGroup a reduction in: constants, ReduceOp objects, the
    options' field (torch's ReduceOp hashes to its code: smddp reads it that way where it can)."""
    from smddp.comm.reduction import Op
    from smddp.torch.process_group import torch_op

    R = torch.distributed.ReduceOp
    expected = {"SUM": Op.SUM, "AVG": Op.AVERAGE, "MIN": Op.MIN, "MAX": Op.MAX, "PRODUCT": Op.PRODUCT,
                "BAND": Op.BAND, "BOR": Op.BOR, "BXOR": Op.BXOR}
    for name, op in expected.items():
        options = torch.distributed.AllreduceOptions()
        options.reduceOp = getattr(R, name)
        assert torch_op(getattr(R, name)) is op
        assert torch_op(R(getattr(R, name))) is op
        assert torch_op(options.reduceOp) is op
    premul = torch.distributed._make_nccl_premul_sum(2.0)
    for refused, named in ((premul, "PREMUL_SUM"), (R.RedOpType.PREMUL_SUM, "PREMUL_SUM"), (3, "3"), (0, "0"),
                           (None, "None"), ("sum", "'sum'")):
        with pytest.raises(smddp.InvalidArgumentError, match=f"does not support ReduceOp {named};") as raised:
            torch_op(refused)
        assert "object at" not in str(raised.value)  # named, never by an object's repr
