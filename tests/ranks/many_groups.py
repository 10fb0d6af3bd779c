"""Many process groups in one job: what each costs, and nothing left once they are destroyed.

Run by tests/torch/test_groups.py under torchrun (the store's host is torchrun's agent)::

    python many_groups.py GROUPS [--files N] [--backend smddp|gloo]

Each rank (``--files N``: first sets its own soft limit of open files to N, as a launcher's shell
would with ``ulimit -n N``) makes ``GROUPS`` groups of every rank with ``torch.distributed.new_group``,
keeps them all alive, runs one all-reduce on each (checked against the sum of every rank's seeded
input), then destroys them and checks that its open files and threads are what they were before the
first group and that it maps no shared-memory segment. Prints ``CHECK``/``FAILED`` lines, then on
rank 0 ``STORE 0 <n>`` (the connections the store's host holds at the peak, counted on its port) and
``PEAK 0 <files> <threads>``, then ``PASSED`` (exit 0) or ``FAILURES`` (exit 1).
"""

from __future__ import annotations

import argparse
import os
import resource
import sys

import torch
import torch.distributed as tdist
from checklist import Checklist, say

import smddp.torch.torch_smddp  # noqa: F401 - registers the "smddp" backend
from smddp.comm.planes import shm_segment

parser = argparse.ArgumentParser()
parser.add_argument("groups", type=int)
parser.add_argument("--files", type=int, default=0)
parser.add_argument("--backend", default="smddp")
args = parser.parse_args()
if args.files:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (args.files, hard))

torch.set_num_threads(1)
tdist.init_process_group(args.backend)
rank, size = tdist.get_rank(), tdist.get_world_size()
checklist = Checklist(rank)


def files() -> int:
    return len(os.listdir("/proc/self/fd"))


def threads() -> int:
    return len(os.listdir("/proc/self/task"))


def store_connections(port: int) -> int:
    """Established TCP connections whose local port is ``port`` (the store's host's side)."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            next(f)
            for line in f:
                fields = line.split()
                count += fields[3] == "01" and int(fields[1].rsplit(":", 1)[1], 16) == port
    return count


tdist.all_reduce(torch.zeros(1))
tdist.barrier()
before = (files(), threads())
made = [tdist.new_group(list(range(size))) for _ in range(args.groups)]
wrong = 0
for i, group in enumerate(made):
    rows = torch.randint(-1000, 1000, (size, 8), generator=torch.Generator().manual_seed(i)).double()
    t = rows[rank].clone()
    tdist.all_reduce(t, group=group)
    wrong += not torch.equal(t, rows.sum(0))
del group
checklist.check(f"{args.groups} groups alive at once, one all-reduce each, every result exact", wrong == 0,
                f"{wrong} wrong")
tdist.barrier()
peak = (files(), threads())
if rank == 0:
    say(f"STORE {rank} {store_connections(int(os.environ['MASTER_PORT']))}")
    say(f"PEAK {rank} {peak[0] - before[0]} {peak[1] - before[1]}")
for group in made:
    tdist.destroy_process_group(group)
del made, group
tdist.barrier()
after = (files(), threads())
checklist.check("once destroyed, the groups hold no file open", after[0] <= before[0], f"{before[0]} -> {after[0]}")
checklist.check("once destroyed, the groups hold no thread", after[1] <= before[1], f"{before[1]} -> {after[1]}")
checklist.check("once destroyed, the groups map no shared memory",
                shm_segment.held() <= shm_segment.segment_bytes(size),
                f"{shm_segment.held()} bytes held")  # the world's own segment may remain
status = checklist.summary()
tdist.destroy_process_group()
sys.exit(status)
