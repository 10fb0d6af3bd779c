"""The ``nccl`` backend: NCCL through CuPy's bindings (``cupy.cuda.nccl``), on CUDA tensors.

The default on CUDA machines. How it runs:

- Start-up: the CUDA device is set from the local rank (or ``ctx.device``) *before* the
  NCCL communicator is created, because NCCL binds a communicator to the current device.
  Rank 0 creates NCCL's unique id and sends it with an MPI broadcast when an MPI launcher
  started the job (and mpi4py is there), else through the job's torch store.
- Calls: each collective passes ``tensor.data_ptr()`` and the CUDA stream it runs on to
  NCCL, which enqueues the work and returns at once. By default that stream is torch's
  current stream, so a kernel the user queued before the collective is seen by it and
  a kernel queued after sees its result, without any host synchronisation.
  ``SMDDP_NCCL_STREAM=side`` runs collectives on one side stream instead (ordered after
  the current stream with an event), which lets torch's DDP overlap gradient reduction
  with backward, as torch's own NCCL group does.
- Completion: a collective's :class:`Pending` is stream-aware, with the contract of
  torch's NCCL ``Work.wait()``: once ``test()`` returns True, every kernel the caller
  queues afterwards on its current stream runs after the collective. ``test()`` returns
  True at once; if the caller's current stream is not the one the collective ran on, it
  first makes that stream wait on the collective's CUDA event, and so does every later
  wait on the handle (the caller may wait from another stream). The host never blocks
  (``query()`` and ``synchronize()`` on the Pending are there for code that must).
  NCCL's asynchronous errors (a peer that died) are checked on every ``test()``.
  ``barrier()`` does block the host until every rank arrived, as torch's NCCL barrier does
  (a one-element all_reduce, polled with the engine's deadline).
- Teardown: a last barrier, polled with the job's timeout, then ``destroy()``; a broken
  job (an asynchronous NCCL error, or the barrier not completing) is ``abort()``-ed so no
  rank hangs in teardown.
"""

from __future__ import annotations

import itertools
import os
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch

from smddp._topology import Topology
from smddp.comm.base import Communicator, Context, Op, Pending, average
from smddp.comm.devices import CUDA_INSTALL, check_device, pick_device, with_cpu_companion
from smddp.errors import BackendUnavailableError, CollectiveError, InvalidArgumentError

#: NCCL's ``ncclDataType_t`` values (nccl.h), used where CuPy lacks the constant
#: (older CuPy has no ``NCCL_BFLOAT16``).
_DTYPE_CODES: Dict[torch.dtype, Tuple[str, int]] = {
    torch.int8: ("NCCL_INT8", 0),
    torch.uint8: ("NCCL_UINT8", 1),
    torch.int32: ("NCCL_INT32", 2),
    torch.int64: ("NCCL_INT64", 4),
    torch.float16: ("NCCL_FLOAT16", 6),
    torch.float32: ("NCCL_FLOAT32", 7),
    torch.float64: ("NCCL_FLOAT64", 8),
    torch.bfloat16: ("NCCL_BFLOAT16", 9),
}

#: NCCL's ``ncclRedOp_t`` values (nccl.h).
_OP_CODES: Dict[Op, Tuple[str, int]] = {
    Op.SUM: ("NCCL_SUM", 0),
    Op.PRODUCT: ("NCCL_PROD", 1),
    Op.MAX: ("NCCL_MAX", 2),
    Op.MIN: ("NCCL_MIN", 3),
    Op.AVERAGE: ("NCCL_AVG", 4),
}

#: ``nccl.get_version()`` of NCCL 2.10, which added ``ncclAvg`` and ``ncclBfloat16``
#: (the code is major * 10000 + minor * 100 + patch since 2.9).
NCCL_2_10 = 21000

#: Environment variable choosing the stream collectives run on: ``current`` or ``side``.
STREAM_ENV = "SMDDP_NCCL_STREAM"

UniqueId = Union[bytes, Tuple[int, ...]]

# Every rank creates its NCCL communicators in the same order, so this per-process count
# names the store key of each one's unique id alike on all ranks (a store that outlives
# one init_process_group() never hands out a stale id).
_generation = itertools.count()


# ---------------------------------------------------------------------------- CuPy
def load_nccl():
    """CuPy's NCCL module, ``cupy.cuda.nccl``.

    Raises:
        BackendUnavailableError: CuPy is not installed, or it cannot load libnccl (the
            message says what to install, and that ``torch-nccl`` needs neither).
    """
    try:
        from cupy.cuda import nccl
    except Exception as exc:  # noqa: BLE001 - CuPy raises ImportError, or RuntimeError without CUDA
        raise BackendUnavailableError(
            f"the 'nccl' backend needs CuPy, which cannot be imported ({exc}): {CUDA_INSTALL}. "
            f"Or set SMDDP_BACKEND=torch-nccl to use torch's own NCCL group."
        ) from exc
    if not getattr(nccl, "available", True) or not hasattr(nccl, "NcclCommunicator"):
        raise BackendUnavailableError(
            "CuPy is installed but cannot load the NCCL library (libnccl.so.2): import torch first "
            "(CUDA builds of torch bring NCCL), or pip install nvidia-nccl-cu12 (CUDA 13: "
            "nvidia-nccl-cu13), or run: python -m cupyx.tools.install_library --library nccl --cuda 12.x. "
            "Or set SMDDP_BACKEND=torch-nccl to use torch's own NCCL group."
        )
    return nccl


def nccl_dtypes(nccl) -> Dict[torch.dtype, int]:
    """torch dtype to NCCL data type code, from CuPy's constants where it has them."""
    return {dtype: int(getattr(nccl, name, code)) for dtype, (name, code) in _DTYPE_CODES.items()}


def nccl_ops(nccl, version: int) -> Dict[Op, Optional[int]]:
    """:class:`Op` to NCCL reduction code; AVERAGE maps to None before NCCL 2.10 (sum, then divide)."""
    ops: Dict[Op, Optional[int]] = {op: int(getattr(nccl, name, code)) for op, (name, code) in _OP_CODES.items()}
    if version < NCCL_2_10:
        ops[Op.AVERAGE] = None
    return ops


# ---------------------------------------------------------------------------- unique id
def encode_unique_id(uid: UniqueId) -> bytes:
    """Bytes for a store that decode back to exactly what ``get_unique_id()`` returned.

    CuPy >= 14 returns the id as ``bytes``; before, as a tuple of C ``char`` values, which
    are signed (-128..127) on x86 and unsigned (0..255) on ARM. A tuple is sent as its
    bytes plus a flag saying whether any value was negative, so the receiver rebuilds
    values that CuPy's ``NcclCommunicator`` accepts on the same platform.
    """
    if isinstance(uid, (bytes, bytearray)):
        return b"B" + bytes(uid)
    values = [int(v) for v in uid]
    if any(not -128 <= v <= 255 for v in values):
        raise InvalidArgumentError("an NCCL unique id holds byte values (-128..255)")
    return (b"S" if any(v < 0 for v in values) else b"U") + bytes(v & 0xFF for v in values)


def decode_unique_id(payload: bytes) -> UniqueId:
    """The id :func:`encode_unique_id` encoded, as the same type and values.

    Raises:
        CollectiveError: the payload was not written by :func:`encode_unique_id`.
    """
    payload = bytes(payload)
    kind, raw = payload[:1], payload[1:]
    if kind == b"B":
        return raw
    if kind == b"S":
        return tuple(b - 256 if b > 127 else b for b in raw)
    if kind == b"U":
        return tuple(raw)
    raise CollectiveError(f"the store holds no NCCL unique id in smddp's format (starts with {payload[:8]!r})")


def share_unique_id(nccl, topology: Topology, store=None, generation: int = 0, mpi_comm=None,
                    key: Optional[str] = None) -> UniqueId:
    """Rank 0's new NCCL unique id, on every rank.

    Sent with an MPI broadcast (mpi4py's pickling ``bcast``, which keeps bytes or tuple as
    they are) when ``mpi_comm`` is given or an MPI launcher started the job and mpi4py is
    installed; otherwise through ``store``.

    Args:
        nccl: CuPy's NCCL module (or a stand-in with ``get_unique_id()``).
        topology: this process's topology.
        store: the job's torch store (``set``/``get`` of bytes).
        generation: which communicator of this process the id is for.
        mpi_comm: an mpi4py communicator to broadcast over (default ``COMM_WORLD`` under MPI).
        key: the store key (default one per ``generation``); a subgroup's store is its own,
            and its members may have made different numbers of communicators before.

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
        store.set(key, encode_unique_id(uid))
        return uid
    return decode_unique_id(store.get(key))


def _mpi4py_installed() -> bool:
    from smddp.comm import _has_module

    return _has_module("mpi4py")


# ---------------------------------------------------------------------------- all_to_all plan
def all_to_all_plan(
    rank: int, size: int, output_counts: Sequence[int], input_counts: Sequence[int]
) -> Tuple[List[Tuple[str, int, int, int]], Optional[Tuple[int, int, int]]]:
    """The point-to-point calls of one ``all_to_all_single``, with offsets in elements.

    Args:
        rank: this rank.
        size: the world size.
        output_counts: elements to receive from each rank.
        input_counts: elements to send to each rank.

    Returns:
        ``(calls, own)``: ``calls`` is a list of ``("send" | "recv", peer, offset, count)``
        for every other peer with a non-zero count; ``own`` is ``(output_offset,
        input_offset, count)`` for this rank's own slice, or None when it is empty.

    Raises:
        InvalidArgumentError: the counts are not one per rank, or this rank's own send and
            receive counts differ.
    """
    if len(output_counts) != size or len(input_counts) != size:
        raise InvalidArgumentError(
            f"all_to_all_single: need {size} counts each way, got {len(input_counts)} and {len(output_counts)}"
        )
    if output_counts[rank] != input_counts[rank]:
        raise InvalidArgumentError(
            f"all_to_all_single: rank {rank} sends {input_counts[rank]} elements to itself but expects "
            f"{output_counts[rank]}"
        )
    calls: List[Tuple[str, int, int, int]] = []
    own = None
    in_offset = out_offset = 0
    for peer in range(size):
        send, recv = int(input_counts[peer]), int(output_counts[peer])
        if peer == rank:
            if send:
                own = (out_offset, in_offset, send)
        else:
            if send:
                calls.append(("send", peer, in_offset, send))
            if recv:
                calls.append(("recv", peer, out_offset, recv))
        in_offset += send
        out_offset += recv
    return calls, own


def stream_mode(env=None) -> str:
    """``"current"`` (default) or ``"side"``, from ``SMDDP_NCCL_STREAM``.

    Raises:
        InvalidArgumentError: another value.
    """
    value = (os.environ if env is None else env).get(STREAM_ENV, "current").strip().lower() or "current"
    if value not in ("current", "side"):
        raise InvalidArgumentError(f"{STREAM_ENV}={value!r}: use 'current' (default) or 'side'")
    return value


# ---------------------------------------------------------------------------- completion
class StreamOrdered(Pending):
    """A collective enqueued on a CUDA stream: done for every kernel queued after it.

    Attributes:
        event: the CUDA event recorded right after the collective.
    """

    __slots__ = ("_owner", "_stream", "event")

    def __init__(self, owner: NCCLCommunicator, stream, event):
        self._owner, self._stream, self.event = owner, stream, event

    def test(self) -> bool:
        self._owner.check_async_error()
        self.order_current_stream()
        return True

    def stream_aware(self) -> bool:
        return True

    def waited(self) -> None:
        self.order_current_stream()

    def order_current_stream(self) -> None:
        """Make the caller's current stream wait for the collective, if it ran on another one.

        ``test()`` does this; a caller that waits again later, from another stream, calls it
        too. The host does not wait.
        """
        current = torch.cuda.current_stream(self._stream.device)
        if current.cuda_stream != self._stream.cuda_stream:
            current.wait_event(self.event)

    def query(self) -> bool:
        """True once the GPU has finished the collective (the host does not wait)."""
        return self.event.query()

    def synchronize(self) -> None:
        """Block the host until the GPU has finished the collective."""
        self.event.synchronize()


class HostPolled(Pending):
    """A collective whose ``test()`` is True only once the GPU finished it (barrier)."""

    __slots__ = ("_owner", "event")

    def __init__(self, owner: NCCLCommunicator, event):
        self._owner, self.event = owner, event

    def test(self) -> bool:
        self._owner.check_async_error()
        return self.event.query()


# ---------------------------------------------------------------------------- communicator
class NCCLCommunicator(Communicator):
    """Collectives on CUDA tensors through NCCL, called with CuPy's bindings.

    Attributes:
        device: this rank's CUDA device.
        nccl_version: NCCL's runtime version code (``22703`` is 2.27.3).
        stream_mode: ``"current"`` or ``"side"`` (see ``SMDDP_NCCL_STREAM``).
    """

    name = "nccl"
    device_types = ("cuda",)

    @classmethod
    def build(cls, ctx: Context) -> Dict[str, Communicator]:
        """This communicator for CUDA tensors and a CPU communicator (mpi, gloo or local) for CPU ones."""
        return with_cpu_companion("cuda", cls, ctx)

    def __init__(self, ctx: Context, unique_id_key: Optional[str] = None):
        """Set this rank's CUDA device and join the job's NCCL communicator.

        ``unique_id_key``: the store key of the unique id (subgroups; see :func:`share_unique_id`).

        Raises:
            BackendUnavailableError: no CUDA device, CuPy or NCCL missing (the message says
                what to install), or no way to share the unique id.
        """
        super().__init__(ctx)
        if not torch.cuda.is_available():
            raise BackendUnavailableError(
                f"the 'nccl' backend needs a CUDA GPU and torch {torch.__version__} sees none "
                f"(CUDA build: {torch.version.cuda or 'no'}); use 'gloo' or 'mpi' for CPU tensors"
            )
        self.stream_mode = stream_mode()
        self._nccl = load_nccl()
        self.device = pick_device(ctx, "cuda")
        torch.cuda.set_device(self.device)
        _use_cupy_device(self.device.index)
        self.nccl_version = int(self._nccl.get_version())
        self._dtype_codes = nccl_dtypes(self._nccl)
        self._op_codes = nccl_ops(self._nccl, self.nccl_version)
        if self.nccl_version < NCCL_2_10:
            self.dtypes = frozenset(self.dtypes - {torch.bfloat16})
        self._timeout = ctx.timeout.total_seconds()
        uid = share_unique_id(self._nccl, ctx.topology, ctx.store, next(_generation), key=unique_id_key)
        self._comm: Any = self._nccl.NcclCommunicator(self.size, uid, self.rank)
        self._barrier_buf = torch.zeros(1, dtype=torch.float32, device=self.device)
        self._side = torch.cuda.Stream(self.device) if self.stream_mode == "side" else None

    # ------------------------------------------------------------------ plumbing
    def _live(self):
        if self._comm is None:
            raise CollectiveError("the NCCL communicator was closed")
        return self._comm

    def check_async_error(self) -> None:
        """Raise if NCCL reported an asynchronous error (a peer died, a network failure).

        Raises:
            CollectiveError: NCCL's error, with its message.
        """
        comm = self._live()
        try:
            comm.check_async_error()
        except Exception as exc:  # noqa: BLE001 - CuPy's NcclError
            raise CollectiveError(f"NCCL reported an error on rank {self.rank} ({self.device}): {exc}") from exc

    def _stream(self, *tensors: torch.Tensor):
        """The stream to enqueue on, ordered after everything queued on the current stream."""
        current = torch.cuda.current_stream(self.device)
        if self._side is None:
            return current
        self._side.wait_stream(current)
        for tensor in tensors:
            # the caching allocator must not reuse these until the side stream is done
            tensor.record_stream(self._side)
        return self._side

    def _ordered(self, stream) -> StreamOrdered:
        event = torch.cuda.Event()
        event.record(stream)
        return StreamOrdered(self, stream, event)

    def _dtype(self, tensor: torch.Tensor) -> int:
        check_device(tensor, self.device, self.name)
        return self._dtype_codes[tensor.dtype]

    # ------------------------------------------------------------------ collectives
    def all_reduce(self, tensor: torch.Tensor, op: Op, tag: int) -> Pending:
        comm = self._live()
        dtype = self._dtype(tensor)
        code = self._op_codes[op]
        stream = self._stream(tensor)
        if tensor.numel():
            ptr = tensor.data_ptr()
            comm.allReduce(ptr, ptr, tensor.numel(), dtype, self._op_codes[Op.SUM] if code is None else code,
                           stream.cuda_stream)
            if code is None:
                with torch.cuda.stream(stream):
                    average(tensor, self.size)
        return self._ordered(stream)

    def broadcast(self, tensor: torch.Tensor, src: int, tag: int) -> Pending:
        comm = self._live()
        dtype = self._dtype(tensor)
        stream = self._stream(tensor)
        if tensor.numel():
            ptr = tensor.data_ptr()
            comm.broadcast(ptr, ptr, tensor.numel(), dtype, src, stream.cuda_stream)
        return self._ordered(stream)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, tag: int) -> Pending:
        comm = self._live()
        dtype = self._dtype(input)
        self._dtype(output)
        stream = self._stream(output, input)
        if input.numel():
            comm.allGather(input.data_ptr(), output.data_ptr(), input.numel(), dtype, stream.cuda_stream)
        return self._ordered(stream)

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_counts: Sequence[int],
        input_counts: Sequence[int],
        tag: int,
    ) -> Pending:
        comm = self._live()
        dtype = self._dtype(input)
        self._dtype(output)
        calls, own = all_to_all_plan(self.rank, self.size, output_counts, input_counts)
        stream = self._stream(output, input)
        if own is not None:
            out_offset, in_offset, count = own
            with torch.cuda.stream(stream):
                output[out_offset:out_offset + count].copy_(input[in_offset:in_offset + count])
        if calls:
            itemsize = input.element_size()
            send_base, recv_base, handle = input.data_ptr(), output.data_ptr(), stream.cuda_stream
            self._nccl.groupStart()
            try:
                for kind, peer, offset, count in calls:
                    if kind == "send":
                        comm.send(send_base + offset * itemsize, count, dtype, peer, handle)
                    else:
                        comm.recv(recv_base + offset * itemsize, count, dtype, peer, handle)
            finally:
                self._nccl.groupEnd()
        return self._ordered(stream)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: Op, tag: int) -> Pending:
        # NCCL reduces half precision in the dtype, as torch's NCCL group does (moving float32
        # copies would double the bytes on the wire): the one exception to comm.base.HALF.
        comm = self._live()
        dtype = self._dtype(input)
        self._dtype(output)
        code = self._op_codes[op]
        stream = self._stream(output, input)
        if output.numel():
            comm.reduceScatter(input.data_ptr(), output.data_ptr(), output.numel(), dtype,
                               self._op_codes[Op.SUM] if code is None else code, stream.cuda_stream)
            if code is None:
                with torch.cuda.stream(stream):
                    average(output, self.size)
        return self._ordered(stream)

    def barrier(self, tag: int) -> Pending:
        return HostPolled(self, self._enqueue_barrier(self._live()))

    def _enqueue_barrier(self, comm):
        # after everything queued so far, on the current stream and (side mode) the side stream
        stream = self._stream()
        ptr = self._barrier_buf.data_ptr()
        comm.allReduce(ptr, ptr, 1, self._dtype_codes[torch.float32], self._op_codes[Op.SUM], stream.cuda_stream)
        event = torch.cuda.Event()
        event.record(stream)
        return event

    # ------------------------------------------------------------------ teardown
    def abort(self) -> None:
        """Abort the NCCL communicator at once (a broken job): in-flight collectives end."""
        comm, self._comm = self._comm, None
        if comm is not None:
            comm.abort()

    def close(self) -> None:
        """Wait for every rank (a last barrier, within the job's timeout), then destroy.

        A job where NCCL reported an error, or where the barrier does not complete in time,
        is aborted instead, so teardown never hangs.
        """
        comm = self._comm
        if comm is None:
            return
        drained = self._drain(comm)
        self._comm = None
        if drained:
            comm.destroy()
        else:
            comm.abort()

    def _drain(self, comm) -> bool:
        try:
            comm.check_async_error()
            event = self._enqueue_barrier(comm)
            deadline = time.monotonic() + self._timeout
            while not event.query():
                comm.check_async_error()
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.001)
            return True
        except Exception:  # noqa: BLE001 - any failure here means abort
            return False


def _use_cupy_device(index: int) -> None:
    """Make ``index`` CuPy's current device too (CuPy may carry its own CUDA runtime)."""
    try:
        from cupy.cuda import runtime
    except ImportError:
        return
    runtime.setDevice(index)
