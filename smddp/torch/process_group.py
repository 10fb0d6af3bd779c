"""The ``"smddp"`` backend of ``torch.distributed``: a Python ProcessGroup over the engine.

After ``init_process_group()`` torch's default group is a :class:`SmddpProcessGroup`, so
``torch.distributed.all_reduce``, torch's DDP, samplers, Hugging Face and Lightning run on
smddp's communicator. Each collective returns the engine's handle of the operation, which is
torch's ``Work`` (:class:`~smddp.comm.engine.handle.Handle`): its future is completed by the
engine, so torch's DDP overlaps gradient reduction with backward, and C++ may keep and wait on
it after Python has dropped it. A synchronous call of torch's API (torch >= 2.8 passes
``asyncOp=False`` and takes ``None`` back) runs on the engine's synchronous path instead.

torch.profiler sees every collective as it sees gloo's: the dispatcher's event
(``c10d::allreduce_``, :mod:`smddp.torch._c10d_events`) around the method, and the engine's
(``smddp:all_reduce``) from start to completion.
"""

from __future__ import annotations

import torch
import torch.distributed as tdist

from smddp import _compat
from smddp.comm.algorithms import derived
from smddp.comm.engine import Engine, Handle
from smddp.comm.engine import events as _events
from smddp.comm.engine import handle as _handle
from smddp.comm.reduction import Op
from smddp.errors import BackendUnavailableError, InvalidArgumentError
from smddp.torch import _c10d_events, _labels

BACKEND_NAME = "smddp"

_RED_OPS = {  # torch's reduction code (its RedOpType's value) to smddp's Op
    tdist.ReduceOp.RedOpType.SUM.value: Op.SUM,
    tdist.ReduceOp.RedOpType.AVG.value: Op.AVERAGE,
    tdist.ReduceOp.RedOpType.MIN.value: Op.MIN,
    tdist.ReduceOp.RedOpType.MAX.value: Op.MAX,
    tdist.ReduceOp.RedOpType.PRODUCT.value: Op.PRODUCT,
    tdist.ReduceOp.RedOpType.BAND.value: Op.BAND,
    tdist.ReduceOp.RedOpType.BOR.value: Op.BOR,
    tdist.ReduceOp.RedOpType.BXOR.value: Op.BXOR,
}
_SUPPORTED = "SUM, AVG, MIN, MAX, PRODUCT, BAND, BOR, BXOR (the bitwise ones of integer and bool tensors)"
_TORCH_REDUCE_OP = tdist.ReduceOp
_RED_OP_TYPE = tdist.ReduceOp.RedOpType
#: torch's ReduceOp hashes to its code (checked here, per kind): hash() reads it in one C call
#: where ``.op.value`` takes two, each hundreds of ns, on the path of every torch-API reduction.
_HASH_IS_CODE = all(hash(_TORCH_REDUCE_OP(_RED_OP_TYPE(code))) == code for code in _RED_OPS)
_ALLREDUCE_OPTIONS = tdist.AllreduceOptions
_SYNC_RETURNS_NONE = _compat.SYNC_RETURNS_NONE
_profiling = _events.active  # one C call
_graph_task = _compat.graph_task_id  # one C call: -1 outside autograd's backward
_DDP_GRADIENTS = _labels.DDP_GRADIENTS


# DDP's last gradient buckets are finished in the thread that runs backward for at most this
# long (an MPI all-reduce of a 25 MB bucket takes a few ms on one host); see
# SmddpProcessGroup._finish_with_backward.
_FINISH_SECONDS = 0.05


def torch_op(reduce_op) -> Op:
    """smddp's :class:`Op` for a torch ``ReduceOp`` (an options field or a constant).

    Raises:
        InvalidArgumentError: a reduction smddp does not support (a premul sum, ...), named by name.
    """
    kind = reduce_op.__class__
    if kind is _TORCH_REDUCE_OP:
        code = hash(reduce_op) if _HASH_IS_CODE else reduce_op.op.value
    elif kind is _RED_OP_TYPE:
        code = reduce_op.value
    else:
        code = None
    op = _RED_OPS.get(code)
    if op is None:
        raise InvalidArgumentError(
            f"the smddp backend does not support ReduceOp {_op_name(reduce_op)}; supported: {_SUPPORTED}")
    return op


def _op_name(reduce_op) -> str:
    """A torch reduction by its name (``PREMUL_SUM``), whatever form it came in; else its repr."""
    kind = getattr(reduce_op, "op", reduce_op)  # a ReduceOp object carries its RedOpType
    name = getattr(kind, "name", None)
    return name if isinstance(name, str) and isinstance(kind, _RED_OP_TYPE) else repr(reduce_op)


def _single(tensors, what: str) -> torch.Tensor:
    if len(tensors) != 1:
        raise InvalidArgumentError(f"{what}: the smddp backend takes one tensor per call, got {len(tensors)}")
    return tensors[0]


def _wants_work(opts) -> bool:
    """False when torch's API calls synchronously and takes ``None`` back (it waits on nothing)."""
    return not _SYNC_RETURNS_NONE or getattr(opts, "asyncOp", True)


# torch.compile sees none of this group, as it sees none of gloo's C++: the group's methods and the
# Work they return (the engine's handles), called back by torch's C++ (DDP's reducer) while a
# compiled function runs, run unseen by dynamo (_compat.opaque_to_dynamo).
_compat.opaque_to_dynamo(_handle)


@_compat.opaque_to_dynamo
class SmddpProcessGroup(tdist.ProcessGroup):
    """A torch ProcessGroup whose collectives run on an :class:`~smddp.comm.engine.Engine`.

    Every collective returns the engine's :class:`~smddp.comm.engine.handle.Handle` (torch's
    ``Work``), or None for a synchronous call of torch's API (see :func:`_wants_work`).
    On a GPU the group is a :class:`~smddp.torch.delegating_group.DelegatingProcessGroup`.
    """

    #: torch's own backend object this group hands a device's tensors to (the delegated route), and
    #: the test of a tensor for it: None here, where every tensor goes to the engine.
    delegate = None
    delegated = None

    def __init__(self, engine: Engine, rank: int, size: int, on_shutdown=None):
        super().__init__(rank, size)
        self.engine = engine
        #: The group's backend as smddp's ``get_backend()`` names it.
        self.backend_name = engine.backend
        self._on_shutdown = on_shutdown
        self._group_name = ""
        #: Device type to the seconds its torch-native backend took to create (see _functional_backends).
        self.native_backends = {}
        # MPI and the shared-memory planes move data only while a thread calls into them (gloo
        # has threads of its own): see _finish_with_backward.
        cpu = engine.comms.get("cpu")
        self._drive_in_backward = cpu is not None and cpu.progresses_in_caller
        self._backward_handles = {}

    # torch asks these of every group
    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return BACKEND_NAME

    def name(self) -> str:
        return BACKEND_NAME

    @property
    def group_name(self) -> str:
        return self._group_name

    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    def shutdown(self) -> None:
        """``destroy_process_group(group)``: close this group's engine and native backends now.

        torch calls it on every group it destroys (older versions call it only on NCCL's
        groups; there the next world group closes one left open: see
        :func:`smddp.torch.groups.create`).
        """
        if self._on_shutdown is not None:
            self._on_shutdown(self)

    # collectives torch calls by these names
    def allreduce(self, tensors, opts=None):
        # Under torch.profiler, the dispatcher's event: held by this local, it ends on return.
        _event = _c10d_events.begin("allreduce_", locals()) if _profiling() else None
        tensor = tensors[0] if len(tensors) == 1 else _single(tensors, "allreduce")
        if tensor.is_sparse:
            # Sparse tensors (an embedding's gradients) go through torch's own gloo, as with gloo.
            return self._native(tensor, "allreduce of a sparse tensor").allreduce(tensors, opts)
        if opts.__class__ is _ALLREDUCE_OPTIONS:
            reduce_op = opts.reduceOp
            # torch_op's common case inline: every torch-API all-reduce pays for this method
            op = _RED_OPS.get(hash(reduce_op)) if _HASH_IS_CODE and reduce_op.__class__ is _TORCH_REDUCE_OP else None
            if op is None:
                op = torch_op(reduce_op)
            wait_here = _SYNC_RETURNS_NONE and not opts.asyncOp  # not _wants_work(opts), inline
        else:
            op = torch_op(opts or tdist.ReduceOp.SUM)
            wait_here = _SYNC_RETURNS_NONE and not getattr(opts, "asyncOp", True)
        # Inside backward this is DDP's reducer: errors then name the uneven-batches case.
        task = _graph_task()
        label = None if task == -1 else _DDP_GRADIENTS
        if wait_here:
            self.engine.all_reduce(tensor, op, False, label)
            return None
        handle = self.engine.all_reduce(tensor, op, True, label)
        if task != -1 and self._drive_in_backward and tensor.is_cpu:
            self._finish_with_backward(handle, task)
        return handle

    def _finish_with_backward(self, handle: Handle, task: int) -> None:
        """Complete ``handle`` in this thread when the running backward pass (``task``) ends.

        DDP's reducer starts each gradient bucket's all-reduce from backward and, once
        backward ends, blocks on the buckets' futures. MPI moves data only while a thread
        calls into it; left to the progress thread, which sleeps between polls, the last
        buckets wait for its wake-ups (whole scheduler slices on a busy CPU). Finishing them
        in the thread that would otherwise block, just before the reducer's own
        end-of-backward step, takes those waits out of every training step.
        """
        if handle.done:
            return
        handles = self._backward_handles.get(task)
        if handles is None:
            handles = self._backward_handles[task] = []
            _compat.queue_backward_callback(lambda: self._finish_backward(task))
        handles.append(handle)

    def _finish_backward(self, task: int) -> None:
        self.engine.finish(self._backward_handles.pop(task, ()), _FINISH_SECONDS)

    def broadcast(self, tensors, opts=None):
        _event = _c10d_events.begin("broadcast_", locals()) if _profiling() else None
        tensor = _single(tensors, "broadcast")
        root = opts.rootRank if opts is not None else 0
        return self.engine.broadcast(tensor, root, not _SYNC_RETURNS_NONE or getattr(opts, "asyncOp", True))

    def allgather(self, output_tensors, input_tensors, opts=None):
        _event = _c10d_events.begin("allgather_", locals()) if _profiling() else None
        tensor = _single(input_tensors, "allgather")
        outputs = _single(output_tensors, "allgather")
        return self.engine.all_gather(outputs, tensor, not _SYNC_RETURNS_NONE or getattr(opts, "asyncOp", True))

    def _allgather_base(self, output, input, opts=None):
        _event = _c10d_events.begin("_allgather_base_", locals()) if _profiling() else None
        return self.engine.all_gather_into_tensor(output, input, _wants_work(opts))

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        _event = _c10d_events.begin("alltoall_base_", locals()) if _profiling() else None
        return self.engine.all_to_all_single(output, input, output_split_sizes, input_split_sizes, _wants_work(opts))

    all_to_all_single = alltoall_base

    def barrier(self, opts=None):
        _event = _c10d_events.begin("barrier", locals()) if _profiling() else None
        return self.engine.barrier(_wants_work(opts))

    # the rest of torch's ProcessGroup, built in smddp.comm.algorithms.derived
    all_gather_single = _allgather_base  # torch >= 2.13 calls it by this name

    def _reduce_scatter_base(self, output, input, opts=None):
        _event = _c10d_events.begin("_reduce_scatter_base_", locals()) if _profiling() else None
        return derived.reduce_scatter_tensor(self.engine, output, input, _reduce_op(opts))

    reduce_scatter_single = _reduce_scatter_base

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        _event = _c10d_events.begin("reduce_scatter_", locals()) if _profiling() else None
        output = _single(output_tensors, "reduce_scatter")
        inputs = _single(input_tensors, "reduce_scatter")
        return derived.reduce_scatter(self.engine, output, inputs, _reduce_op(opts), _wants_work(opts))

    def reduce(self, tensors, opts=None):
        _event = _c10d_events.begin("reduce_", locals()) if _profiling() else None
        tensor = _single(tensors, "reduce")
        self.engine.checks.rank_arg(opts.rootRank if opts is not None else 0, "dst")
        return derived.reduce(self.engine, tensor, _reduce_op(opts))

    def gather(self, output_tensors, input_tensors, opts=None):
        _event = _c10d_events.begin("gather_", locals()) if _profiling() else None
        tensor = _single(input_tensors, "gather")
        outputs = _single(output_tensors, "gather") if output_tensors else []
        root = opts.rootRank if opts is not None else 0
        return derived.gather(self.engine, outputs, tensor, root)

    def scatter(self, output_tensors, input_tensors, opts=None):
        _event = _c10d_events.begin("scatter_", locals()) if _profiling() else None
        tensor = _single(output_tensors, "scatter")
        inputs = _single(input_tensors, "scatter") if input_tensors else []
        root = opts.rootRank if opts is not None else 0
        return derived.scatter(self.engine, tensor, inputs, root)

    def alltoall(self, output_tensors, input_tensors, opts=None):
        _event = _c10d_events.begin("alltoall_", locals()) if _profiling() else None
        return derived.all_to_all(self.engine, output_tensors, input_tensors)

    def allreduce_coalesced(self, tensors, opts=None):
        _event = _c10d_events.begin("allreduce_coalesced_", locals()) if _profiling() else None
        op, engine = _reduce_op(opts), self.engine
        return derived.each(engine, lambda t, result=None: engine.all_reduce(t, op, True, None, result), tensors,
                            result=list(tensors))

    def allgather_coalesced(self, output_lists, input_tensors, opts=None):
        _event = _c10d_events.begin("allgather_coalesced_", locals()) if _profiling() else None
        # output_lists[r][i] receives rank r's input_tensors[i] (torch's all_gather_coalesced).
        _check_gather_coalesced(output_lists, input_tensors, self.size())
        per_tensor = [[outputs[i] for outputs in output_lists] for i in range(len(input_tensors))]
        engine = self.engine
        return derived.each(engine, lambda out, t, result=None: engine.all_gather(out, t, True, result),
                            per_tensor, input_tensors, result=list(output_lists))

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        _event = _c10d_events.begin("allgather_into_tensor_coalesced_", locals()) if _profiling() else None
        engine = self.engine
        return derived.each(engine, lambda out, t, result=None: engine.all_gather_into_tensor(out, t, True, result),
                            outputs, inputs, result=list(outputs))

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        _event = _c10d_events.begin("reduce_scatter_tensor_coalesced_", locals()) if _profiling() else None
        op, engine = _reduce_op(opts), self.engine
        return derived.each(
            engine, lambda out, t, result=None: derived.reduce_scatter_tensor(engine, out, t, op, result),
            outputs, inputs, result=list(outputs))

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    # point-to-point: the communicator's own, else the device's torch-native backend
    def send(self, tensors, dstRank, tag=0):  # noqa: N803 - torch's name
        _event = _c10d_events.begin("send", locals()) if _profiling() else None
        tensor = _single(tensors, "send")
        try:
            return derived.send(self.engine, tensor, dstRank, tag)
        except BackendUnavailableError:
            return self._native(tensor, "send").send(tensors, dstRank, tag)

    def recv(self, tensors, srcRank, tag=0):  # noqa: N803 - torch's name
        _event = _c10d_events.begin("recv_", locals()) if _profiling() else None
        tensor = _single(tensors, "recv")
        try:
            return derived.recv(self.engine, tensor, srcRank, tag)[0]
        except BackendUnavailableError:
            return self._native(tensor, "recv").recv(tensors, srcRank, tag)

    def recv_anysource(self, tensors, tag=0):
        _event = _c10d_events.begin("recv_any_source_", locals()) if _profiling() else None
        tensor = _single(tensors, "recv")
        try:
            return derived.recv(self.engine, tensor, None, tag)[0]
        except BackendUnavailableError:
            return self._native(tensor, "recv").recv_anysource(tensors, tag)

    def _native(self, tensor: torch.Tensor, what: str):
        try:
            return _compat.device_backend(self, tensor.device)
        except RuntimeError:
            raise BackendUnavailableError(
                f"{what}: neither the {self.backend_name!r} backend nor a torch-native one can move "
                f"{tensor.device.type} tensors point-to-point here"
            ) from None


def _check_gather_coalesced(output_lists, input_tensors, size: int) -> None:
    """gloo's argument checks of ``all_gather_coalesced``, before anything is sent."""
    if not input_tensors:
        raise InvalidArgumentError("all_gather_coalesced: requires a non-empty input tensor list")
    if len(output_lists) != size:
        raise InvalidArgumentError(
            f"all_gather_coalesced: needs one output list per rank ({size}), got {len(output_lists)}")
    for r, outputs in enumerate(output_lists):
        if len(outputs) != len(input_tensors):
            raise InvalidArgumentError(
                f"all_gather_coalesced: output list {r} has {len(outputs)} tensors; the input list has "
                f"{len(input_tensors)}")
        for i, (out, inp) in enumerate(zip(outputs, input_tensors)):
            if out.shape != inp.shape or out.dtype != inp.dtype:
                raise InvalidArgumentError(
                    f"all_gather_coalesced: output {r}[{i}] is {out.dtype} {tuple(out.shape)}; input {i} is "
                    f"{inp.dtype} {tuple(inp.shape)}: they must match")


def _reduce_op(opts) -> Op:
    return torch_op(opts.reduceOp if opts is not None else tdist.ReduceOp.SUM)
