"""All-reduces checked on every rank, and the CPU plane the job took; run by tests/comm/planes/test_every_launcher.py.

``python plane_report.py v1|v2|spawn|spawn-hosts``: ``v1`` initializes with smddp's own
``init_process_group()``, ``v2`` with ``torch.distributed.init_process_group(backend="smddp")``
(the launcher's ``env://``), ``spawn`` starts two processes itself with
``torch.multiprocessing.spawn`` and ``env://`` on a free loopback port. ``spawn-hosts`` is
multi-node ``mp.spawn``: run once on each of two hosts with ``SPAWN_NODE`` (0 or 1),
``MASTER_ADDR`` and ``MASTER_PORT``, it starts two processes that pass only their rank and the
world size (4) to ``init_process_group``: nothing in their environment says where the others are. Every rank all-reduces
seeded integer-valued tensors of 4 KB to 16 MB (sums of them are exact in float32, so the
expected result is computed here, without communication) and prints
``PLANE <rank> <backend> <plane>``, ``CPUS <rank> <the CPUs it may run on, comma-separated>`` and
``PASSED <rank>``.
"""

from __future__ import annotations

import os
import socket
import sys

import torch
import torch.distributed as tdist

import smddp.torch.distributed as dist
import smddp.torch.torch_smddp  # noqa: F401 - registers the "smddp" backend
from smddp.torch import groups

SIZES = [1 << 10, 16 << 10, 256 << 10, 4 << 20]  # float32 elements: 4 KB, 64 KB, 1 MB, 16 MB


def inputs(rank: int, numel: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * rank + numel % 997)
    return torch.randint(-1000, 1000, (numel,), generator=gen).float()


def check(rank: int, size: int) -> None:
    for numel in SIZES:
        expected = sum(inputs(r, numel) for r in range(size))
        t = inputs(rank, numel)
        tdist.all_reduce(t)
        assert torch.equal(t, expected), (rank, numel)
        t = inputs(rank, numel)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        assert torch.equal(t, torch.stack([inputs(r, numel) for r in range(size)]).amax(0)), (rank, numel)
    comm = groups.current().engine.comms["cpu"]
    # One write per line: processes that share the pipe cannot split it.
    print(f"PLANE {rank} {comm.name} {comm.plane}\n", end="", flush=True)
    print(f"CPUS {rank} {','.join(map(str, sorted(os.sched_getaffinity(0))))}\n", end="", flush=True)
    dist.destroy_process_group()
    print(f"PASSED {rank}\n", end="", flush=True)


def spawned(rank: int, size: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(size),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(size))
    tdist.init_process_group(backend="smddp", init_method="env://", rank=rank, world_size=size)
    check(rank, size)


def spawned_on_host(local: int, node: int, per_node: int, nodes: int) -> None:
    rank, size = node * per_node + local, nodes * per_node
    tdist.init_process_group(backend="smddp", init_method="env://", rank=rank, world_size=size)
    check(rank, size)


def main(mode: str) -> None:
    if mode == "spawn-hosts":
        torch.multiprocessing.spawn(spawned_on_host, args=(int(os.environ["SPAWN_NODE"]), 2, 2), nprocs=2, join=True)
        return
    if mode == "spawn":
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        torch.multiprocessing.spawn(spawned, args=(2, port), nprocs=2, join=True)
        return
    if mode == "v1":
        dist.init_process_group()
    else:
        tdist.init_process_group(backend="smddp")
    check(dist.get_rank(), dist.get_world_size())


if __name__ == "__main__":
    main(sys.argv[1])
