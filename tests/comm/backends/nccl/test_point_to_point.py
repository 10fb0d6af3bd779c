"""Point-to-point messages on the ``nccl`` backend: refused, with what to use, never handed to torch's NCCL group.

A send or receive of CUDA tensors on smddp's ``nccl`` backend (CuPy's NCCL) used to go to the
group's torch-native backend (torch's NCCL group): a second NCCL communicator on the GPU, beside
CuPy's, whose kernels and CuPy's can wait on each other across ranks (a pipeline's hang). The
backend refuses them instead, naming the backend that has them
(smddp/comm/backends/nccl/communicator.py, ``NCCLCommunicator.send``). Ranks are threads on the
host-memory stand-in (tests/helpers/nccl_ranks.py).
"""

from __future__ import annotations

import pytest
import torch
from nccl_ranks import expected_reduce, run_ranks, seeded
from nccl_standin import install
from torch._C._distributed_c10d import FakeProcessGroup

from smddp import _compat
from smddp.comm.reduction import Op
from smddp.errors import BackendUnavailableError, CollectiveError
from smddp.torch.process_group import SmddpProcessGroup

pytestmark = pytest.mark.unit  # in-process, no job started: the fast tier


def test_send_and_recv_are_refused_and_never_reach_torchs_group(monkeypatch):
    """The group has a torch-native backend for the tensors' device (a C++ one that would take them):
    send, recv and a receive from any rank are refused by smddp's backend, with what to use instead,
    and the ranks' collectives go on."""
    fake = install(monkeypatch)

    def body(r, engine, nccl_comm):
        group = SmddpProcessGroup(engine, r, 2)
        native = FakeProcessGroup._create_internal(r, 2, FakeProcessGroup.Options())
        _compat.register_device_backend(group, "cpu", "CUSTOM", native)  # the stand-in's tensors are CPU ones
        refused = []
        t = seeded(r, (4,), torch.float32, 1)
        for call in (lambda: group.send([t], 1 - r, 0), lambda: group.recv([t], 1 - r, 0),
                     lambda: group.recv_anysource([t], 0)):
            with pytest.raises(CollectiveError) as err:
                call()
            refused.append(err.value)
        engine.all_reduce(t, Op.SUM)
        return refused, t

    for r, (refused, t) in run_ranks(fake, 2, body).items():
        for error, what in zip(refused, ("send", "recv", "recv")):
            message = str(error)
            assert not isinstance(error, BackendUnavailableError), message  # that one falls back to torch's
            assert message.startswith(f"{what}: the 'nccl' backend (CuPy's NCCL) has no point-to-point"), message
            assert "second NCCL communicator" in message and "SMDDP_BACKEND unset" in message, message
        assert torch.equal(t, expected_reduce(2, (4,), torch.float32, Op.SUM, 1)), r
