"""Argument errors and stalls in a real job; each mode runs under a launcher in
``tests/comm/engine/test_stall_reports_and_argument_errors.py``.

``python safety_job.py MODE``; every rank prints ``<WORD> <rank> <rest>`` lines that the test reads:

- ``badargs``: every rank makes the same argument error, one collective after another (the v1
  API and torch's); each must raise the promised error on every rank before anything is sent.
  Then ``AFTER <rank> <ok|values>``: an all-reduce whose result each rank checks itself shows
  the ranks are still in step.
- ``stopped``: DDP where rank 1 stops itself (``SIGSTOP``) before its second backward, after
  writing its pid to ``$SAFETY_PID_FILE``; rank 0 times out in the gradient all-reduce and
  prints ``STALL 0 <error>``.
"""

from __future__ import annotations

import os
import signal
import sys

import torch

torch.set_num_threads(1)

import torch.distributed as tdist  # noqa: E402

import smddp  # noqa: E402
import smddp.torch.distributed as dist  # noqa: E402

MODE = sys.argv[1]


def say(word: str, *rest) -> None:
    print(word, dist.get_rank(), *rest, flush=True)


def expanded(n: int = 4) -> torch.Tensor:
    return torch.ones(1).expand(n)  # n elements, one memory location


def coalesced_untouched() -> None:
    # The first tensor is fine, the second is not: neither may be reduced.
    first = torch.ones(2)
    try:
        tdist.all_reduce_coalesced([first, expanded()])
    finally:
        if first.tolist() != [1.0, 1.0]:
            say("TOUCHED", "coalesced", first.tolist())


def badargs() -> None:
    rank, n = dist.get_rank(), dist.get_world_size()
    own = [2] * n
    own[rank] = 3  # this rank expects 3 elements from itself, and sends itself 2
    cases = {
        # name: (call, the error it must raise, words the message must hold)
        "v1_a2a_own_split": (lambda: dist.all_to_all_single(torch.empty(2 * n + 1), torch.ones(2 * n), own, [2] * n),
                             smddp.InvalidArgumentError, f"rank {rank} sends itself 2 elements but expects 3"),
        "torch_a2a_own_split": (lambda: tdist.all_to_all_single(torch.empty(2 * n + 1), torch.ones(2 * n), own,
                                                                [2] * n),
                                smddp.InvalidArgumentError, f"rank {rank} sends itself 2 elements but expects 3"),
        "torch_a2a_list_own": (lambda: tdist.all_to_all([torch.empty(c) for c in own], [torch.ones(2)] * n),
                               smddp.InvalidArgumentError, f"rank {rank} sends itself 2 elements but expects 3"),
        "v1_all_reduce_expanded": (lambda: dist.all_reduce(expanded()), smddp.InvalidArgumentError,
                                   "tensor.contiguous() or tensor.clone()"),
        "torch_all_reduce_expanded": (lambda: tdist.all_reduce(expanded()), smddp.InvalidArgumentError,
                                      "overlapping memory"),
        "v1_broadcast_expanded": (lambda: dist.broadcast(expanded(), 0), smddp.InvalidArgumentError,
                                  "overlapping memory"),
        "v1_all_gather_expanded": (lambda: dist.all_gather([torch.empty(4)] + [expanded()] * (n - 1), torch.ones(4)),
                                   smddp.InvalidArgumentError, "tensor_list[1] has overlapping memory"),
        "torch_all_gather_into_expanded": (lambda: tdist.all_gather_into_tensor(expanded(4 * n), torch.ones(4)),
                                           smddp.InvalidArgumentError, "output.contiguous()"),
        "torch_reduce_scatter_expanded": (lambda: tdist.reduce_scatter_tensor(expanded(), torch.ones(4 * n)),
                                          smddp.InvalidArgumentError, "overlapping memory"),
        "torch_scatter_expanded": (lambda: tdist.scatter(expanded(), [torch.ones(4)] * n if rank == 0 else None, 0),
                                   smddp.InvalidArgumentError, "overlapping memory"),
        "torch_coalesced_expanded": (coalesced_untouched, smddp.InvalidArgumentError, "overlapping memory"),
        "v1_all_reduce_sparse": (lambda: dist.all_reduce(torch.ones(4).to_sparse()), smddp.InvalidTypeError,
                                 "to_dense()"),
    }
    for name, (call, error, words) in cases.items():
        try:
            call()
        except Exception as exc:  # noqa: BLE001 - the test reads which error it was
            ok = isinstance(exc, error) and words in str(exc)
            say("RAISED" if ok else "WRONG", name, type(exc).__name__, str(exc).replace("\n", " "))
        else:
            say("MISSED", name)
    # Nothing was sent: the ranks are in step, and a collective computes the right thing.
    t = torch.full((4,), float(rank))
    dist.all_reduce(t)
    expected = float(sum(range(n)))
    say("AFTER", "ok" if t.tolist() == [expected] * 4 else t.tolist())


def stopped() -> None:
    from smddp.torch.parallel.distributed import DistributedDataParallel as DDP

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(8, 1))
    for batch in range(2):
        loss = model(torch.randn(4, 8)).sum()  # DDP's forward may run collectives of its own
        if rank == 1 and batch == 1:
            with open(os.environ["SAFETY_PID_FILE"], "w") as f:
                f.write(str(os.getpid()))
            say("STOPPING", os.getpid())
            os.kill(os.getpid(), signal.SIGSTOP)
        try:
            loss.backward()
        except Exception as exc:  # noqa: BLE001 - torch's reducer may wrap the error
            say("STALL", type(exc).__name__, str(exc).replace("\n", " "))
            return
    say("DONE")


if __name__ == "__main__":
    dist.init_process_group()
    {"badargs": badargs, "stopped": stopped}[MODE]()
    say("END")
