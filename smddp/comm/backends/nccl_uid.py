"""Sharing NCCL's unique id: rank 0 creates it, every rank of a communicator receives it.

CuPy returns the id as ``bytes`` (CuPy >= 14) or as a tuple of C ``char`` values (before),
and its ``NcclCommunicator`` takes back exactly that. Both travel pickled, as mpi4py's
``bcast`` sends them, so the receivers rebuild the same type and values; the ranks of one
job run one CuPy build.
"""

from __future__ import annotations

import itertools
import pickle
from typing import Optional, Tuple, Union

from smddp._topology import Topology
from smddp.errors import BackendUnavailableError

UniqueId = Union[bytes, Tuple[int, ...]]

# Every rank creates its NCCL communicators in the same order, so this per-process count
# names the store key of each one's unique id alike on all ranks (a store that outlives
# one init_process_group() never hands out a stale id).
_generation = itertools.count()


def next_generation() -> int:
    """The number of this process's next NCCL communicator (names its unique id's store key)."""
    return next(_generation)


def share_unique_id(nccl, topology: Topology, store=None, generation: int = 0, mpi_comm=None,
                    key: Optional[str] = None) -> UniqueId:
    """Rank 0's new NCCL unique id, on every rank.

    Sent with an MPI broadcast when ``mpi_comm`` is given or an MPI launcher started the job
    and mpi4py is installed; otherwise through ``store``.

    Args:
        nccl: CuPy's NCCL module (or a stand-in with ``get_unique_id()``).
        topology: this process's topology.
        store: the job's torch store (``set``/``get`` of bytes).
        generation: which communicator of this process the id is for.
        mpi_comm: an mpi4py communicator to broadcast over (default ``COMM_WORLD`` under MPI).
        key: the store key (default one per ``generation``); a subgroup's store is its own,
            and its members may have made different numbers of communicators before.

    Returns:
        The id, as the type ``nccl.get_unique_id()`` returns.

    Raises:
        BackendUnavailableError: more than one rank, no MPI and no store.
    """
    if mpi_comm is None and topology.mpi and _mpi4py_installed():
        from mpi4py import MPI

        mpi_comm = MPI.COMM_WORLD
    if mpi_comm is not None:
        return mpi_comm.bcast(nccl.get_unique_id() if topology.rank == 0 else None, root=0)
    if topology.size == 1:
        return nccl.get_unique_id()
    if store is None:
        raise BackendUnavailableError(
            f"rank {topology.rank} of {topology.size} has no way to share NCCL's unique id: launch with "
            f"mpirun (and pip install 'smddp[mpi]') or torchrun, or pass a store to init_process_group"
        )
    key = key or f"smddp/nccl/{generation}/unique_id"
    if topology.rank == 0:
        uid = nccl.get_unique_id()
        store.set(key, pickle.dumps(uid))
        return uid
    # The job's own store, written by rank 0 above: the same trust as torch's object collectives.
    return pickle.loads(store.get(key))  # noqa: S301


def _mpi4py_installed() -> bool:
    from smddp.comm import _has_module

    return _has_module("mpi4py")
