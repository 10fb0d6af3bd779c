"""Device backends on a CPU machine: selection, errors, devices, routing, torch's Work as a Pending.

The hardware that is absent here (CUDA and Intel GPUs) is replaced by hand-built
:class:`~smddp.comm.Probe` records. The delegated route itself (device tensors handed to torch's
own backend object) runs in tests/torch/test_delegated.py, over torch's gloo. NCCL through CuPy's
own pieces (tables, the unique id, all_to_all's plan) are tests/comm/backends/nccl/test_units.py's.
"""

from __future__ import annotations

import importlib.util
import itertools
import logging
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch

import smddp.comm as comm
from smddp.comm import BACKENDS, Probe, choose_backend
from smddp.comm.backends import torch_native
from smddp.comm.backends.c10d_work import WorkPending
from smddp.comm.backends.devices import check_device, pick_device, with_cpu_companion
from smddp.comm.base import Communicator, Context, Done, Pending
from smddp.comm.engine import Engine
from smddp.comm.planes.choose import PlaneSettings, build, companion
from smddp.comm.reduction import Op
from smddp.errors import BackendUnavailableError, InvalidArgumentError
from smddp.job.topology import Topology

ROOT = Path(__file__).resolve().parents[2]

ONE = Topology()  # plain `python train.py`
MPI2 = Topology(rank=0, size=2, local_size=2, launcher="openmpi")
MPI2_RANK1 = Topology(rank=1, size=2, local_rank=1, local_size=2, launcher="openmpi")
TORCHRUN2 = Topology(rank=0, size=2, local_size=2, launcher="torchrun")
MPI1 = Topology(rank=0, size=1, launcher="openmpi")  # mpirun -np 1

CPU = Probe()
CPU_MPI = Probe(mpi4py=True)
CUDA = Probe(cuda=True, cupy=True, mpi4py=True)
CUDA_NO_CUPY = Probe(cuda=True, mpi4py=True)
XPU_XCCL = Probe(xpu=True, xccl=True)
XPU_CCL = Probe(xpu=True, ccl=True)
XPU_BARE = Probe(xpu=True)


# ---------------------------------------------------------------------------- automatic choice
@pytest.mark.unit
@pytest.mark.parametrize(
    "found, topology, expected",
    [
        (CPU, ONE, "local"),
        (CUDA, ONE, "local"),  # a world of one moves nothing, on any device
        (XPU_BARE, ONE, "local"),
        (CPU_MPI, MPI2, "mpi"),
        (CPU, MPI2, "gloo"),  # MPI launcher, no mpi4py
        (CPU_MPI, TORCHRUN2, "gloo"),
        (CUDA, TORCHRUN2, "torch-nccl"),  # CuPy installed or not: torch's own NCCL group
        (CUDA, MPI2, "torch-nccl"),
        (CUDA, MPI1, "torch-nccl"),
        (CUDA_NO_CUPY, TORCHRUN2, "torch-nccl"),
        (CUDA_NO_CUPY, MPI2, "torch-nccl"),
        (Probe(cuda=True, cupy=True, xpu=True, xccl=True), TORCHRUN2, "torch-nccl"),  # CUDA first
        (XPU_XCCL, TORCHRUN2, "xccl"),
        (XPU_CCL, MPI2, "xccl"),
        (Probe(xpu=True, xccl=True, ccl=True, mpi4py=True), MPI2, "xccl"),
    ],
)
def test_automatic_choice(found, topology, expected):
    assert choose_backend(None, {}, topology, found) == expected
    assert choose_backend("auto", {}, topology, found) == expected
    assert choose_backend(None, {"SMDDP_BACKEND": "smddp"}, topology, found) == expected


@pytest.mark.unit
def test_cuda_gets_torchs_own_nccl_group_with_or_without_cupy_and_nothing_to_warn(caplog):
    """CuPy's ``nccl`` is an opt-in: its presence changes nothing, and its absence is no news."""
    for found in (CUDA, CUDA_NO_CUPY):
        with caplog.at_level(logging.DEBUG, logger="smddp"):
            assert choose_backend(None, {}, MPI2, found) == "torch-nccl"
    assert caplog.records == []
    assert choose_backend(None, {"SMDDP_BACKEND": "nccl"}, MPI2, CUDA) == "nccl"


def test_intel_gpu_without_oneccl_says_what_to_install():
    with pytest.raises(BackendUnavailableError) as err:
        choose_backend(None, {}, TORCHRUN2, XPU_BARE)
    message = str(err.value)
    assert "oneccl_bind_pt" in message and "XCCL" in message and "SMDDP_BACKEND=gloo" in message


@pytest.mark.unit
@pytest.mark.parametrize("topology", [ONE, MPI1, MPI2, MPI2_RANK1, TORCHRUN2])
def test_every_machine_gets_a_backend_for_its_device(topology):
    for flags in itertools.product((False, True), repeat=6):
        found = Probe(*flags)
        if found.xpu and not (found.cuda or found.xccl or found.ccl) and topology.distributed:
            with pytest.raises(BackendUnavailableError, match="oneccl_bind_pt"):
                choose_backend(None, {}, topology, found)
            continue
        name = choose_backend(None, {}, topology, found)
        assert name in BACKENDS
        if not topology.distributed:
            assert name == "local"
        elif found.cuda:
            assert name == "torch-nccl"
        elif found.xpu:
            assert name == "xccl"
        else:
            assert name == ("mpi" if topology.mpi and found.mpi4py else "gloo")


# ---------------------------------------------------------------------------- explicit choice
@pytest.mark.unit
@pytest.mark.parametrize(
    "name, found, expected",
    [
        ("nccl", CUDA, "nccl"),
        ("NCCL", CUDA, "nccl"),
        ("torch-nccl", CUDA, "torch-nccl"),
        ("torch_nccl", CUDA_NO_CUPY, "torch-nccl"),
        ("xccl", XPU_XCCL, "xccl"),
        ("xccl", XPU_CCL, "xccl"),
        ("ccl", XPU_CCL, "ccl"),
        ("ccl", Probe(ccl=True), "ccl"),  # oneCCL moves CPU tensors too
        ("gloo", CUDA, "gloo"),
        ("mpi", CUDA, "mpi"),
    ],
)
def test_explicit_choice(name, found, expected):
    assert choose_backend(name, {}, TORCHRUN2, found) == expected
    assert choose_backend(None, {"SMDDP_BACKEND": name}, TORCHRUN2, found) == expected
    assert choose_backend(name, {}, ONE, found) == expected  # even in a world of one


@pytest.mark.unit
def test_requested_backend_beats_the_environment():
    assert choose_backend("gloo", {"SMDDP_BACKEND": "nccl"}, TORCHRUN2, CPU) == "gloo"


@pytest.mark.unit
@pytest.mark.parametrize(
    "name, found, needles",
    [
        ("nccl", CPU, ["needs a CUDA GPU", "torch.cuda.is_available() is False", "'gloo'"]),
        ("nccl", Probe(xpu=True, xccl=True), ["needs a CUDA GPU"]),
        ("nccl", CUDA_NO_CUPY, ["needs CuPy", "pip install 'smddp[cuda12]'", "'smddp[cuda13]'", "cupy-cuda12x",
                                "cupy-cuda13x", "leave SMDDP_BACKEND unset for 'torch-nccl'"]),
        ("torch-nccl", CPU, ["needs a CUDA GPU"]),
        ("xccl", CUDA, ["needs an Intel GPU", "torch.xpu.is_available() is False"]),
        ("xccl", XPU_BARE, ["no XCCL", "oneccl_bind_pt", "torch XPU build >= 2.8"]),
        ("ccl", XPU_XCCL, ["oneccl_bindings_for_pytorch", "oneccl_bind_pt"]),
        ("nvlink", CUDA, ["unknown backend 'nvlink'", "nccl", "torch-nccl", "xccl", "ccl", "gloo", "mpi"]),
    ],
)
def test_unavailable_backend_errors_say_what_to_do(name, found, needles):
    for requested, env in ((name, {}), (None, {"SMDDP_BACKEND": name})):
        with pytest.raises(BackendUnavailableError) as err:
            choose_backend(requested, env, TORCHRUN2, found)
        for needle in needles:
            assert needle in str(err.value)


@pytest.mark.unit
def test_registry_names_each_device_backends_device_and_install_hint():
    assert BACKENDS["nccl"].device == BACKENDS["torch-nccl"].device == "cuda"
    assert BACKENDS["xccl"].device == BACKENDS["ccl"].device == "xpu"
    assert "cupy-cuda12x" in BACKENDS["nccl"].needs and "cupy-cuda13x" in BACKENDS["nccl"].needs
    assert "oneccl_bind_pt" in BACKENDS["xccl"].needs
    cls = comm.backend_class("nccl")  # importable without CuPy or a device
    assert issubclass(cls, Communicator) and cls.name == "nccl" and BACKENDS["nccl"].device in cls.device_types
    assert not BACKENDS["nccl"].delegated
    for name in ("torch-nccl", "xccl", "ccl", "torch-gloo"):
        # torch's own backend object takes the device's tensors: the registry names its factory
        assert BACKENDS[name].delegated and comm.backend_class(name) is torch_native.create
        assert torch_native.DEVICES[name] == BACKENDS[name].device


@pytest.mark.unit
@pytest.mark.parametrize("module", ["devices.py", "torch_native.py", *(
    f"nccl/{p.name}" for p in sorted((ROOT / "smddp" / "comm" / "backends" / "nccl").glob("*.py")))])
def test_importing_device_backends_loads_no_device_library(monkeypatch, module):
    # Fresh copies of the modules, run while importing a device library fails: a
    # module-level import of CuPy, mpi4py.MPI (it would start MPI) or oneCCL raises here.
    for name in ("cupy", "cupy.cuda", "mpi4py", "mpi4py.MPI", "oneccl_bindings_for_pytorch"):
        monkeypatch.setitem(sys.modules, name, None)
    path = ROOT / "smddp" / "comm" / "backends" / module
    spec = importlib.util.spec_from_file_location(f"_fresh_{module.replace('/', '_')[:-3]}", path)
    fresh = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, fresh)  # where a dataclass looks its module up
    spec.loader.exec_module(fresh)
    assert fresh.__doc__


# ---------------------------------------------------------------------------- constructing here
def _ctx(topology: Topology = ONE, store=None, device=None) -> Context:
    return Context(topology, timedelta(seconds=10), store, device)


def _create(name: str):
    """What a group of backend ``name`` makes: its communicators, then torch's backend object."""
    comms = comm.create_communicators(name, _ctx())
    try:
        return comm.create_delegate(name, _ctx(), comms["cpu"])
    finally:
        comms["cpu"].close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the errors of a machine without CUDA")
@pytest.mark.parametrize("name", ["nccl", "torch-nccl"])
def test_cuda_backends_fail_clearly_without_a_gpu(name):
    with pytest.raises(BackendUnavailableError, match="needs a CUDA GPU"):
        _create(name)


@pytest.mark.skipif(getattr(torch, "xpu", None) is not None and torch.xpu.is_available(), reason="has an XPU")
def test_xpu_backends_fail_clearly_without_an_intel_gpu():
    with pytest.raises(BackendUnavailableError, match="needs an Intel GPU") as err:
        _create("xccl")
    assert "oneccl_bind_pt" in str(err.value)
    if not comm.has_module("oneccl_bindings_for_pytorch"):
        with pytest.raises(BackendUnavailableError, match="oneccl_bind_pt"):
            _create("ccl")


# ---------------------------------------------------------------------------- devices
@pytest.mark.unit
def test_pick_device_from_local_rank_or_context():
    topo = Topology(rank=5, size=8, local_rank=5, local_size=8, launcher="torchrun")
    assert pick_device(_ctx(topo), "cuda", count=8) == torch.device("cuda", 5)
    assert pick_device(_ctx(topo), "cuda", count=1) == torch.device("cuda", 0)  # one visible device per rank
    assert pick_device(_ctx(topo, device=torch.device("cuda", 2)), "cuda", count=8) == torch.device("cuda", 2)
    assert pick_device(_ctx(topo, device="xpu"), "xpu", count=4) == torch.device("xpu", 1)
    with pytest.raises(BackendUnavailableError, match="no cuda device"):
        pick_device(_ctx(topo), "cuda", count=0)
    with pytest.raises(InvalidArgumentError):
        pick_device(_ctx(topo, device="cpu"), "cuda", count=8)
    with pytest.raises(InvalidArgumentError, match="does not exist"):
        pick_device(_ctx(topo, device="cuda:9"), "cuda", count=8)


@pytest.mark.unit
def test_check_device_names_the_fix():
    check_device(torch.empty(1, device="meta"), torch.device("meta"), "nccl")
    with pytest.raises(InvalidArgumentError, match=r"set_device\(0\)"):
        check_device(torch.empty(1), torch.device("cuda", 0), "nccl")


@pytest.mark.unit
@pytest.mark.parametrize(
    "topology, mpi4py, expected",
    [(ONE, True, "local"), (MPI1, True, "mpi"), (MPI2, True, "mpi"), (MPI2, False, "gloo"),
     (TORCHRUN2, True, "gloo")],
)
def test_cpu_companion_of_a_device_backend(topology, mpi4py, expected):
    assert companion(topology, mpi4py) == expected
    # SMDDP_CPU_PLANE=gloo moves an MPI job's CPU tensors to gloo; elsewhere it changes nothing.
    pinned = "gloo" if expected == "mpi" else expected
    assert companion(topology, mpi4py, PlaneSettings(plane="gloo")) == pinned


# ---------------------------------------------------------------------------- routing
class Recorder(Communicator):
    """A communicator that records what reaches it and completes at once."""

    name = "recorder"

    def __init__(self, ctx: Context, name: str = "recorder", device_types=("cpu",)):
        super().__init__(ctx)
        self.name, self.device_types = name, tuple(device_types)
        self.calls, self.closed = [], 0

    def _record(self, op, *tensors):
        self.calls.append((op, tuple(t.device.type for t in tensors)))
        return Done()

    def all_reduce(self, tensor, op, tag):
        return self._record("all_reduce", tensor)

    def broadcast(self, tensor, src, tag):
        return self._record("broadcast", tensor)

    def all_gather(self, output, input, tag):
        return self._record("all_gather", output, input)

    def all_to_all_single(self, output, input, output_counts, input_counts, tag):
        return self._record("all_to_all_single", output, input)

    def barrier(self, tag):
        return self._record("barrier")

    def close(self):
        self.closed += 1


def test_cpu_tensors_of_a_gpu_job_go_to_the_cpu_communicator():
    device = Recorder(_ctx(), "fake-nccl", ("cuda",))
    cpu = Recorder(_ctx(), "fake-gloo")
    engine = Engine({"cuda": device, "cpu": cpu}, timeout=5)
    assert engine.backend == "fake-nccl"
    loss = torch.tensor([1.5])
    engine.all_reduce(loss, Op.AVERAGE)
    engine.broadcast(torch.zeros(3), 0)
    engine.all_gather([torch.zeros(2)], torch.ones(2))
    engine.all_to_all_single(torch.zeros(4), torch.ones(4))
    engine.barrier()
    assert [c[0] for c in cpu.calls] == ["all_reduce", "broadcast", "all_gather", "all_to_all_single"]
    assert all(set(types_) == {"cpu"} for _, types_ in cpu.calls)
    assert device.calls == [("barrier", ())]  # the job's backend runs barriers
    with pytest.raises(BackendUnavailableError, match="does not serve meta tensors.*cpu, cuda"):
        engine.all_reduce(torch.empty(2, device="meta"), Op.SUM)
    engine.close()
    assert device.closed == cpu.closed == 1


@pytest.mark.unit
def test_device_tensors_go_to_the_device_communicator():
    # "meta" stands in for an accelerator: routing only looks at the device type
    device = Recorder(_ctx(), "fake-device", ("meta",))
    cpu = Recorder(_ctx(), "fake-cpu")
    engine = Engine({"meta": device, "cpu": cpu}, timeout=5)
    engine.all_reduce(torch.empty(4, device="meta"), Op.SUM)
    engine.all_gather_into_tensor(torch.empty(4, device="meta"), torch.empty(4, device="meta"))
    engine.all_reduce(torch.ones(1), Op.SUM)
    assert device.calls == [("all_reduce", ("meta",)), ("all_gather", ("meta", "meta"))]
    assert cpu.calls == [("all_reduce", ("cpu",))]


@pytest.mark.unit
def test_a_pending_done_at_its_first_test_is_tested_once():
    class StreamOrderedStub(Pending):
        tests = 0

        def test(self):
            StreamOrderedStub.tests += 1
            return True

    class Device(Recorder):
        def all_reduce(self, tensor, op, tag):
            return StreamOrderedStub()

    engine = Engine({"meta": Device(_ctx(), "dev", ("meta",))}, timeout=5)
    handle = engine.all_reduce(torch.empty(1, device="meta"), Op.SUM, async_op=True)
    assert handle.wait() and StreamOrderedStub.tests == 1


@pytest.mark.unit
def test_with_cpu_companion_pairs_and_cleans_up():
    made = []

    def make(ctx):
        made.append(Recorder(ctx, "fake-nccl", ("cuda",)))
        return made[-1]

    ctx = _ctx()
    ctx.cpu = lambda c: build("local", c, PlaneSettings())
    comms = with_cpu_companion("cuda", make, ctx)
    assert list(comms) == ["cuda", "cpu"] and comms["cuda"] is made[0]
    assert comms["cpu"].name == "local"  # a world of one started without a launcher

    def broken(ctx):
        raise BackendUnavailableError("no gloo here")

    # The CPU communicator comes first (its ranks agree on the layout, whose local rank picks
    # the device): when it fails, no device communicator was made.
    ctx.cpu = broken
    with pytest.raises(BackendUnavailableError, match="no gloo here"):
        with_cpu_companion("cuda", make, ctx)
    assert len(made) == 1
    cpu = Recorder(ctx, "cpu-companion")
    ctx.cpu = lambda c: cpu
    with pytest.raises(BackendUnavailableError, match="no gloo here"):
        with_cpu_companion("cuda", broken, ctx)
    assert cpu.closed == 1  # the CPU communicator does not leak when the device one fails
    ctx.cpu = None
    with pytest.raises(BackendUnavailableError, match="needs a CPU communicator"):
        with_cpu_companion("cuda", make, ctx)


# ---------------------------------------------------------------------------- torch Work wrapper
class FakeWork:
    def __init__(self, done_after: int = 0, error: Exception = None):
        self.polls, self.waits, self.done_after, self.error = 0, 0, done_after, error

    def is_completed(self):
        self.polls += 1
        return self.polls > self.done_after

    def wait(self):
        self.waits += 1
        if self.error is not None:
            raise self.error
        return True


@pytest.mark.unit
def test_stream_ordered_work_is_waited_on_not_polled():
    work = FakeWork(done_after=100)
    pending = WorkPending(work, stream_ordered=True)
    assert pending.test() and pending.test()
    assert work.polls == 0 and work.waits == 1


@pytest.mark.unit
def test_polled_work_runs_its_follow_up_once_and_raises_errors():
    after = []
    work = FakeWork(done_after=2)
    pending = WorkPending(work, stream_ordered=False, after=lambda: after.append(1))
    assert [pending.test() for _ in range(4)] == [False, False, True, True]
    assert after == [1] and work.waits == 1
    with pytest.raises(RuntimeError, match="peer died"):
        WorkPending(FakeWork(error=RuntimeError("peer died")), stream_ordered=False).test()
