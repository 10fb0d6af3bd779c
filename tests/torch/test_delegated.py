"""The delegated route: a group's device tensors handed to torch's own backend object, its Work returned as it is.

On GPUs (``torch-nccl``, the default on CUDA; ``xccl``) smddp's group gives device tensors to torch's
``ProcessGroupNCCL``/``ProcessGroupXCCL``. This machine has no GPU, so the same code runs here with
``SMDDP_BACKEND=torch-gloo``, which hands CPU tensors to torch's ``ProcessGroupGloo``: the launched
tests run ``tests/ranks/fsdp_checks.py`` on that route (every collective against values computed
from seeded per-rank inputs, FSDP2, torch.compile over it, DCP, smddp's v1 API and DDP class, a
subgroup, and no progress or completion thread of smddp's engine). The unit tests check what the
group hands torch's backend (the caller's own objects, the Work it returns) and how torch's NCCL
group is made (options, the split of a subgroup's communicator, smddp's knobs as torch's), with a
stand-in for ``ProcessGroupNCCL`` where it would need a GPU.
"""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as tdist

from smddp import _compat
from smddp.comm import create_delegate
from smddp.comm.backends import torch_native
from smddp.comm.backends.local import LocalCommunicator
from smddp.comm.base import Context
from smddp.comm.engine import Engine
from smddp.errors import BackendUnavailableError
from smddp.job.topology import Topology
from smddp.torch.delegating_group import DelegatingProcessGroup

from launchers import assert_all_ranks_passed, mpirun, torchrun, untagged

SCRIPT = "tests/ranks/fsdp_checks.py"
ENV = {"SMDDP_BACKEND": "torch-gloo", "SMDDP_TIMEOUT": "120"}


# ============================================================================ launched jobs
@pytest.mark.mpi
@pytest.mark.slow
def test_every_collective_fsdp2_and_ddp_on_the_delegated_route_under_mpirun(tmp_path):
    """Every collective, FSDP2 (and torch.compile over it), DCP, the v1 API, smddp's DDP class and a
    subgroup, through torch's gloo object: exact values, none through smddp's engine."""
    result = mpirun(2, [SCRIPT, "collectives", "train", str(tmp_path), "delegated"], timeout=240, env=ENV)
    assert_all_ranks_passed(result, 2, at_least=75)
    output = untagged(result.stdout)
    for name in ("direct all_reduce takes torch's backend object, not smddp's engine",
                 "DDP's reducer hands its buckets to torch's backend",
                 "FSDP2's all-gathers and reduce-scatters take torch's backend",
                 "fully_shard per layer and root equals whole-batch training",
                 "v1 asynchronous all_reduce returns torch's Work",
                 "smddp's DDP class on torch's backend equals whole-batch training",
                 "no progress or completion thread of smddp's engine ran on the delegated route"):
        assert f"CHECK 0 {name}" in output and f"CHECK 1 {name}" in output, result.output
    assert "CHECK 0 a subgroup delegates through a torch backend of its own" in output, result.output  # ranks [0]


@pytest.mark.slow
def test_every_collective_on_the_delegated_route_on_three_ranks_under_torchrun():
    result = torchrun(3, [SCRIPT, "collectives", "delegated"], timeout=240, env=ENV)
    assert_all_ranks_passed(result, 3, at_least=70)


# ============================================================================ in-process
ONE = Topology(rank=0, size=1, local_rank=0, local_size=1, launcher="none")


class Recording:
    """torch's backend object, as far as the group can tell: records each call and returns a Work of its own."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        def method(*args):
            work = object()
            self.calls.append((name, args, work))
            return work
        return method


def _group(device_type: str = "meta"):
    """A delegating group of one whose ``device_type`` tensors go to a :class:`Recording`."""
    recording = Recording()
    delegate = torch_native.Delegate(device_type, recording, "CUSTOM", torch.device(device_type), "torch-gloo",
                                     recording)
    engine = Engine({"cpu": LocalCommunicator(Context(ONE, timedelta(seconds=5)))}, timeout=5)
    return DelegatingProcessGroup(engine, 0, 1, delegate), recording, engine


@pytest.mark.unit
def test_each_collective_reaches_torchs_backend_with_the_callers_own_objects_and_returns_its_work():
    """Nothing is copied, converted or wrapped on the way: torch's options as given (``asyncOp``
    included), torch's Work as it is, and no collective numbered by smddp's engine."""
    group, recording, engine = _group()
    t, u = torch.empty(4, device="meta"), torch.empty(4, device="meta")
    ts, us = [t], [u]
    calls = [
        ("allreduce", (ts, tdist.AllreduceOptions())),
        ("broadcast", (ts, _compat.BroadcastOptions())),
        ("allgather", ([us], ts, _compat.AllgatherOptions())),
        ("_allgather_base", (u, t, _compat.AllgatherOptions())),
        ("all_gather_single", (u, t, _compat.AllgatherOptions())),
        ("_reduce_scatter_base", (u, t, tdist.ReduceScatterOptions())),
        ("reduce_scatter_single", (u, t, tdist.ReduceScatterOptions())),
        ("reduce_scatter", (ts, [us], tdist.ReduceScatterOptions())),
        ("alltoall_base", (u, t, [4], [4], _compat.AllToAllOptions())),
        ("all_to_all_single", (u, t, [], [], _compat.AllToAllOptions())),
        ("alltoall", (us, ts, _compat.AllToAllOptions())),
        ("reduce", (ts, tdist.ReduceOptions())),
        ("gather", ([us], ts, tdist.GatherOptions())),
        ("scatter", (ts, [us], tdist.ScatterOptions())),
        ("allreduce_coalesced", (ts, tdist.AllreduceCoalescedOptions())),
        ("allgather_coalesced", ([us], ts, _compat.AllgatherOptions())),
        ("barrier", (_compat.BarrierOptions(),)),
        ("send", (ts, 0, 7)),
        ("recv", (ts, 0, 7)),
        ("recv_anysource", (ts, 7)),
    ]
    aliases = {"all_gather_single": "_allgather_base", "reduce_scatter_single": "_reduce_scatter_base",
               "all_to_all_single": "alltoall_base"}
    try:
        for name, args in calls:
            returned = getattr(group, name)(*args)
            called, given, work = recording.calls[-1]
            assert called == aliases.get(name, name), (name, called)
            assert len(given) == len(args) and all(a is b for a, b in zip(given, args)), name
            assert returned is work, name
        assert len(recording.calls) == len(calls)
        assert engine.seq == 0
        # no options: the binding's defaults, as torch's own call
        group.allreduce(ts)
        assert recording.calls[-1][:2] == ("allreduce", (ts,))
    finally:
        engine.close()


@pytest.mark.unit
def test_cpu_tensors_of_a_gpu_job_keep_the_cpu_plane_and_the_v1_checks_come_first(monkeypatch):
    group, recording, engine = _group()
    try:
        t = torch.ones(3)
        assert group.allreduce([t], tdist.AllreduceOptions()) is not None  # the engine's Handle
        assert engine.seq == 1 and recording.calls == []
        assert group.backend_name == "torch-gloo" and group.delegated(torch.empty(1, device="meta"))
        assert not group.delegated(t)
    finally:
        engine.close()


class _FakeNCCL:
    """``torch.distributed.ProcessGroupNCCL`` where it would need a GPU: what it was made with."""

    made = []

    class Options:
        def __init__(self):
            self.split_from = None
            self.split_color = None

    def __init__(self, store, rank, size, options):
        self.rank_, self.size_, self.options = rank, size, options
        self.error_handling = os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")
        self.connected = []
        _FakeNCCL.made.append(self)

    def eager_connect_single_device(self, device):
        self.connected.append(device)

    def _set_sequence_number_for_group(self):
        self.sequenced = True


@pytest.fixture
def fake_cuda(monkeypatch):
    monkeypatch.setattr(tdist, "ProcessGroupNCCL", _FakeNCCL, raising=False)
    monkeypatch.setattr(tdist, "is_nccl_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    _FakeNCCL.made = []
    return _FakeNCCL


@pytest.mark.unit
def test_torchs_nccl_group_is_made_as_torch_makes_it_and_connects_at_first_use(fake_cuda, monkeypatch):
    topology = Topology(rank=1, size=4, local_rank=1, local_size=4, launcher="torchrun")
    ctx = Context(topology, timedelta(seconds=42), tdist.HashStore())
    cpu = LocalCommunicator(Context(topology, timedelta(seconds=42)))
    monkeypatch.setenv("SMDDP_NCCL_ASYNC_ERROR_HANDLING", "2")
    world = create_delegate("torch-nccl", ctx, cpu, "0")
    made = world.inner
    assert (made.rank_, made.size_) == (1, 4) and made.options._timeout == timedelta(seconds=42)
    assert made.options.group_name == "0" and made.options.global_ranks_in_group == [0, 1, 2, 3]
    assert made.options.split_from is None and made.options.is_high_priority_stream is False
    assert made.connected == []  # torch connects a device_id group itself, after the group is made
    assert made.sequenced  # sequence numbers started as torch's own groups' are
    assert made.error_handling == "2" and "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in os.environ
    assert (world.device_type, world.kind, world.device) == ("cuda", "NCCL", torch.device("cuda", 1))
    assert world.backend is made  # no wrapper unless SMDDP_DEBUG

    # a subgroup of a world bound to its device: split from the world's communicator, torch's colour
    sub_topology = Topology(rank=0, size=2, local_rank=0, local_size=2, launcher="explicit")
    sub = create_delegate("torch-nccl", Context(sub_topology, timedelta(seconds=42), tdist.HashStore(),
                                                torch.device("cuda", 1)), cpu, "5", [1, 3], parent=world)
    options = sub.inner.options
    assert options.split_from is made and options.split_color == tdist.distributed_c10d._process_group_color([1, 3])
    assert options.global_ranks_in_group == [1, 3] and sub.device == torch.device("cuda", 1)


@pytest.mark.unit
def test_torch_nccl_without_cuda_says_what_to_install(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    ctx = Context(ONE, timedelta(seconds=5), tdist.HashStore())
    with pytest.raises(BackendUnavailableError, match="needs a CUDA GPU"):
        create_delegate("torch-nccl", ctx, LocalCommunicator(ctx))


@pytest.mark.unit
def test_smddp_debug_on_the_delegated_route_is_torchs_own_collective_check(monkeypatch):
    """``SMDDP_DEBUG=1`` wraps torch's backend in torch's ``ProcessGroupWrapper``, which compares each
    collective across ranks first (``TORCH_DISTRIBUTED_DEBUG=DETAIL``'s check); without it, nothing wraps."""
    ctx = Context(ONE, timedelta(seconds=5), tdist.HashStore())
    plain = create_delegate("torch-gloo", ctx, LocalCommunicator(ctx))
    assert plain.backend is plain.inner and isinstance(plain.inner, tdist.ProcessGroupGloo)
    monkeypatch.setenv("SMDDP_DEBUG", "1")
    checked = create_delegate("torch-gloo", Context(ONE, timedelta(seconds=5), tdist.HashStore()),
                              LocalCommunicator(ctx))
    assert type(checked.backend).__name__ == "_ProcessGroupWrapper"
    assert isinstance(checked.inner, tdist.ProcessGroupGloo)
    t = torch.arange(4.0)
    checked.backend.allreduce([t]).wait()
    assert t.tolist() == [0.0, 1.0, 2.0, 3.0]
