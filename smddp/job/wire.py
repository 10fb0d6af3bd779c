"""Small values sent between ranks as plain bytes: nothing received is ever unpickled.

mpi4py's lowercase methods (``bcast``, ``allgather``, ...) pickle what they send and unpickle
what they receive: whoever can write into the job's MPI traffic (a TCP transport between hosts
has no authentication) could then run code in every rank. smddp sends bytes with the buffer
methods (``Bcast``) instead, and decodes them as JSON, or as a fixed layout, that it checks.
"""

from __future__ import annotations

import json
import struct
from typing import Any, Optional

#: The longest message :func:`bcast_bytes` accepts: these are addresses and ids, never data.
MAX_BYTES = 1 << 20

_LENGTH = struct.Struct("!Q")


def bcast_bytes(comm, data: Optional[bytes], root: int = 0) -> bytes:
    """Rank ``root``'s ``data`` on every rank of the mpi4py communicator ``comm``.

    Two buffer broadcasts (the length, then the bytes); no pickling.

    Args:
        comm: an mpi4py communicator.
        data: the bytes to send on ``root``; ignored elsewhere.
        root: the sending rank.

    Returns:
        The bytes ``root`` sent.

    Raises:
        ValueError: ``data`` is not bytes on ``root``, or a length over :data:`MAX_BYTES` is sent
            or received.
    """
    sending = comm.Get_rank() == root
    if sending:
        if not isinstance(data, (bytes, bytearray)):
            raise ValueError(f"bcast_bytes sends bytes, got {type(data).__name__}")
        if len(data) > MAX_BYTES:
            raise ValueError(f"bcast_bytes sends at most {MAX_BYTES} bytes, got {len(data)}")
    header = bytearray(_LENGTH.pack(len(data)) if sending else _LENGTH.size)
    comm.Bcast(header, root=root)
    (length,) = _LENGTH.unpack(bytes(header))
    if length > MAX_BYTES:
        raise ValueError(f"received a length of {length} bytes from rank {root}; at most {MAX_BYTES} are expected")
    body = bytearray(data) if sending else bytearray(length)
    if length:
        comm.Bcast(body, root=root)
    return bytes(body)


def bcast_json(comm, value: Any = None, root: int = 0) -> Any:
    """Rank ``root``'s JSON-encodable ``value`` on every rank (tuples arrive as lists).

    Raises:
        ValueError: what arrived is not JSON (or is too long, see :func:`bcast_bytes`).
    """
    data = json.dumps(value).encode() if comm.Get_rank() == root else None
    return json.loads(bcast_bytes(comm, data, root).decode())
