"""Sharing NCCL's unique id: rank 0 creates it, every rank of a communicator receives it.

CuPy returns the id as ``bytes`` (CuPy >= 14) or as a tuple of 128 C ``char`` values (before:
signed on x86, unsigned on ARM), and its ``NcclCommunicator`` takes back exactly that. The id
travels as raw bytes, never pickled: one byte saying which form rank 0's CuPy used, then the
128 bytes of ``ncclUniqueId`` (:func:`encode`). Receivers check the length and the form
(:func:`decode`) and rebuild the same type and values; the ranks of one job run one CuPy build.
Over MPI it goes by a buffer broadcast (``Bcast``), otherwise through the job's store.
"""

from __future__ import annotations

import itertools
from typing import Optional, Tuple, Union

from smddp import _mca
from smddp._topology import Topology
from smddp._wire import bcast_bytes
from smddp.errors import BackendUnavailableError, CollectiveError

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
        _mca.one_host_defaults()
        from mpi4py import MPI

        mpi_comm = MPI.COMM_WORLD
    if mpi_comm is not None:
        if topology.rank == 0:
            uid = nccl.get_unique_id()
            bcast_bytes(mpi_comm, encode(uid), root=0)
            return uid
        return decode(bcast_bytes(mpi_comm, None, root=0), "MPI broadcast from rank 0")
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
        store.set(key, encode(uid))
        return uid
    return decode(store.get(key), f"store key {key!r}")


#: ``sizeof(ncclUniqueId)`` (``NCCL_UNIQUE_ID_BYTES``).
ID_BYTES = 128
#: The first byte of an encoded id: the form rank 0's CuPy returned it in.
_BYTES, _SIGNED, _UNSIGNED = b"B", b"s", b"u"


def encode(uid: UniqueId) -> bytes:
    """``uid`` as :data:`ID_BYTES` + 1 raw bytes: its form (bytes, signed or unsigned chars), then the id.

    Raises:
        CollectiveError: ``uid`` is not 128 bytes or 128 char values.
    """
    if isinstance(uid, (bytes, bytearray)) and len(uid) == ID_BYTES:
        return _BYTES + bytes(uid)
    if isinstance(uid, tuple) and len(uid) == ID_BYTES and all(type(v) is int for v in uid):
        if all(-128 <= v < 128 for v in uid) and any(v < 0 for v in uid):
            return _SIGNED + bytes(v & 0xFF for v in uid)
        if all(0 <= v < 256 for v in uid):
            return _UNSIGNED + bytes(uid)
    raise CollectiveError(
        f"NCCL's unique id from CuPy is not {ID_BYTES} bytes or {ID_BYTES} char values: "
        f"{type(uid).__name__} of length {len(uid) if hasattr(uid, '__len__') else '?'}"
    )


def decode(data, source: str) -> UniqueId:
    """The unique id :func:`encode` wrote, in the form rank 0's CuPy returned it.

    Args:
        data: the bytes received.
        source: where they came from, for the error.

    Raises:
        CollectiveError: ``data`` is not an id smddp encoded (wrong length or form); nothing in
            it is run or unpickled.
    """
    if isinstance(data, (bytes, bytearray)) and len(data) == ID_BYTES + 1:
        form, raw = bytes(data[:1]), bytes(data[1:])
        if form == _BYTES:
            return raw
        if form == _UNSIGNED:
            return tuple(raw)
        if form == _SIGNED:
            return tuple(v - 256 if v >= 128 else v for v in raw)
    size = len(data) if isinstance(data, (bytes, bytearray)) else type(data).__name__
    raise CollectiveError(
        f"the NCCL unique id received from {source} is malformed ({size} bytes; smddp sends {ID_BYTES + 1}: "
        f"a form byte and the {ID_BYTES}-byte id) and was refused. Something other than this job's rank 0 "
        f"wrote it, or the ranks run different smddp versions: run one smddp version on every rank, and "
        f"keep the job's store (MASTER_ADDR:MASTER_PORT) reachable only by the job"
    )


def _mpi4py_installed() -> bool:
    from smddp.comm import _has_module

    return _has_module("mpi4py")
