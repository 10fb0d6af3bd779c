"""The job's shared key-value store, from whatever the launcher provides.

- A world of one: an in-process ``HashStore`` (no port is opened).
- An MPI launcher without ``MASTER_ADDR``/``MASTER_PORT``: rank 0 opens a ``TCPStore`` on a
  free port and sends its address to the others with one MPI broadcast (JSON, never a pickle).
- Anything else (smddprun, Slurm, SageMaker hosts, explicit ranks): a ``TCPStore`` at
  ``MASTER_ADDR:MASTER_PORT`` (torchrun's own store is reached through torch's ``env://``).
  That port is fixed for the job, so the store is made once per process and each later
  ``init_process_group`` (after a destroy) uses it under a fresh key prefix
  (:func:`world_namespace`): a second server on the same port would fail, and old keys must
  not be read as new ones.

A store can outlive a world: a destroy and a new ``init_process_group`` in one process, or
torchrun's agent store, which every restart attempt shares (torch's own ``env://`` no longer
prefixes attempts, pytorch/pytorch#135712). :func:`world_namespace` is the key prefix that
makes one world's keys its own in such a store.

The store has no authentication, so rank 0 listens only where it must (:mod:`smddp.job.sockets`):
on loopback when the job is on one host, on ``SMDDP_SOCKET_IFNAME``'s address when set, and on
every interface (torch's default) only for a job across hosts without it.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any, Dict, Mapping, Tuple

import torch.distributed as tdist

from smddp.comm.needs import MPI_INSTALL
from smddp.errors import BackendUnavailableError, InvalidArgumentError
from smddp.job import mca, runtime, sockets
from smddp.job.topology import Topology
from smddp.job.wire import bcast_json


def make_store(topology: Topology, timeout: timedelta):
    """A store shared by every rank of the job.

    Raises:
        BackendUnavailableError: no way to meet: not an MPI job and no ``MASTER_ADDR``/``MASTER_PORT``.
    """
    if topology.size == 1:
        return tdist.HashStore()
    if topology.mpi and not (topology.master_addr and topology.master_port):
        return _store_over_mpi(topology, timeout)
    if not topology.master_addr or not topology.master_port:
        raise BackendUnavailableError(
            f"rank {topology.rank} of {topology.size} ({topology.launcher}) has no rendezvous address: "
            f"set MASTER_ADDR and MASTER_PORT, or launch with mpirun/smddprun"
        )
    key = (topology.master_addr, topology.master_port, topology.size, topology.rank)
    store = _job_stores.get(key)
    if store is None and topology.rank == 0:
        store = server_store(topology.master_addr, topology.master_port, topology, timeout)
    elif store is None:
        store = tdist.TCPStore(topology.master_addr, topology.master_port, topology.size, False, timeout)
    _job_stores[key] = store
    # Any backend's keys (torch's gloo too, which this rendezvous also serves) are this world's.
    return tdist.PrefixStore(world_namespace(), store)


#: The job's store at its fixed address, per address: made once per process.
_job_stores: Dict[Tuple[Any, ...], Any] = {}

#: Worlds this process has begun (:func:`world_namespace`).
_worlds_begun = 0


def world_namespace(env: Mapping[str, str] = os.environ) -> str:
    """A key prefix that no earlier world sharing a store used; each call gives a new one.

    It names the torchrun restart attempt where the store is the one torchrun's agent keeps
    for every attempt (``TORCHELASTIC_USE_AGENT_STORE``; ``TORCHELASTIC_RESTART_COUNT``): a
    restarted attempt never reads the keys a failed one left. Only there: across nodes the
    count is each node's own (a node restarted for a membership change keeps it,
    pytorch/pytorch#108158), and a store made per attempt needs no such key. The prefix also
    names how many times this process has called this function. That count is kept by each
    process, and it agrees across ranks only because it is called where a world begins (a
    rendezvous, the world group's creation), which every rank reaches the same number of
    times in the same order: ``init_process_group`` is collective. Never call it per
    subgroup or per engine: ranks make different numbers of those.

    Args:
        env: the environment (torchrun's).

    Returns:
        ``"smddp/<attempt>.<count>/"`` (attempt 0 where the store is not torchrun's agent's).
    """
    global _worlds_begun
    _worlds_begun += 1
    attempt = env.get("TORCHELASTIC_RESTART_COUNT", "")
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != str(True) or not attempt.isdigit():
        attempt = "0"
    return f"smddp/{attempt}.{_worlds_begun}/"


def server_store(host: str, port: int, topology: Topology, timeout: timedelta):
    """Rank 0's ``TCPStore``, reached by the others at ``host:port``, listening only where it must.

    Args:
        host: the address the other ranks connect to.
        port: the port (0: a free one).
        topology: the job (whether it is on one host decides the address listened on).
        timeout: the store's timeout.

    Raises:
        InvalidArgumentError: the port is taken, or ``SMDDP_SOCKET_IFNAME`` names no usable interface.
    """
    bind = sockets.store_address(host, sockets.one_host(topology))
    # multi_tenant, as torch's own env:// and tcp:// stores: a later torch store on the same port
    # in this process (init_method="tcp://MASTER_ADDR:MASTER_PORT") shares this server.
    if bind is None:
        return tdist.TCPStore(host, port, topology.size, True, timeout, wait_for_workers=False, multi_tenant=True)
    sock = sockets.listening_socket(bind, port)
    port = sock.getsockname()[1]
    fd = sock.detach()  # the store owns the descriptor from here
    try:
        # torch would bind its server to every interface; adopting this socket keeps it on ``bind``.
        return tdist.TCPStore(host, port, topology.size, True, timeout, wait_for_workers=False,
                              multi_tenant=True, master_listen_fd=fd)
    except BaseException:
        os.close(fd)
        raise


def _store_over_mpi(topology: Topology, timeout: timedelta):
    mca.one_host_defaults()
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
        host = os.environ.get("MASTER_ADDR") or runtime.local_address(topology)
        store = server_store(host, 0, topology, timeout)
        address = [host, store.port]
    # As JSON in a buffer broadcast: mpi4py's lowercase bcast would unpickle what arrives.
    got = bcast_json(comm, address, root=0)
    if not (isinstance(got, list) and len(got) == 2 and isinstance(got[0], str) and type(got[1]) is int):
        raise InvalidArgumentError(f"rank 0 sent a malformed store address over MPI: {got!r}")
    if store is None:
        store = tdist.TCPStore(got[0], got[1], topology.size, False, timeout)
    return store
