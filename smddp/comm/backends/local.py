"""The ``local`` backend: a world of one process, for a plain ``python train.py``.

Nothing leaves the process and no port is opened; every collective is what it would be
with one rank (a reduction is the identity, a gather a copy).
"""

from __future__ import annotations

from typing import Sequence

import torch

from smddp.comm.base import DONE, Communicator, Pending
from smddp.comm.reduction import Op, check_reduction


class LocalCommunicator(Communicator):
    """Collectives over a world of one."""

    name = "local"
    device_types = ("cpu", "cuda", "xpu")
    dtypes = Communicator.dtypes | {torch.int16, torch.bool, torch.complex64, torch.complex128}

    def all_reduce(self, tensor: torch.Tensor, op: Op, tag: int) -> Pending:
        check_reduction(tensor.dtype, op)  # refused as on any plane of more ranks
        return DONE

    def broadcast(self, tensor: torch.Tensor, src: int, tag: int) -> Pending:
        return DONE

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, tag: int) -> Pending:
        output.copy_(input)
        return DONE

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_counts: Sequence[int],
        input_counts: Sequence[int],
        tag: int,
    ) -> Pending:
        output.copy_(input)
        return DONE

    def barrier(self, tag: int) -> Pending:
        return DONE
