"""The shared-memory CPU plane: collectives among the ranks of one host through /dev/shm.

The ranks of a host map one segment. Each rank owns two buffers in it (double buffering)
and one epoch word, the count of steps it has signalled. A step is: wait until every
rank's word shows it left the step before last (so this buffer is free again), copy in,
publish the new epoch, wait until the other ranks have published theirs, read their
buffers. No trailing barrier: the epoch words order everything.

- a small all_reduce is one step (every rank reduces every buffer, in rank order, so every
  rank computes the same bits); larger ones run a reduce-scatter and an all-gather per
  slice (each part reduced by exactly one rank). The limit is ``SMDDP_SHM_ONE_SHOT_MAX``
  (32 KiB) in the compiled core, a fixed 1 MiB in the Python path.
- with ``SMDDP_SHM_CMA=1`` (off by default: slower here, docs/performance.md), where the kernel
  lets a host's ranks read and write each other's memory (probed at set-up,
  :mod:`smddp.comm.planes.shm_cma`), the compiled core's all-reduces from the group's
  ``SMDDP_SHM_CMA_MIN_BYTES`` (64 MiB) skip the segment: each rank reads its part of every
  peer's buffer, reduces it into its own and writes the result into theirs (``_shm_cma.h``);
  the same parts, the same rank order, the same bits.
- the sizes and thresholds are the group's agreed layout's (:mod:`smddp.comm.planes.layout`), the
  same on every rank; the hierarchical plane's all-reduce cuts the same slices between hosts
  in both implementations (:attr:`Plane.part_bytes`), so a host on the Python path and one
  with the compiled core run one job.
- float16 and bfloat16 are accumulated in float32 and rounded once, as the MPI path does; bool
  is reduced as its bytes (SUM an or, PRODUCT an and, as torch's and gloo's bool arithmetic);
  the bitwise ops reduce integers and bool, and a reduction a dtype has not is refused before
  any step (:func:`~smddp.comm.reduction.check_reduction`).
- Operations run one at a time in issue order (a later operation waits for the earlier
  ones to leave the buffers), advanced by ``Pending.test()``, which never waits long: the
  engine's deadline, its progress thread and its timeouts apply as they do to MPI.

Each operation runs in the compiled core (``_shm_native.c``, built by ``pip install``) when
it is there and serves the dtype: copies, reductions and the waits on the epoch words in C,
without the GIL; a wait spins ``SMDDP_SHM_SPIN_US`` (20 us), then sleeps on a futex until
the peer publishes. The Python path (:mod:`smddp.comm.planes.shm_torch`: generators over
torch views) runs the same protocol: it is the fallback (no compiler at install,
``SMDDP_SHM_NATIVE=0``) and runs the hierarchical plane's half-precision all-reduces (their
parts cross hosts in float32). All ranks of a host take the same path (the layout says which),
and both give the same bits.

The segment itself (its size, set-up and clean-up) is :mod:`smddp.comm.planes.shm_segment`'s.

Every operation carries a fingerprint (kind, dtype, element count, root, reduction op,
sequence number), written with its first step into the rank's header line, next to the
epoch word the peers read anyway; that step waits for every rank (a broadcast's root too),
and each rank compares every rank's fingerprint with its own before it uses their data.
If they differ, every rank raises the same :class:`~smddp.errors.CollectiveMismatchError`
after the same step and publish: no result is written, and the plane stays in step for the
operations after it. An empty operation takes one step, for its fingerprint.

The Python path's epoch words rely on x86-64's ordering of stores (data before flag; the
compiled core uses release/acquire atomics); elsewhere :func:`supported` is False and the
group's flat communicator (MPI or gloo) serves.

The ranks meet through the group's torch Store (:mod:`smddp.comm.planes.hostmates`), so
the plane starts under any launcher.
"""

from __future__ import annotations

import collections
import os
import threading
import time
import warnings
from typing import Iterator, Optional

import torch

from smddp import knobs
from smddp.comm.base import DONE, Pending
from smddp.comm.mismatch import fingerprint
from smddp.comm.mismatch.fingerprint import mismatch_error, unpaired_error
from smddp.comm.planes.shm_segment import (
    HEADER,
    SLOT_BYTES,
    SegmentBounded,
    alive,
    map_segment,
    release,
    segment_bytes,
)
from smddp.comm.planes.shm_torch import SegmentView, TorchPath, _Wait
from smddp.comm.reduction import HALF, Op, check_reduction
from smddp.errors import CollectiveMismatchError, CollectiveTimeout

try:
    from smddp.comm.planes import _shm_native as native
except ImportError:  # not built (no C compiler at install): the Python path serves
    native = None

#: This process's bytes per step of the compiled core's larger collectives (small enough that a
#: step's buffers stay in the caches); a plane runs its group's agreed value (:class:`Plane`).
CHUNK_BYTES = knobs.value("SMDDP_SHM_CHUNK_BYTES")
#: This process's one-step limit of the compiled core's all-reduces (above it, each rank
#: reduces one part of every step, which moves fewer bytes); a plane runs its group's agreed value.
NATIVE_ONE_SHOT_MAX = knobs.value("SMDDP_SHM_ONE_SHOT_MAX")
#: A wait on the peers spins this long, then sleeps until they publish (the compiled core):
#: a rank whose peer is still computing gives the core back instead of taking it.
SPIN_NS = int(knobs.value("SMDDP_SHM_SPIN_US") * 1000)
_START_WAIT_NS = 20_000  # how long starting an operation waits on the peers before returning
_TEST_WAIT_NS = 200_000  # ... and each test() (the engine's lock is held meanwhile)
# The compiled core's codes are the fingerprint's: its ten dtypes (bool the last) come first in the table.
_DTYPE_CODES = {dtype: i for i, dtype in enumerate(fingerprint.DTYPES[:10])}
_OP_CODES = {op: i for i, op in enumerate(fingerprint.OPS)}
_WORD = 64  # bytes between two ranks' epoch words: one cache line each
#: Ranks per host the segment's header has epoch words for (one cache line each).
MAX_LOCAL_RANKS = HEADER // _WORD
#: The smallest buffer the plane runs with: every step then moves at least 64 bytes to each
#: of up to MAX_LOCAL_RANKS peers (an all-to-all splits a step's buffer among them).
MIN_SLOT_BYTES = 64 << 10
#: What an operation raises when the ranks' fingerprints differ (the core's, the Python path's).
_MISMATCHES = (CollectiveMismatchError,) + ((native.Mismatch,) if native is not None else ())
_SPINS = 64  # the Python path's flag checks per test() call before handing the core back
_LIVENESS_EVERY = 1.0  # seconds between checks that the awaited ranks still exist
_PLANE = "the shared-memory plane"


class Plane:
    """The shared segment of one host's ranks and the operations over it.

    Every operation returns a :class:`~smddp.comm.base.Pending`; they run one at a time, in
    issue order. Each runs in the compiled core where it serves the call, else on the plane's
    Python path (:attr:`python`, a :class:`~smddp.comm.planes.shm_torch.TorchPath` given a view of
    the segment).

    Args:
        host: the set-up channel of exactly the ranks that share the segment
            (:class:`~smddp.comm.planes.hostmates.HostChannel`, over the group's store).
        group: a name for the group (part of the segment's name).
        slot: bytes of each buffer.
        use_native: run operations in the compiled core (every rank must pass the same).
        chunk_bytes: bytes per step of the compiled core's larger collectives.
        one_shot_max: the compiled core's one-step all-reduce limit.
        f16: the compiled core reduces float16 (every rank must pass the same).
        single_copy_min: all-reduces of at least this many bytes read and write the peers' buffers
            directly (the compiled core, :mod:`~smddp.comm.planes.shm_cma`); 0: none.

    Every rank of the host passes the same values: the group's agreed layout's (:func:`open_plane`).

    Attributes:
        native: True when the compiled core runs this plane's operations.
        single_copy_min: the threshold of the single-copy all-reduce (0: this plane has none).
        part_bytes: bytes of each slice of a hierarchical all-reduce, in both implementations.
        python: the plane's Python path over this rank's view of the segment.

    Raises:
        OSError: /dev/shm cannot hold the segment (:func:`open_plane` turns that into a
            fallback).
    """

    def __init__(self, host, group: str = "world", slot: int = SLOT_BYTES, use_native: bool = False,
                 chunk_bytes: int = CHUNK_BYTES, one_shot_max: int = NATIVE_ONE_SHOT_MAX, f16: bool = True,
                 single_copy_min: int = 0):
        self.rank, self.size = host.rank, host.size
        mates = getattr(host, "mates", None)
        #: The group rank of each of the plane's ranks (errors name them).
        self.names = list(mates.ranks) if mates is not None else list(range(self.size))
        self.group = group
        self.slot = slot
        self.chunk_bytes, self.one_shot_max = chunk_bytes, one_shot_max
        self.part_bytes = min(chunk_bytes, slot)
        self._nbytes = segment_bytes(self.size, slot)
        self.name, self._mm = map_segment(host, group, self._nbytes)
        self._words = memoryview(self._mm).cast("q")
        self._bytes = torch.frombuffer(self._mm, dtype=torch.uint8)
        stride = _WORD // 8
        self._words[self.rank * stride + 1] = os.getpid()
        host.barrier()
        self._pids = [self._words[r * stride + 1] for r in range(self.size)]
        # The compiled core keeps the protocol's counters; the Python path shares them.
        self._seg = native.Segment(self._mm, self.rank, self.size, slot, HEADER, SPIN_NS) if use_native else None
        self.python = TorchPath(SegmentView(self.rank, self.size, slot, self.part_bytes, self._bytes, self._words,
                                            stride, self.names, group), self._seg)
        self.native = self._seg is not None
        self.single_copy_min = single_copy_min if self.native else 0
        if self.single_copy_min:
            self._seg.single_copy_min = single_copy_min
        self._codes = dict(_DTYPE_CODES) if self.native else {}
        if self.native and not (f16 and native.HAVE_FLOAT16):
            del self._codes[torch.float16]
        self._queue: collections.deque = collections.deque()
        self._lock = threading.Lock()
        self._waiting_since = 0.0
        self._next_liveness = 0.0

    # ------------------------------------------------------------------ operations
    def all_reduce(self, tensor: torch.Tensor, op: Op, tag: int = 0) -> Pending:
        """Reduce flat contiguous ``tensor`` in place over the plane's ranks.

        ``tag``: the collective's sequence number, part of its fingerprint (the signature of a
        communicator's ``all_reduce``, which may bind this method as its own).
        """
        code = self._codes.get(tensor.dtype)
        if code is None:
            check_reduction(tensor.dtype, op)
            return self.start(self.python.all_reduce(tensor, op, tag))
        try:
            native_op = self._seg.all_reduce(
                tensor.data_ptr(), tensor.numel(), code, _OP_CODES[op], self.chunk_bytes, self.one_shot_max, tag)
        except ValueError:
            check_reduction(tensor.dtype, op)  # the core has no such reduction of the dtype: say so in words
            raise
        return self._run(native_op, tensor)

    def all_reduce_across(self, tensor: torch.Tensor, op: Op, across, world: int, tag: int,
                          agreed: Optional[Pending] = None) -> Pending:
        """All-reduce flat ``tensor`` over several hosts: this host's part through shared memory,
        the hosts' parts through ``across`` (a communicator of the ranks with this local rank,
        one per host: MPI or gloo).

        Per slice of :attr:`part_bytes`: each local rank reduces its part of the slice over the
        host, all-reduces that part with the same local rank of every other host (float32 for
        half types), and the host all-gathers the parts. ``world`` (the group's size) divides an
        AVERAGE; ``tag`` is the collective's sequence number, passed to ``across``. ``agreed``:
        the group's exchange of this call's fingerprint; no step starts before it completes, and
        if it raises (the ranks called different collectives) the plane is left as it was. The
        compiled core runs the steps within the host and pauses for each exchange between hosts;
        half types take the Python path (they cross hosts in float32).
        """
        code = self._codes.get(tensor.dtype)
        if code is None or tensor.dtype in HALF:
            return self.start(self.python.all_reduce_across(tensor, op, across, world, tag, agreed))
        native_op = self._seg.all_reduce_across(tensor.data_ptr(), tensor.numel(), code, _OP_CODES[op],
                                                self.chunk_bytes, world, tag)
        return self.start(self._across_native_gen(native_op, tensor.view(-1), across, op, tag, agreed))

    def _across_native_gen(self, native_op, flat: torch.Tensor, across, op: Op, tag: int,
                           agreed: Optional[Pending]) -> Iterator:
        """Drive the core's all_reduce_across; between its pauses, all-reduce each part between hosts."""
        if agreed is not None:
            yield agreed  # raises here, before any step, if the ranks' calls differ
        stepping = _Stepping(native_op)
        across_op = Op.SUM if op is Op.AVERAGE else op  # the core divides by the group's size
        while not native_op.done:
            exchange = native_op.exchange
            if exchange is None:
                yield stepping
                continue
            first, count = exchange
            if count:
                yield across.all_reduce(flat[first:first + count], across_op, tag)
            native_op.resume()

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: Op, tag: int = 0) -> Pending:
        """Rank r receives the ``op`` of every rank's slice r of flat ``input`` into flat ``output``.

        ``tag``, here and below: the collective's sequence number, part of its fingerprint.
        """
        check_reduction(input.dtype, op, "reduce_scatter")
        code = self._codes.get(input.dtype)
        if code is None:
            return self.start(self.python.reduce_scatter(output, input, op, tag))
        return self._run(self._seg.reduce_scatter(
            output.data_ptr(), input.data_ptr(), output.numel(), code, _OP_CODES[op], self.chunk_bytes, tag),
            (output, input))

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, tag: int = 0) -> Pending:
        """Fill flat ``output`` with every rank's flat ``input`` in rank order."""
        if not self.native:
            return self.start(self.python.all_gather(output, input, tag))
        return self._run(self._seg.all_gather(
            output.data_ptr(), input.data_ptr(), input.numel() * input.element_size(), self.chunk_bytes,
            fingerprint.dtype_code(input.dtype), input.numel(), tag), (output, input))

    def broadcast(self, tensor: torch.Tensor, src: int, tag: int = 0) -> Pending:
        """Copy rank ``src``'s flat ``tensor`` into every rank's."""
        if not self.native:
            return self.start(self.python.broadcast(tensor, src, tag))
        return self._run(self._seg.broadcast(
            tensor.data_ptr(), tensor.numel() * tensor.element_size(), src, self.chunk_bytes,
            fingerprint.dtype_code(tensor.dtype), tensor.numel(), tag), tensor)

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, output_counts, input_counts,
                   tag: int = 0) -> Pending:
        """Send ``input_counts[r]`` elements of flat ``input`` (consecutive, rank order) to rank r;
        receive ``output_counts[r]`` from rank r into flat ``output``. Compiled core only.

        Its fingerprint has the dtype, not the counts (they differ from rank to rank): the first
        step carries each rank's split sizes instead, and every rank raises
        :class:`~smddp.errors.CollectiveMismatchError` unless they pair up.
        """
        es = input.element_size()
        return self._run(self._seg.all_to_all(
            output.data_ptr(), input.data_ptr(), [c * es for c in input_counts], [c * es for c in output_counts],
            self.chunk_bytes, fingerprint.dtype_code(input.dtype), tag), (output, input))

    def barrier(self, tag: int = 0) -> Pending:
        """Complete once every rank of the plane has entered it."""
        if not self.native:
            return self.start(self.python.barrier(tag))
        return self._run(self._seg.barrier(tag), None)

    # ------------------------------------------------------------------ driving
    def start(self, gen: Iterator[_Wait]) -> Pending:
        """Queue an operation of the Python path (a generator of waits); it runs after the ones
        queued before it."""
        op = _Op(self, gen)
        with self._lock:
            self._queue.append(op)
            if len(self._queue) == 1:
                # Nothing ahead of it: copy in and publish now, in the caller's thread, so the
                # other ranks can proceed before anyone tests this operation.
                self._advance(0)
        return op

    def _run(self, native_op, keep) -> Pending:
        """Queue an operation of the compiled core; ``keep``: the tensors it reads and writes,
        held until it completes (the core has only their addresses)."""
        self._lock.acquire()  # not `with`: cheaper, on the path of every small collective
        try:
            if not self._queue:
                # Nothing ahead of it: run it now, in the caller's thread. Most small ones
                # complete here; the others have published their first step for the peers.
                if native_op.advance(_START_WAIT_NS):
                    return DONE
            op = _Op(self, None, native_op, keep)
            self._queue.append(op)
        except _MISMATCHES as exc:
            raise self._mismatched(exc) from None
        finally:
            self._lock.release()
        return op

    def _mismatched(self, exc: BaseException) -> CollectiveMismatchError:
        """The error of an operation whose fingerprints differ, or whose all-to-all split sizes do
        not pair up (the core's Mismatch, or the Python path's)."""
        if isinstance(exc, CollectiveMismatchError):
            return exc
        prints = exc.args[0]
        pairs = exc.args[1] if len(exc.args) > 1 else ()
        if not pairs:
            return mismatch_error(prints, self.names, _PLANE, self.group)
        sig = prints[self.rank][1]  # the fingerprints agree: this rank's names the dtype
        code = ((sig >> 16) & 0xFF) - 1
        size = fingerprint.DTYPES[code].itemsize if 0 <= code < len(fingerprint.DTYPES) else 1
        pairs = [(r, q, sent // size, expected // size) for r, q, sent, expected in pairs]
        return unpaired_error(pairs, self.names, _PLANE, sig >> 32, self.group, "elements" if size > 1 else "bytes")

    def _advance(self, wait_ns: int) -> None:
        """Run queued operations until one must wait for other ranks (lock held).

        ``wait_ns``: how long the compiled core may wait on a peer before returning.
        """
        queue = self._queue
        while queue:
            op = queue[0]
            try:
                if op.native is not None:
                    if not op.native.advance(wait_ns):
                        self._check_peers(op.native.waiting)
                        return
                    op.done, op.keep = True, None
                    queue.popleft()
                    self._waiting_since = 0.0
                    continue
                if op.wait is not None and not self.python.reached(op.wait):
                    self._check_peers(op.wait)
                    return
                self._waiting_since = 0.0
                try:
                    op.wait = next(op.gen)
                except StopIteration:
                    op.done = True
                    queue.popleft()
            except _MISMATCHES as exc:
                # Every rank stopped it after the same step: the ones behind it run as usual.
                op.error, op.done, op.keep = self._mismatched(exc), True, None
                queue.popleft()
                self._waiting_since = 0.0
            except BaseException as exc:
                # The buffers are in an unknown state: every later operation fails too.
                for other in queue:
                    other.error, other.done = exc, True
                queue.clear()
                raise

    def _check_peers(self, wait) -> None:
        if isinstance(wait, _Stepping):
            wait = wait.native_op.waiting
        if not isinstance(wait, tuple):
            return
        now = time.monotonic()
        if not self._waiting_since:
            self._waiting_since, self._next_liveness = now, now + _LIVENESS_EVERY
        elif now >= self._next_liveness:
            self._next_liveness = now + _LIVENESS_EVERY
            dead = [r for r in self.python.behind(wait) if not alive(self._pids[r])]
            if dead:
                raise PeerExited(
                    f"local rank(s) {dead} of this host's shared-memory group (pids "
                    f"{[self._pids[r] for r in dead]}) exited in the middle of a collective; "
                    f"the job cannot continue: look for their error output"
                )

    def close(self) -> None:
        """Unmap the segment (already unlinked)."""
        with self._lock:
            self._queue.clear()
            if self._seg is not None:
                self._seg.close()  # under the lock: no thread is inside the core meanwhile
            self.python = None  # its views of the segment go with it
        self._words.release()
        del self._bytes
        try:
            self._mm.close()
        except BufferError:
            pass  # a tensor view still exists: the mapping goes with the process
        release(self._nbytes)
        self._nbytes = 0  # (closed once)


class PeerExited(RuntimeError):
    """A host-mate's process ended in the middle of a collective.

    Not a :class:`~smddp.errors.CollectiveError`: the engine wraps it in one that also says
    where the other ranks are (one that reached the end of its script is named so).
    """


class _Stepping:
    """A wait on a compiled operation inside a generator: over once it completes or pauses."""

    __slots__ = ("native_op",)

    def __init__(self, native_op):
        self.native_op = native_op

    def test(self) -> bool:
        # No wait here: the generator's driver checks again soon, and calls MPI between checks.
        native_op = self.native_op
        return native_op.advance(0) or native_op.exchange is not None


class _Op(Pending):
    """One queued shared-memory operation: a generator of waits, or the compiled core's."""

    __slots__ = ("_plane", "gen", "native", "keep", "wait", "done", "error")

    def __init__(self, plane: Plane, gen: Optional[Iterator[_Wait]], native_op=None, keep=None):
        self._plane = plane
        self.gen = gen
        self.native = native_op
        self.keep = keep
        self.wait: Optional[_Wait] = None
        self.done = False
        self.error: Optional[BaseException] = None

    def test(self) -> bool:
        if not self.done:
            plane = self._plane
            with plane._lock:
                queue = plane._queue
                if queue and queue[0].native is not None:
                    plane._advance(_TEST_WAIT_NS)  # the core waits (spins, then sleeps) itself
                else:
                    # A generator (the Python path, the hierarchical plane's exchange between
                    # hosts): check often; MPI moves TCP traffic only while it is called.
                    for spin in range(_SPINS):
                        plane._advance(0)
                        if self.done:
                            break
                        if spin:
                            os.sched_yield()  # on a busy host the awaited rank may need this core
        if self.error is not None:
            raise self.error
        return self.done


_bound_said = False  # the warning that groups run without shared memory at the bound, once per process


def open_plane(host, agreed, group: str = "world") -> Optional[Plane]:
    """A :class:`Plane` over one host's ranks, or None (one warning, on local rank 0) where it cannot be had.

    The plane runs in the compiled core when every rank of the host has it, with the group's
    agreed sizes and thresholds.

    Args:
        host: the host's set-up channel (:class:`~smddp.comm.planes.hostmates.HostChannel`).
        agreed: the group's :class:`~smddp.comm.planes.layout.Layout` (the same on every rank).
        group: a name for the group, part of the segment's name.

    Returns:
        The plane, or None when a rank of the host cannot run it (not x86-64 Linux), /dev/shm
        is too small, the slot is below :data:`MIN_SLOT_BYTES`, or the host has more ranks than
        the segment's header holds (:data:`MAX_LOCAL_RANKS`).
    """
    slot, here = agreed.slot, agreed.mates.host
    if slot < MIN_SLOT_BYTES:
        if host.rank == 0:
            warnings.warn(
                f"smddp: SMDDP_SHM_SLOT_BYTES={slot} is below the shared-memory plane's minimum "
                f"({MIN_SLOT_BYTES}): CPU collectives do not use shared memory", RuntimeWarning, stacklevel=2)
        return None
    if host.size > MAX_LOCAL_RANKS:
        if host.rank == 0:
            warnings.warn(
                f"smddp: the shared-memory plane serves at most {MAX_LOCAL_RANKS} ranks per host and this "
                f"host has {host.size}: CPU collectives do not use shared memory", RuntimeWarning, stacklevel=2)
        return None
    if not agreed.shm[here]:
        return None
    try:
        return Plane(host, group, slot, agreed.native[here], agreed.chunk_bytes, agreed.one_shot_max,
                     agreed.native_f16[here], agreed.cma_min_bytes if agreed.cma[here] else 0)
    except CollectiveTimeout:
        raise  # a host-mate that never came (a TimeoutError, so an OSError): not a /dev/shm problem
    except SegmentBounded as exc:
        # At the process's or the directory's bound (jobs make many groups): said once per process.
        global _bound_said
        if host.rank == 0 and not _bound_said:
            _bound_said = True
            warnings.warn(f"smddp: group {group!r} and groups after it that pass the bound run their CPU "
                          f"collectives without shared memory: {exc}", RuntimeWarning, stacklevel=2)
        return None
    except OSError as exc:
        if host.rank == 0:
            # The reason carries its own advice (shm_segment): a read-only directory is not a small one.
            warnings.warn(f"smddp: shared-memory plane unavailable, CPU collectives do not use it: {exc}",
                          RuntimeWarning, stacklevel=2)
        return None
