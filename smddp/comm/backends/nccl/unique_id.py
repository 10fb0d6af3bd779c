"""Sharing NCCL's unique id: rank 0 creates it, every rank of a communicator receives it.

CuPy returns the id as ``bytes`` (CuPy >= 14) or as a tuple of 128 C ``char`` values (before:
signed on x86, unsigned on ARM), and its ``NcclCommunicator`` takes back exactly that. The id
travels as raw bytes, never pickled: one byte saying which form rank 0's CuPy used, then the
128 bytes of ``ncclUniqueId`` (:func:`encode`). Receivers check the length and the form
(:func:`decode`) and rebuild the same type and values; the ranks of one job run one CuPy build.
It goes through the group's store, under a deadline; over MPI (a buffer broadcast, ``Bcast``)
only where there is no store.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Optional, Tuple, Union

from smddp.errors import BackendUnavailableError, CollectiveError
from smddp.job import mca
from smddp.job.topology import Topology
from smddp.job.wire import bcast_bytes

UniqueId = Union[bytes, Tuple[int, ...]]


def unique_id_key(device_type: str = "cuda") -> str:
    """The store key of a group's NCCL unique id, under the group's own store.

    Every group has a store of its own (torch's prefix for the group, under smddp's prefix for
    the world it belongs to), and one NCCL communicator per device type: the key needs nothing
    else. Never a per-process count: ranks that made different numbers of groups (the members
    of a subgroup) would look for different keys. Not the device's index either: the ranks of
    one host use different GPUs.
    """
    return f"smddp/nccl/{device_type}/unique_id"


class UniqueIdTimeout(CollectiveError):
    """Rank 0's unique id did not arrive in the store before the deadline."""


def share_unique_id(nccl, topology: Topology, store=None, mpi_comm=None, key: Optional[str] = None,
                    deadline: Optional[float] = None) -> UniqueId:
    """Rank 0's new NCCL unique id, on every rank.

    Through ``store`` when there is one (every smddp group has one: the wait has a deadline);
    otherwise with an MPI broadcast (``mpi_comm``, or ``COMM_WORLD`` under an MPI launcher).

    Args:
        nccl: CuPy's NCCL module (or a stand-in with ``get_unique_id()``).
        topology: this process's topology in the group.
        store: the group's torch store (``set``/``wait``/``get`` of bytes).
        mpi_comm: an mpi4py communicator to broadcast over when there is no store.
        key: the store key (default :func:`unique_id_key`).
        deadline: ``time.monotonic()`` by which the id must have arrived (store only).

    Returns:
        The id, as the type ``nccl.get_unique_id()`` returns.

    Raises:
        UniqueIdTimeout: the id was not in the store by ``deadline``.
        BackendUnavailableError: more than one rank, no store and no MPI.
    """
    if store is None and topology.size == 1:
        return nccl.get_unique_id()
    if store is not None:
        key = key or unique_id_key()
        if topology.rank == 0:
            uid = nccl.get_unique_id()
            store.set(key, encode(uid))
            return uid
        _wait(store, key, deadline)
        return decode(store.get(key), f"store key {key!r}")
    if mpi_comm is None and topology.mpi and _mpi4py_installed():
        mca.one_host_defaults()
        from mpi4py import MPI

        mpi_comm = MPI.COMM_WORLD
    if mpi_comm is None:
        raise BackendUnavailableError(
            f"rank {topology.rank} of {topology.size} has no way to share NCCL's unique id: launch with "
            f"mpirun (and pip install 'smddp[mpi]') or torchrun, or pass a store to init_process_group"
        )
    if topology.rank == 0:
        uid = nccl.get_unique_id()
        bcast_bytes(mpi_comm, encode(uid), root=0)
        return uid
    return decode(bcast_bytes(mpi_comm, None, root=0), "MPI broadcast from rank 0")


def _wait(store, key: str, deadline: Optional[float]) -> None:
    """Wait for ``key`` in ``store`` until ``deadline`` (the store's own timeout without one)."""
    if deadline is None:
        store.wait([key])
        return
    try:
        store.wait([key], timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
    except Exception as exc:  # noqa: BLE001 - torch's stores raise RuntimeError (DistStoreError) on timeout
        if time.monotonic() >= deadline - 0.01:
            raise UniqueIdTimeout(f"NCCL's unique id (store key {key!r}) did not arrive from rank 0 in time: "
                                  f"{exc}") from exc
        raise


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
    from smddp.comm.needs import has_module

    return has_module("mpi4py")
