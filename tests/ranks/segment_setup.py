"""The shared-memory segment's set-up under attack and under failure, in a real mpirun job.

``python segment_setup.py MODE [VICTIM]``; ``SMDDP_SHM_DIR`` is a directory of the test's, so
that everything smddp creates there can be seen. Every rank prints ``<WORD> <rank> <rest>``:

- ``plant VICTIM``: rank 0 creates the segment as usual, but the name the others read from
  the store is a planted one, as anyone who can write to the store could plant it: an absolute
  path, a ``../`` path (both to ``VICTIM``), a link in the shared-memory directory pointing at
  ``VICTIM`` (made by the test), a valid name with no file. Every rank must refuse the set-up
  (``REFUSED``), and a last, clean ``init_process_group`` must run on the plane (``EXACT``).
- ``kill``: rank 1 dies with ``SIGKILL`` between reading the name and mapping the segment;
  the launcher then ends rank 0 (``SIGTERM``), which waits for rank 1 meanwhile.
- ``stall``: rank 1 sleeps there past the timeout: rank 0's wait times out (``WAITED``), and
  rank 1 then finds the segment gone (``MISSING``).

The segment is made at a group's first collective: each mode makes it right after
``init_process_group``, as that collective would (``set_up_plane``).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as tdist

torch.set_num_threads(1)

import smddp  # noqa: E402
import smddp.torch.torch_smddp  # noqa: E402, F401
from smddp.comm.planes import hostmates, shm_segment  # noqa: E402
from smddp.comm.store import make_store  # noqa: E402
from smddp.job.topology import discover  # noqa: E402
from smddp.torch import groups  # noqa: E402

MODE = sys.argv[1]
RANK, SIZE = int(os.environ["OMPI_COMM_WORLD_RANK"]), int(os.environ["OMPI_COMM_WORLD_SIZE"])
SHM_DIR = shm_segment.SHM_DIR


def say(word: str, *rest) -> None:
    print(word, RANK, *rest, flush=True)


def one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".replace("\n", " ")


def set_up_plane() -> None:
    """Make the world's segment now: smddp makes it at the group's first collective."""
    groups.current().engine.comms["cpu"].open()


def plant() -> None:
    victim = sys.argv[2]
    plants = {
        "absolute": victim,
        "dotdot": "../" * 8 + victim.lstrip("/"),
        "link": "smddp-shm-planted-link",  # the test made it: SHM_DIR/smddp-shm-planted-link -> victim
        "missing": "smddp-shm-no-such-segment",
    }
    publish = hostmates.HostChannel.publish
    for kind, planted in plants.items():
        def forged(channel, key, value, planted=planted):
            # The store's "segment" key as the other ranks find it: the attacker's value.
            publish(channel, key, planted if key == "segment" and not value.startswith("!") else value)

        hostmates.HostChannel.publish = forged if RANK == 0 else publish
        try:
            tdist.init_process_group(backend="smddp")
            try:
                set_up_plane()
                say("ACCEPTED", kind)
            finally:
                tdist.destroy_process_group()
        except smddp.SMDDPError as exc:
            say("REFUSED", kind, one_line(exc))
    hostmates.HostChannel.publish = publish
    tdist.init_process_group(backend="smddp")
    size = tdist.get_world_size()
    t = torch.arange(6, dtype=torch.float64) * (RANK + 1)
    tdist.all_reduce(t)
    want = torch.arange(6, dtype=torch.float64) * sum(r + 1 for r in range(size))
    say("EXACT" if torch.equal(t, want) else "WRONG", groups.current().engine.comms["cpu"].plane)
    tdist.destroy_process_group()


def fail_in_set_up(how) -> None:
    read = hostmates.HostChannel.read

    def read_then_fail(channel, key):
        value = read(channel, key)
        if key == "segment" and RANK == 1:
            how()
        return value

    hostmates.HostChannel.read = read_then_fail
    # Held here, so that rank 0's store outlives its failed init_process_group for rank 1.
    store = make_store(discover(os.environ), timedelta(seconds=60))
    try:
        tdist.init_process_group(backend="smddp", store=store, rank=RANK, world_size=SIZE)
        set_up_plane()
        say("INITIALIZED")
    except smddp.SMDDPError as exc:
        text = str(exc)
        say("MISSING" if "is missing from" in text else "WAITED" if "to map its segment" in text else "FAILED",
            one_line(exc))
    from mpi4py import MPI

    MPI.COMM_WORLD.Barrier()  # rank 0 hosts the store: it stays until rank 1 has read it


if MODE == "plant":
    plant()
elif MODE == "kill":
    fail_in_set_up(lambda: os.kill(os.getpid(), signal.SIGKILL))
elif MODE == "stall":
    fail_in_set_up(lambda: time.sleep(float(os.environ["SMDDP_TIMEOUT"]) + 2))
