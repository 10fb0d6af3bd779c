"""The CPU backends' registry: one entry per backend, read by the registry, the planes and the subgroups."""

from __future__ import annotations

import pytest

from smddp import comm
from smddp.comm.backends import cpu
from smddp.comm.backends.local import LocalCommunicator
from smddp.comm.base import Communicator
from smddp.comm.planes import choose
from smddp.errors import BackendUnavailableError

pytestmark = pytest.mark.unit


def test_the_registry_lists_every_cpu_backend_as_the_cpu_registry_has_it():
    assert set(cpu.CPU_BACKENDS) == {"mpi", "gloo", "local"}
    for name, backend in cpu.CPU_BACKENDS.items():
        info = comm.BACKENDS[name]
        assert (info.target, info.device, info.needs, info.summary) == (backend.target, "cpu", backend.needs,
                                                                         backend.summary)
        assert not info.delegated
    # Only local's world of one bypasses the planes when asked for by name.
    assert [name for name, backend in cpu.CPU_BACKENDS.items() if not backend.planes] == ["local"]


def test_the_planes_and_the_subgroups_load_the_registry_classes():
    for name in ("gloo", "local"):  # mpi's module is not imported here: mpi4py would start MPI
        cls = choose.flat_class(name)
        assert issubclass(cls, Communicator) and cls.name == name
    assert cpu.load(cpu.ALONE) is LocalCommunicator
    assert cpu.load(cpu.OVER_A_STORE).name == "gloo"


def test_an_unknown_cpu_backend_is_refused_naming_the_ones_there_are():
    with pytest.raises(BackendUnavailableError, match=r"'nccl' is not a CPU backend; use mpi, gloo or local"):
        choose.flat_class("nccl")


def test_a_new_cpu_backend_is_one_entry(monkeypatch):
    entry = cpu.CpuBackend("fake", "smddp.comm.backends.local:LocalCommunicator", "nothing", "a test's")
    monkeypatch.setitem(cpu.CPU_BACKENDS, "fake", entry)
    assert choose.flat_class("fake") is LocalCommunicator
    with pytest.raises(BackendUnavailableError, match=r"use mpi, gloo, local or fake"):
        cpu.load("missing")
