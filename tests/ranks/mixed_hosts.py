"""All-reduces of 4 KB to 64 MB across two hosts built differently, checked on every rank.

Usage: ``mixed_hosts.py v1|v2 [largest]`` under mpirun, torchrun or smddprun (``largest``: skip
all-reduces above that many bytes), with the hosts and their builds made by
``FAKE_RANKS_PER_HOST`` and ``FAKE_ENV_<host>`` (see ``fake_hosts.py``): a host without the
compiled core, other ``SMDDP_SHM_*`` sizes, another threshold.

Every rank builds every rank's inputs from its rank (integers, exact in float32 and int64 sums
in any order), so it knows each result without communicating. Prints ``PLANE <rank> <plane>``,
``CORE <rank> native|python``, ``LAYOUT <rank> <slot> <chunk> <one-shot> <threshold> <part>``
(the group's agreed values), ``DIGEST <rank> <sha256 of every result>`` and ``PASSED <rank>``.
"""

from __future__ import annotations

import hashlib
import sys

import fake_hosts  # noqa: F401 - first: it sets this host's variables before smddp is imported
import torch  # noqa: E402

torch.set_num_threads(1)

import torch.distributed as tdist  # noqa: E402

import smddp.torch.distributed as dist  # noqa: E402
import smddp.torch.torch_smddp  # noqa: E402,F401 - registers the "smddp" backend
from smddp.torch import groups  # noqa: E402

# float32 elements: 4 KB, 64 KB, just under and over the 256 KB threshold, 1 MB, 4 MB + 4 bytes
# (a slice cut short), 12 MB (issue 33's abort), 64 MB.
SIZES = [1 << 10, 16 << 10, 60_000, 70_000, 1 << 18, (1 << 20) + 1, 3 << 20, 16 << 20]


def inputs(rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Small integers that depend on the rank and the position (sums exact in every dtype used)."""
    return ((torch.arange(numel, dtype=torch.int64) * 7 + rank * 13 + numel) % 101 - 50).to(dtype)


def main() -> None:
    if sys.argv[1] == "v1":
        dist.init_process_group()
    else:
        tdist.init_process_group(backend="smddp")
    rank, size = dist.get_rank(), dist.get_world_size()
    comm = groups.current().engine.comms["cpu"]
    agreed = comm.layout
    plane = comm.open() if hasattr(comm, "open") else comm._shm  # one host: made at the first collective
    print(f"PLANE {rank} {comm.plane}", flush=True)
    print(f"CORE {rank} {'native' if plane.native else 'python'}", flush=True)
    print(f"LAYOUT {rank} {agreed.slot} {agreed.chunk_bytes} {agreed.one_shot_max} "
          f"{agreed.hierarchical_min_bytes} {plane.part_bytes}", flush=True)
    digest = hashlib.sha256()
    largest = int(sys.argv[2]) if len(sys.argv) > 2 else 1 << 62
    cases = [(numel, torch.float32, dist.ReduceOp.SUM) for numel in SIZES if numel * 4 <= largest]
    cases += [(70_000, torch.int64, dist.ReduceOp.SUM), (70_000, torch.float32, dist.ReduceOp.MAX),
              (300_000, torch.bfloat16, dist.ReduceOp.SUM)]
    for numel, dtype, op in cases:
        stack = torch.stack([inputs(r, numel, dtype) for r in range(size)])
        expected = (stack.amax(0) if op == dist.ReduceOp.MAX else stack.to(torch.float64).sum(0)).to(dtype)
        del stack
        tensor = inputs(rank, numel, dtype)
        dist.all_reduce(tensor, op=op)
        assert torch.equal(tensor, expected), (rank, numel, dtype, op, (tensor != expected).nonzero()[:5].tolist())
        digest.update(tensor.view(torch.uint8).numpy().tobytes())
    print(f"DIGEST {rank} {digest.hexdigest()}", flush=True)
    dist.destroy_process_group()
    print(f"PASSED {rank}", flush=True)


main()
