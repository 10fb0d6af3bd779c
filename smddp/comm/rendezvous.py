"""The job's shared key-value store, from whatever the launcher provides.

- A world of one: an in-process ``HashStore`` (no port is opened).
- An MPI launcher: rank 0 opens a ``TCPStore`` on a free port and sends its address to
  the others with one MPI broadcast, so ``mpirun`` needs no ``MASTER_ADDR``/``MASTER_PORT``.
- Anything else (Slurm, SageMaker hosts, explicit ranks): a ``TCPStore`` at
  ``MASTER_ADDR:MASTER_PORT`` (torchrun's own store is reached through torch's ``env://``).
  That port is fixed for the job, so the store is made once per process and each later
  ``init_process_group`` (after a destroy) uses it under a fresh key prefix: a second server
  on the same port would fail, and old keys must not be read as new ones.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any, Dict, Tuple

import torch.distributed as tdist

from smddp._topology import Topology
from smddp.comm.needs import MPI_INSTALL
from smddp.errors import BackendUnavailableError


def make_store(topology: Topology, timeout: timedelta):
    """A store shared by every rank of the job.

    Raises:
        BackendUnavailableError: no way to meet: not an MPI job and no ``MASTER_ADDR``/``MASTER_PORT``.
    """
    if topology.size == 1:
        return tdist.HashStore()
    if topology.mpi:
        return _store_over_mpi(topology, timeout)
    if not topology.master_addr or not topology.master_port:
        raise BackendUnavailableError(
            f"rank {topology.rank} of {topology.size} ({topology.launcher}) has no rendezvous address: "
            f"set MASTER_ADDR and MASTER_PORT, or launch with mpirun/smddprun"
        )
    key = (topology.master_addr, topology.master_port, topology.size, topology.rank)
    store, generation = _job_stores.get(key, (None, -1))
    if store is None:
        store = tdist.TCPStore(
            topology.master_addr, topology.master_port, topology.size, topology.rank == 0, timeout,
            wait_for_workers=False,
        )
    generation += 1  # every rank initializes the same number of times: the prefixes agree
    _job_stores[key] = (store, generation)
    return tdist.PrefixStore(f"smddp-init-{generation}/", store) if generation else store


#: The job's store at its fixed address, and how many times it was handed out, per address.
_job_stores: Dict[Tuple[Any, ...], Tuple[Any, int]] = {}


def _store_over_mpi(topology: Topology, timeout: timedelta):
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise BackendUnavailableError(
            f"launched by MPI but mpi4py is missing: {MPI_INSTALL}; or set MASTER_ADDR and MASTER_PORT"
        ) from exc
    comm = MPI.COMM_WORLD
    address = None
    store = None
    if comm.Get_rank() == 0:
        host = os.environ.get("MASTER_ADDR") or ("127.0.0.1" if topology.local_size == topology.size else _hostname())
        store = tdist.TCPStore(host, 0, topology.size, True, timeout, wait_for_workers=False)
        address = (host, store.port)
    host, port = comm.bcast(address, root=0)
    if store is None:
        store = tdist.TCPStore(host, port, topology.size, False, timeout)
    return store


def _hostname() -> str:
    import socket

    return socket.getfqdn()
