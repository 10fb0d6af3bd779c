"""Collectives built from the engine's six: reduce-scatter, reduce, gather, scatter, lists, p2p.

torch's ``ProcessGroup`` has more methods than a communicator implements. Each one here is
one engine collective (numbered, checked and timed like the others) followed, where needed,
by a local step on completion:

- ``reduce_scatter_tensor``: ``all_to_all_single`` brings every rank's slice ``r`` to rank
  ``r``, which reduces the slices in rank order. Every element is reduced exactly once, on
  one rank, in the same order whatever the backend: deterministic, and the bytes moved equal
  a ring reduce-scatter's. Half-precision slices are accumulated in float32.
- ``reduce``: an ``all_reduce`` (every rank gets the result; torch leaves non-root tensors
  unspecified).
- ``gather`` / ``scatter``: ``all_to_all_single`` with nothing sent to (from) ranks other than
  the root.
- list forms (``all_to_all`` of lists, ``reduce_scatter`` of a list) pack into one flat
  buffer; the coalesced forms start one collective per tensor, and the last one's handle
  stands for them all (the engine completes them in issue order). A ``reduce_scatter`` list
  of chunks of different sizes (torch's gloo and NCCL groups take them) is reduced by whoever
  reduces the even ones: where the library reduces (MPI, NCCL, the shared-memory plane's
  core), an ``all_reduce`` of the packed list, then this rank's chunk (torch's NCCL group
  reduces each chunk with the library too, one ``reduce`` each); elsewhere (gloo), as
  ``reduce_scatter_tensor`` there, an ``all_to_all_single`` and a reduction in rank order.
- ``send`` / ``recv``: the communicator's own point-to-point, where it has one. They involve
  two ranks, so they take no sequence number: the collectives' numbering stays in step.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

import torch

from smddp.comm.base import DONE, Pending, flat, then
from smddp.comm.engine import Engine, Handle
from smddp.comm.engine.arguments import check_writable
from smddp.comm.reduction import Op, reduce_rows
from smddp.errors import InvalidArgumentError, InvalidTypeError


def _check(engine: Engine, *fields):
    """The ``SMDDP_DEBUG`` description of a call, or None (no cost) when the checks are off."""
    return fields if engine.debugging else None


def _start(engine: Engine, op_name: str, start: Callable[[int], Pending], check, inputs, result,
           async_op: bool = True) -> Optional[Handle]:
    return engine.run(op_name, start, async_op, check, (), inputs, result)


def _root_checks(engine: Engine, op_name: str, checks: Callable[[], None]) -> None:
    """Run the argument checks only the root can make; if they raise, the call still takes its
    sequence number (nothing is sent), so that the other ranks, whose calls went ahead, see
    it by the number (the shared-memory plane's fingerprints, ``SMDDP_DEBUG``) instead of
    pairing this rank's next collective with theirs."""
    try:
        checks()
        return
    except (InvalidArgumentError, InvalidTypeError) as exc:
        error = exc

    def refuse(seq: int) -> Pending:
        raise error

    engine.run(op_name, refuse, False)


# ---------------------------------------------------------------------------- reductions
def reduce_scatter_tensor(engine: Engine, output: torch.Tensor, input: torch.Tensor, op: Op,
                          result: Optional[Sequence] = None, async_op: bool = True) -> Optional[Handle]:
    """Reduce ``input`` (``size * output.numel()`` elements) over ranks; rank ``r`` gets slice ``r``.

    The communicator's own ``reduce_scatter`` where it has one (MPI, NCCL, the shm plane); otherwise
    ``all_to_all_single`` and a local reduction in rank order. ``async_op`` False: wait here, return
    None (the engine's synchronous path, as a synchronous ``all_reduce`` takes).

    Raises:
        InvalidArgumentError: the sizes do not match.
        InvalidTypeError: different dtypes or devices, or a dtype the backend refuses.
    """
    comm = engine.checks.comm_for(output, input)
    n = output.numel()
    if input.numel() != engine.size * n:
        raise InvalidArgumentError(
            f"reduce_scatter_tensor: input has {input.numel()} elements; it needs {engine.size} x {n} "
            f"(world size x output elements)"
        )
    direct = engine.direct_path(comm)
    if direct is not None:
        work = engine.start_direct(direct, direct.REDUCE_SCATTER, output, input, op, async_op, result,
                                   "reduce_scatter_tensor")
        if work is not direct.REFUSED:
            return work
    src = flat(input)
    inputs, result = (input,), ((output,) if result is None else result)
    if comm.native_reduce_scatter:
        buf, after = engine.checks.buffer(output, "reduce_scatter_tensor", "output")

        def native(seq: int) -> Pending:
            return then(comm.reduce_scatter(buf.flatten(), src, op, seq), after, src, buf)

        check = _check(engine, "reduce_scatter", op, src)
        return _start(engine, "reduce_scatter_tensor", native, check, inputs, result, async_op)
    return _exchange_and_reduce(engine, comm, "reduce_scatter_tensor", output, src, [n] * engine.size, op,
                                inputs, result, async_op)


def _exchange_and_reduce(engine: Engine, comm, op_name: str, output: torch.Tensor, src: torch.Tensor,
                         send_counts: Sequence[int], op: Op, inputs, result, async_op: bool) -> Optional[Handle]:
    """A reduce-scatter where the library has none: ``all_to_all_single`` sends ``send_counts[r]``
    elements of flat ``src`` to rank ``r`` and receives ``output.numel()`` from each; this rank
    then reduces the rows in rank order into ``output``."""
    if not output.is_contiguous():
        check_writable(output, op_name, "output")
    comm.check_reduction(src.dtype, op, op_name)  # reduced here, by reduce_rows
    n = output.numel()
    rows = torch.empty((engine.size, n), dtype=src.dtype, device=src.device)
    receive = [n] * engine.size

    def start(seq: int) -> Pending:
        pending = comm.all_to_all_single(rows.view(-1), src, receive, send_counts, seq)
        return then(pending, lambda: reduce_rows(rows, op, output), src, rows)

    check = _check(engine, "all_to_all_single", None, src, None, False, (send_counts, receive))
    return _start(engine, op_name, start, check, inputs, result, async_op)


def reduce_scatter(engine: Engine, output: torch.Tensor, input_list: Sequence[torch.Tensor], op: Op,
                   async_op: bool = True) -> Optional[Handle]:
    """Reduce the lists over ranks; rank ``r`` gets the reduction of every rank's ``input_list[r]``.

    The chunks may differ in size, as torch's gloo and NCCL groups allow: ``input_list[r]`` has,
    on every rank, as many elements as rank ``r``'s ``output``. Equal chunks are a
    :func:`reduce_scatter_tensor`; uneven ones are reduced by whoever reduces those (see the
    module's docstring). ``async_op`` False: wait here, return None.

    Raises:
        InvalidArgumentError: not one input per rank, or ``input_list[rank]`` and ``output`` of
            different sizes.
        InvalidTypeError: a reduction the dtype has not (a bitwise op of floats, ...).
    """
    inputs = _tensor_list(input_list, "input_list")
    if len(inputs) != engine.size:
        raise InvalidArgumentError(
            f"reduce_scatter: input_list has {len(inputs)} tensors; it needs one per rank ({engine.size})")
    mine = inputs[engine.rank]
    if mine.numel() != output.numel():
        raise InvalidArgumentError(
            f"reduce_scatter: input_list[{engine.rank}] (this rank's chunk) has shape {tuple(mine.shape)}, the "
            f"output has shape {tuple(output.shape)}: they must have the same number of elements")
    comm = engine.checks.comm_for(output, *inputs)
    counts = [t.numel() for t in inputs]
    packed = torch.cat([flat(t) for t in inputs])
    if counts.count(counts[0]) == len(counts):
        return reduce_scatter_tensor(engine, output, packed, op, (output,), async_op)
    if comm.native_reduce_scatter:  # the library reduces: all of it, then this rank's chunk
        if not output.is_contiguous():
            check_writable(output, "reduce_scatter", "output")
        first, n = sum(counts[:engine.rank]), output.numel()

        def copy_out() -> None:
            output.detach().copy_(packed[first:first + n].view(output.shape))

        def reduce_all(seq: int) -> Pending:
            return then(comm.all_reduce(packed, op, seq), copy_out, packed)

        return _start(engine, "reduce_scatter", reduce_all, _check(engine, "all_reduce", op, packed), inputs,
                      (output,), async_op)
    return _exchange_and_reduce(engine, comm, "reduce_scatter", output, packed, counts, op, inputs, (output,),
                                async_op)


def reduce(engine: Engine, tensor: torch.Tensor, op: Op) -> Handle:
    """Reduce ``tensor`` over ranks; the root (and, here, every rank) gets the result."""
    return engine.all_reduce(tensor, op, async_op=True)


# ---------------------------------------------------------------------------- rooted
def gather(engine: Engine, outputs: Optional[Sequence[torch.Tensor]], input: torch.Tensor, dst: int) -> Handle:
    """Every rank's ``input`` into ``outputs`` (rank order) on rank ``dst``.

    Args:
        outputs: one tensor per rank on ``dst``; ignored (may be None or empty) elsewhere.

    Raises:
        InvalidArgumentError: ``dst`` is not a rank, or ``outputs`` does not fit.
    """
    engine.checks.rank_arg(dst, "dst")
    n = input.numel()
    root = engine.rank == dst
    outs = _tensor_list(outputs, "gather_list") if root else []
    if root:
        _root_checks(engine, "gather", lambda: (
            engine.checks.per_rank(outs, input, "gather", "gather_list", "input"),
            _check_outputs(outs, "gather", "gather_list")))
    comm = engine.checks.comm_for(input, *outs)
    src = flat(input)
    buf = torch.empty(engine.size * n if root else 0, dtype=src.dtype, device=src.device)
    send = [n if r == dst else 0 for r in range(engine.size)]
    receive = [n] * engine.size if root else [0] * engine.size

    def unpack() -> None:
        for r, out in enumerate(outs):
            out.detach().copy_(buf[r * n:(r + 1) * n].view(out.shape))

    def start(seq: int) -> Pending:
        return then(comm.all_to_all_single(buf, src, receive, send, seq), unpack, src, buf)

    check = _check(engine, "all_to_all_single", None, src, None, False, (send, receive))
    return _start(engine, "gather", start, check, (input,), (outs,))


def scatter(engine: Engine, output: torch.Tensor, inputs: Optional[Sequence[torch.Tensor]], src: int) -> Handle:
    """Rank ``src``'s ``inputs[r]`` into rank ``r``'s ``output``.

    Args:
        inputs: one tensor per rank on ``src``; ignored (may be None or empty) elsewhere.

    Raises:
        InvalidArgumentError: ``src`` is not a rank, or ``inputs`` does not fit.
    """
    engine.checks.rank_arg(src, "src")
    n = output.numel()
    root = engine.rank == src
    ins = _tensor_list(inputs, "scatter_list") if root else []
    if root:
        _root_checks(engine, "scatter",
                     lambda: engine.checks.per_rank(ins, output, "scatter", "scatter_list", "output"))
    comm = engine.checks.comm_for(output, *ins)
    packed = torch.cat([flat(t) for t in ins]) if root else output.new_empty(0)
    buf, after = engine.checks.buffer(output, "scatter", "output")
    send = [n] * engine.size if root else [0] * engine.size
    receive = [n if r == src else 0 for r in range(engine.size)]

    def start(seq: int) -> Pending:
        return then(comm.all_to_all_single(buf.flatten(), packed, receive, send, seq), after, packed, buf)

    check = _check(engine, "all_to_all_single", None, packed, None, False, (send, receive))
    return _start(engine, "scatter", start, check, ins, (output,))


def all_to_all(engine: Engine, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]) -> Handle:
    """Send ``inputs[r]`` to rank ``r``; receive rank ``r``'s into ``outputs[r]`` (sizes may differ).

    Raises:
        InvalidArgumentError: not one tensor per rank in each list.
    """
    outs = _tensor_list(outputs, "output_tensor_list")
    ins = _tensor_list(inputs, "input_tensor_list")
    for name, tensors in (("output_tensor_list", outs), ("input_tensor_list", ins)):
        if len(tensors) != engine.size:
            raise InvalidArgumentError(
                f"all_to_all: {name} has {len(tensors)} tensors; it needs one per rank ({engine.size})"
            )
    comm = engine.checks.comm_for(*outs, *ins)
    send = [t.numel() for t in ins]
    receive = [t.numel() for t in outs]
    engine.checks.self_split(receive, send, "all_to_all")
    _check_outputs(outs, "all_to_all", "output_tensor_list")
    packed = torch.cat([flat(t) for t in ins])
    buf = packed.new_empty(sum(receive))

    def unpack() -> None:
        offset = 0
        for out, count in zip(outs, receive):
            out.detach().copy_(buf[offset:offset + count].view(out.shape))
            offset += count

    def start(seq: int) -> Pending:
        return then(comm.all_to_all_single(buf, packed, receive, send, seq), unpack, packed, buf)

    check = _check(engine, "all_to_all_single", None, packed, None, False, (send, receive))
    return _start(engine, "all_to_all", start, check, ins, outs)


# ---------------------------------------------------------------------------- several at once
def each(engine: Engine, start_one: Callable[..., Handle], *lists: Sequence, result: Optional[Sequence] = None
         ) -> Handle:
    """Start ``start_one(*items)`` for each position of ``lists``; the handle of them all.

    That is the last one's: the engine completes a group's collectives in issue order, so it
    is done once every one before it is; it :attr:`~smddp.comm.engine.handle.Handle.covers`
    them, so its error is the first of theirs. ``lists[0]`` holds the outputs (a tensor, or a
    list of them, per position): they are checked before any collective starts, so a bad one
    does not leave the others half done. With ``result``, the last call is
    ``start_one(*items, result=result)``: what the handle of them all gives as its result.

    Raises:
        InvalidArgumentError: the lists have different lengths, or an output has overlapping memory.
        InvalidTypeError: an output is not a dense tensor.
    """
    lengths = {len(items) for items in lists}
    if len(lengths) > 1:
        raise InvalidArgumentError(f"coalesced collective: the tensor lists have different lengths {sorted(lengths)}")
    for i, outs in enumerate(lists[0] if lists else ()):
        for out in outs if isinstance(outs, (list, tuple)) else (outs,):
            if isinstance(out, torch.Tensor) and not out.is_contiguous():
                check_writable(out, "coalesced collective", f"tensor {i}")
    calls = list(zip(*lists))
    if not calls:
        return engine.message("coalesced collective of no tensors", lambda: DONE, result or ())
    with engine.coalesced():  # one grouped launch where the library has one (NCCL's ncclGroupStart/End)
        handles = [start_one(*items) for items in calls[:-1]]
        handles.append(start_one(*calls[-1]) if result is None else start_one(*calls[-1], result=result))
    handles[-1].covers = handles[:-1]
    return handles[-1]


# ---------------------------------------------------------------------------- point-to-point
def send(engine: Engine, tensor: torch.Tensor, dst: int, tag: int) -> Handle:
    """Send ``tensor`` to rank ``dst``.

    Raises:
        InvalidArgumentError: ``dst`` is not another rank, or a negative tag.
        BackendUnavailableError: the tensor's communicator has no point-to-point.
    """
    _check_peer(engine, dst, "dst", tag)
    comm = engine.checks.comm_for(tensor)
    src = tensor.detach().contiguous()
    return engine.message(f"send to rank {dst} (tag {tag})", lambda: then(comm.send(src, dst, tag), None, src),
                          (tensor,))


def recv(engine: Engine, tensor: torch.Tensor, src: Optional[int], tag: int) -> Tuple[Handle, Callable[[], int]]:
    """Receive into ``tensor`` from rank ``src`` (None: any rank).

    Returns:
        The handle (its ``source``, and ``_source_rank()``, give the sender's rank once it is
        complete), and that function.

    Raises:
        InvalidArgumentError: ``src`` is not another rank, or a negative tag.
        BackendUnavailableError: the tensor's communicator has no point-to-point.
    """
    if src is not None:
        _check_peer(engine, src, "src", tag)
    elif isinstance(tag, bool) or not isinstance(tag, int) or tag < 0:
        raise InvalidArgumentError(f"tag must be a non-negative int, got {tag!r}")
    comm = engine.checks.comm_for(tensor)
    buf, after = engine.checks.buffer(tensor, "recv")
    started: List[Pending] = []  # the library's own Pending: it knows the sender

    def start() -> Pending:
        started.append(comm.recv(buf, src, tag))
        return then(started[0], after, buf)

    peer = "any rank" if src is None else f"rank {src}"
    handle = engine.message(f"recv from {peer} (tag {tag})", start, (tensor,))
    handle.source = lambda: started[0].source
    return handle, handle.source


def _check_peer(engine: Engine, peer, what: str, tag) -> None:
    engine.checks.rank_arg(peer, what)
    if peer == engine.rank:
        raise InvalidArgumentError(f"{what}={peer} is this rank: a rank cannot send to or receive from itself")
    if isinstance(tag, bool) or not isinstance(tag, int) or tag < 0:
        raise InvalidArgumentError(f"tag must be a non-negative int, got {tag!r}")


# ---------------------------------------------------------------------------- checks
def _tensor_list(tensors, what: str) -> List[torch.Tensor]:
    if not isinstance(tensors, (list, tuple)):
        raise InvalidTypeError(f"{what} must be a list of tensors, got {type(tensors).__name__}")
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise InvalidTypeError(f"{what}[{i}] must be a torch.Tensor, got {type(t).__name__}")
    return list(tensors)


def _check_outputs(outputs: Sequence[torch.Tensor], op: str, what: str) -> None:
    for i, out in enumerate(outputs):
        if not out.is_contiguous():
            check_writable(out, op, f"{what}[{i}]")
