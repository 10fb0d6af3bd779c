"""The ``nccl`` backend against CuPy's real ``cupy.cuda.nccl``, which imports without a GPU.

``pip install -e '.[dev]'`` brings cupy-cuda12x and nvidia-nccl-cu12 (CuPy's NCCL library), so
these run in CI; where CuPy or its NCCL library is missing they skip and say so. What they
prove: every call smddp makes has the arity and argument types of CuPy's signature, the codes
it sends are CuPy's, a real unique id goes through a store with a deadline and comes back as
the type CuPy's ``NcclCommunicator`` takes, and CuPy's own error from ``ncclCommInitRank``
(here: no GPU) reaches the caller as a CollectiveError that says what to check. And
``smddp-info``'s probe imports torch before CuPy.
"""

from __future__ import annotations

import json
import re
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as tdist
from nccl_ranks import expected_reduce, run_ranks, seeded
from nccl_standin import install

from smddp.comm.backends.nccl import lane
from smddp.comm.backends.nccl.bindings import _DTYPE_CODES, _OP_CODES
from smddp.comm.backends.nccl.communicator import NCCLCommunicator, load_nccl, nccl_dtypes, nccl_ops
from smddp.comm.backends.nccl.unique_id import share_unique_id
from smddp.comm.base import Context
from smddp.comm.reduction import Op
from smddp.errors import CollectiveError
from smddp.info.probe import MARKER
from smddp.job.topology import Topology

from launchers import ROOT, python


def _real_nccl():
    try:
        from cupy.cuda import nccl
    except Exception as exc:  # noqa: BLE001 - any import failure: CuPy is not usable here
        pytest.skip(f"CuPy is not importable ({exc}): pip install -e '.[dev]' brings cupy-cuda12x")
    if not getattr(nccl, "available", False) or not hasattr(nccl, "NcclCommunicator"):
        pytest.skip("CuPy cannot load libnccl here: pip install nvidia-nccl-cu12 (pip install -e '.[dev]' does)")
    return nccl


def _signature(doc: str, name: str) -> list:
    """``[(C type, parameter)]`` from the first line of a CuPy docstring, ``self`` left out."""
    line = doc.strip().splitlines()[0]
    match = re.match(rf"(?:NcclCommunicator\.)?{name}\((.*)\)", line)
    assert match, f"CuPy's docstring of {name} does not start with its signature: {line!r}"
    params = [p.strip() for p in match.group(1).split(",") if p.strip() and p.strip() != "self"]
    return [tuple(p.split("=")[0].split()) for p in params]


def test_the_codes_smddp_sends_are_cupys():
    nccl = _real_nccl()
    assert load_nccl() is nccl
    codes = nccl_dtypes(nccl)
    for dtype, (name, code) in _DTYPE_CODES.items():
        assert getattr(nccl, name) == code == codes[dtype], name
    ops = nccl_ops(nccl, int(nccl.get_version()))
    for op, (name, code) in _OP_CODES.items():
        assert getattr(nccl, name) == code == ops[op], name


@pytest.mark.unit
def test_every_call_smddp_makes_fits_cupys_signature(monkeypatch):
    """The collectives run on the host stand-in, whose communicator checks each call smddp makes
    against the parameters CuPy's real NcclCommunicator documents (its Cython signatures)."""
    nccl = _real_nccl()
    real = nccl.NcclCommunicator
    init = _signature(real.__doc__, "NcclCommunicator")
    assert [p for _, p in init[:3]] == ["ndev", "commId", "rank"] and init[1][0] == "bytes", init
    wanted = {name: _signature(getattr(real, name).__doc__, name)
              for name in ("allReduce", "broadcast", "allGather", "reduceScatter", "send", "recv", "abort",
                           "check_async_error", "destroy")}
    for name in ("get_unique_id", "get_version", "groupStart", "groupEnd"):
        assert callable(getattr(nccl, name)), name
    fake = install(monkeypatch)
    checked = []

    class Checked:
        def __init__(self, comm):
            self._comm = comm

        def __getattr__(self, name):
            method = getattr(self._comm, name)
            if name not in wanted:
                return method

            def call(*args):
                params = wanted[name]
                assert len(args) == len(params), (name, args, params)
                for value, (ctype, param) in zip(args, params):
                    assert type(value) is int, (name, param, ctype, value)  # intptr_t, size_t, int
                checked.append(name)
                return method(*args)

            return call

    make = fake.NcclCommunicator

    def communicator(ndev, uid, rank):
        assert type(uid) is bytes and len(uid) == 128  # the type CuPy's takes ("bytes commId")
        return Checked(make(ndev, uid, rank))

    fake.NcclCommunicator = communicator

    def body(r, engine, nccl_comm):
        t = seeded(r, (4,), torch.float32)
        engine.all_reduce(t, Op.SUM)
        engine.broadcast(torch.ones(3), 0)
        engine.all_gather_into_tensor(torch.zeros(4), torch.ones(2))
        engine.all_to_all_single(torch.zeros(4), torch.ones(4))
        out = torch.zeros(2)
        nccl_comm.reduce_scatter(out, torch.ones(4), Op.SUM, 99)
        engine.barrier()
        return t

    for t in run_ranks(fake, 2, body).values():
        assert torch.equal(t, expected_reduce(2, (4,), torch.float32, Op.SUM, 0))
    assert {"allReduce", "broadcast", "allGather", "reduceScatter", "send", "recv", "check_async_error",
            "destroy"} <= set(checked), sorted(set(checked))


@pytest.mark.unit
def test_a_real_unique_id_goes_through_a_store_and_back_as_cupys_type():
    nccl = _real_nccl()
    master = tdist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    got = {}

    def rank(r: int) -> None:
        store = tdist.PrefixStore("group", tdist.TCPStore("127.0.0.1", master.port, is_master=False,
                                                          timeout=timedelta(seconds=30)))
        topology = Topology(rank=r, size=2, local_rank=r, local_size=2, launcher="torchrun")
        got[r] = share_unique_id(nccl, topology, store, deadline=time.monotonic() + 30)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (1, 0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert type(got[0]) is bytes and len(got[0]) == 128 and got[1] == got[0]
    # CuPy's NcclCommunicator takes it back: what fails here is CUDA (no GPU), never the id's type.
    with pytest.raises(nccl.NcclError):
        nccl.NcclCommunicator(1, got[1], 0)


@pytest.mark.unit
def test_cupys_error_creating_the_communicator_reaches_the_caller_in_words(monkeypatch):
    """No GPU here: CuPy's real ncclCommInitRank raises its NcclError at the group's first
    collective, which smddp hands on as a CollectiveError naming what to check."""
    nccl = _real_nccl()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(lane, "_use_cupy_device", lambda index: None)
    topology = Topology(rank=0, size=1, local_rank=0, local_size=1, launcher="none")
    comm = NCCLCommunicator(Context(topology, timedelta(seconds=30), tdist.HashStore()))
    assert comm._lane is None  # nothing made at init, as torch's NCCL group
    with pytest.raises(CollectiveError) as err:
        comm.barrier(1)
    message = str(err.value)
    assert "NCCL could not create the communicator of rank 0 of 1 on cuda:0" in message, message
    assert "NcclError: NCCL_ERROR" in message and "NCCL_DEBUG=WARN" in message, message
    assert isinstance(err.value.__cause__, nccl.NcclError)
    with pytest.raises(CollectiveError):
        comm.barrier(2)  # the group has no communicator: every later call says so
    comm.close()


def test_smddp_info_imports_torch_before_cupy(tmp_path):
    """A CuPy that records whether torch was loaded first (a CUDA torch brings the NCCL and CUDA
    libraries CuPy must then find): the probe's report says it was."""
    fake = tmp_path / "cupy"
    fake.mkdir()
    (fake / "__init__.py").write_text(
        "import sys\n__version__ = 'after torch' if 'torch' in sys.modules else 'before torch'\n")
    result = python(["-m", "smddp.info.probe"], timeout=120, env={"PYTHONPATH": f"{tmp_path}:{ROOT}"})
    assert result.returncode == 0, result.output
    line = next(line for line in result.stdout.splitlines() if line.startswith(MARKER))
    assert json.loads(line[len(MARKER):])["cupy"]["version"] == "after torch"
