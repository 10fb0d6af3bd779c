"""smddp's NCCL-through-CuPy pieces on a CPU machine: loading CuPy's module, dtype and op tables,
the unique id's exchange (store and MPI) and its encoding, all_to_all's plan, the stream mode.

A small fake ``cupy.cuda.nccl`` module answers where a library must (no GPU here);
tests/comm/backends/nccl/test_real_cupy.py runs the same calls against CuPy's real module.
"""

from __future__ import annotations

import struct
import sys
import threading
import time
import types
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as tdist
from fake_cupy import X86_ID, fake_cupy

from smddp.comm.backends.nccl.bindings import CONVERTED
from smddp.comm.backends.nccl.communicator import (
    NCCL_2_10,
    NCCLCommunicator,
    all_to_all_plan,
    load_nccl,
    nccl_dtypes,
    nccl_ops,
    share_unique_id,
    stream_mode,
)
from smddp.comm.backends.nccl.unique_id import encode
from smddp.comm.reduction import Op
from smddp.errors import BackendUnavailableError, CollectiveError, InvalidArgumentError
from smddp.job.topology import Topology

pytestmark = pytest.mark.unit  # in-process, no job started: the fast tier

ONE = Topology()  # plain `python train.py`
MPI2 = Topology(rank=0, size=2, local_size=2, launcher="openmpi")
MPI2_RANK1 = Topology(rank=1, size=2, local_rank=1, local_size=2, launcher="openmpi")
TORCHRUN2 = Topology(rank=0, size=2, local_size=2, launcher="torchrun")

# ---------------------------------------------------------------------------- a fake CuPy
def test_load_nccl_without_cupy_names_the_extra(monkeypatch):
    for name in ("cupy", "cupy.cuda", "cupy.cuda.nccl"):  # a real CuPy may be imported already
        monkeypatch.setitem(sys.modules, name, None)  # import raises ImportError
    with pytest.raises(BackendUnavailableError) as err:
        load_nccl()
    for needle in ("pip install 'smddp[cuda12]'", "cupy-cuda12x", "cupy-cuda13x", "SMDDP_BACKEND=torch-nccl"):
        assert needle in str(err.value)


def test_load_nccl_when_cupy_cannot_find_libnccl(monkeypatch):
    fake_cupy(monkeypatch, available=False)
    with pytest.raises(BackendUnavailableError) as err:
        load_nccl()
    assert "libnccl.so.2" in str(err.value) and "nvidia-nccl-cu12" in str(err.value)


def test_load_nccl_returns_cupys_module(monkeypatch):
    fake = fake_cupy(monkeypatch)
    assert load_nccl() is fake


# ---------------------------------------------------------------------------- dtype and op tables
NCCL_H = {torch.int8: 0, torch.uint8: 1, torch.int32: 2, torch.int64: 4, torch.float16: 6,
          torch.float32: 7, torch.float64: 8, torch.bfloat16: 9}


@pytest.mark.parametrize("bf16", [True, False])
def test_dtype_table_matches_nccl_h_with_or_without_cupys_bf16_constant(monkeypatch, bf16):
    table = nccl_dtypes(fake_cupy(monkeypatch, bf16=bf16))
    assert table == NCCL_H
    # every dtype the engine lets through has a code, or travels as one (bool, complex, float8)
    assert set(NCCLCommunicator.dtypes - CONVERTED) <= set(table)


def test_dtype_table_prefers_cupys_constants():
    odd = types.SimpleNamespace(NCCL_FLOAT32=70, NCCL_BFLOAT16=90)
    table = nccl_dtypes(odd)
    assert table[torch.float32] == 70 and table[torch.bfloat16] == 90 and table[torch.int8] == 0


def test_op_table_uses_nccl_avg_from_nccl_2_10():
    fake = types.SimpleNamespace(NCCL_SUM=0, NCCL_PROD=1, NCCL_MAX=2, NCCL_MIN=3)  # no NCCL_AVG constant
    assert nccl_ops(fake, NCCL_2_10) == {Op.SUM: 0, Op.PRODUCT: 1, Op.MAX: 2, Op.MIN: 3, Op.AVERAGE: 4}
    assert nccl_ops(fake, 22703)[Op.AVERAGE] == 4
    assert nccl_ops(fake, 2804)[Op.AVERAGE] is None  # NCCL 2.8.4: sum, then divide



# ---------------------------------------------------------------------------- unique id
ARM_ID = tuple([212, 198, 67, 96, 0, 127, 128, 2] + [0] * 120)  # CuPy < 14 on ARM: unsigned char
SMALL_ID = tuple([1, 2, 3] + [0] * 125)  # no byte >= 128: same on both
BYTES_ID = bytes([212, 198, 67, 96, 0, 127, 128, 2] + [0] * 120)  # CuPy >= 14


@pytest.mark.parametrize("uid", [X86_ID, ARM_ID, SMALL_ID, BYTES_ID])
def test_unique_id_shared_through_the_store(monkeypatch, uid):
    fake = fake_cupy(monkeypatch, uid=uid)
    store = tdist.HashStore()
    store.set_timeout(timedelta(seconds=10))
    got = {}

    def rank(r: int, group: str) -> None:  # each group has a store of its own, as torch gives it
        topology = Topology(rank=r, size=2, local_rank=r, local_size=2, launcher="torchrun")
        got[(r, group)] = share_unique_id(fake, topology, tdist.PrefixStore(group, store),
                                          deadline=time.monotonic() + 20)

    threads = [threading.Thread(target=rank, args=(r, g)) for g in ("a", "b") for r in (1, 0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert len(got) == 4
    for value in got.values():
        assert type(value) is type(uid) and value == uid
    assert fake.calls == ["get_unique_id"] * 2  # rank 0 only, once per communicator
    assert store.check(["a/smddp/nccl/cuda/unique_id", "b/smddp/nccl/cuda/unique_id"])


class WireMPI:
    """A two-rank mpi4py communicator's buffer broadcast, in one process: rank 0's ``Bcast``
    calls are recorded, and replayed into the receiving rank's buffers. It has no ``bcast``:
    the lowercase methods pickle."""

    def __init__(self, rank: int, wire: list):
        self.rank, self.wire, self.calls = rank, wire, 0

    def Get_rank(self) -> int:  # noqa: N802 - mpi4py's names
        return self.rank

    def Bcast(self, buf, root=0) -> None:  # noqa: N802
        assert isinstance(buf, bytearray) and root == 0
        if self.rank == root:
            self.wire.append(bytes(buf))
        else:
            buf[:] = self.wire[self.calls]
        self.calls += 1


@pytest.mark.parametrize("uid", [X86_ID, ARM_ID, SMALL_ID, BYTES_ID])
def test_unique_id_broadcast_over_mpi(monkeypatch, uid):
    fake = fake_cupy(monkeypatch, uid=uid)
    wire: list = []
    assert share_unique_id(fake, MPI2, mpi_comm=WireMPI(0, wire)) == uid
    assert b"".join(wire)[8:] == encode(uid) and len(encode(uid)) == 129  # the length, then raw bytes
    got = share_unique_id(fake, MPI2_RANK1, mpi_comm=WireMPI(1, wire))
    assert type(got) is type(uid) and got == uid
    assert fake.calls == ["get_unique_id"]  # only rank 0 creates an id


class Planted:
    """What an attacker who reaches the store would write: unpickling it creates ``marker``."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


@pytest.mark.parametrize("planted", ["pickle", "short", "long", "bad form"])
def test_unique_id_refuses_anything_but_raw_id_bytes(monkeypatch, tmp_path, planted):
    import pickle

    fake = fake_cupy(monkeypatch, uid=BYTES_ID)
    marker = tmp_path / "executed"
    blob = {
        "pickle": pickle.dumps(Planted(str(marker))),
        "short": encode(BYTES_ID)[:-1],
        "long": encode(BYTES_ID) + b"\0",
        "bad form": b"P" + BYTES_ID,
    }[planted]
    assert planted != "pickle" or (pickle.loads(blob), marker.exists())[1]  # the payload is live
    marker.unlink(missing_ok=True)
    store = tdist.HashStore()
    store.set("smddp/nccl/cuda/unique_id", blob)
    rank1 = Topology(rank=1, size=2, local_rank=1, local_size=2, launcher="torchrun")
    with pytest.raises(CollectiveError, match="NCCL unique id received from store key 'smddp/nccl/cuda/unique_id' "
                                              "is malformed .* and was refused"):
        share_unique_id(fake, rank1, store)
    assert not marker.exists(), "the planted object was unpickled"
    # Over MPI too: a malformed message is refused, never run.
    wire = [struct.pack("!Q", len(blob)), blob]
    with pytest.raises(CollectiveError, match="received from MPI broadcast from rank 0 is malformed"):
        share_unique_id(fake, MPI2_RANK1, mpi_comm=WireMPI(1, wire))
    assert not marker.exists()
    assert fake.calls == []


def test_unique_id_encoding_refuses_a_malformed_local_id():
    for bad in (b"x" * 127, tuple(range(128)) + (0,), tuple([300] + [0] * 127), tuple([-1, 200] + [0] * 126)):
        with pytest.raises(CollectiveError, match="not 128 bytes or 128 char values"):
            encode(bad)


def test_unique_id_world_of_one_needs_no_exchange(monkeypatch):
    fake = fake_cupy(monkeypatch, uid=BYTES_ID)
    assert share_unique_id(fake, ONE) == BYTES_ID


def test_unique_id_without_store_or_mpi_says_how_to_launch(monkeypatch):
    fake = fake_cupy(monkeypatch, uid=BYTES_ID)
    with pytest.raises(BackendUnavailableError, match="mpirun"):
        share_unique_id(fake, TORCHRUN2, store=None)


# ---------------------------------------------------------------------------- all_to_all and streams
def test_all_to_all_plan_uneven_counts():
    calls, own = all_to_all_plan(1, 3, output_counts=[4, 3, 0], input_counts=[2, 3, 1])
    assert calls == [("send", 0, 0, 2), ("recv", 0, 0, 4), ("send", 2, 5, 1)]
    assert own == (4, 2, 3)  # output offset, input offset, count
    calls, own = all_to_all_plan(0, 2, output_counts=[0, 5], input_counts=[0, 0])
    assert calls == [("recv", 1, 0, 5)] and own is None


def test_all_to_all_plan_rejects_bad_counts():
    with pytest.raises(InvalidArgumentError, match="sends 2 elements to itself but expects 3"):
        all_to_all_plan(0, 2, output_counts=[3, 1], input_counts=[2, 2])
    with pytest.raises(InvalidArgumentError, match="need 2 counts"):
        all_to_all_plan(0, 2, output_counts=[1], input_counts=[1, 1])


def test_stream_mode_from_environment():
    assert stream_mode({}) == "side"  # the group's own stream, as torch's NCCL group
    assert stream_mode({"SMDDP_NCCL_STREAM": "Current"}) == "current"
    with pytest.raises(InvalidArgumentError, match="SMDDP_NCCL_STREAM"):
        stream_mode({"SMDDP_NCCL_STREAM": "other"})
