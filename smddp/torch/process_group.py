"""The ``"smddp"`` backend of ``torch.distributed``: a Python ProcessGroup over the engine.

After ``init_process_group()`` torch's default group is a :class:`SmddpProcessGroup`, so
``torch.distributed.all_reduce``, torch's DDP, samplers, Hugging Face and Lightning run on
smddp's communicator. Work objects carry real futures, completed by the engine's progress
thread, so torch's DDP overlaps gradient reduction with backward.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import time
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as tdist

from smddp import comm
from smddp._topology import Topology, discover
from smddp.comm.algorithms import derived
from smddp.comm.base import Context, Op
from smddp.comm.engine import Engine, Handle
from smddp.comm.engine.handle import poll
from smddp.errors import BackendUnavailableError, InvalidArgumentError
from smddp.torch import _compat, _groups, _native, _rendezvous
from smddp.torch._work import RecvWork, Work

BACKEND_NAME = "smddp"

_RED_OPS = {  # torch's reduction code (its RedOpType's value) to smddp's Op
    tdist.ReduceOp.RedOpType.SUM.value: Op.SUM,
    tdist.ReduceOp.RedOpType.AVG.value: Op.AVERAGE,
    tdist.ReduceOp.RedOpType.MIN.value: Op.MIN,
    tdist.ReduceOp.RedOpType.MAX.value: Op.MAX,
    tdist.ReduceOp.RedOpType.PRODUCT.value: Op.PRODUCT,
}
_TORCH_REDUCE_OP = tdist.ReduceOp
_RED_OP_TYPE = tdist.ReduceOp.RedOpType
#: torch's ReduceOp hashes to its code (checked here, per kind): hash() reads it in one C call
#: where ``.op.value`` takes two, each hundreds of ns, on the path of every torch-API reduction.
_HASH_IS_CODE = all(hash(_TORCH_REDUCE_OP(_RED_OP_TYPE(code))) == code for code in _RED_OPS)


# DDP's last gradient buckets are finished in the thread that runs backward for at most this
# long (an MPI all-reduce of a 25 MB bucket takes a few ms on one host); see
# SmddpProcessGroup._finish_with_backward.
_FINISH_SECONDS = 0.05
_yield_cpu = getattr(os, "sched_yield", None) or (lambda: time.sleep(0))


def torch_op(reduce_op) -> Op:
    """smddp's :class:`Op` for a torch ``ReduceOp`` (an options field or a constant)."""
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
            f"the smddp backend does not support ReduceOp {reduce_op}; supported: SUM, AVG, MIN, MAX, PRODUCT"
        )
    return op


def _single(tensors, what: str) -> torch.Tensor:
    if len(tensors) != 1:
        raise InvalidArgumentError(f"{what}: the smddp backend takes one tensor per call, got {len(tensors)}")
    return tensors[0]


class SmddpProcessGroup(tdist.ProcessGroup):
    """A torch ProcessGroup whose collectives run on an :class:`~smddp.comm.engine.Engine`."""

    def __init__(self, engine: Engine, rank: int, size: int):
        super().__init__(rank, size)
        self.engine = engine
        self._group_name = ""
        #: Device type to the seconds its torch-native backend took to create (see _native).
        self.native_backends = {}
        # MPI and the shared-memory planes move data only while a thread calls into them (gloo
        # has threads of its own): see _finish_with_backward.
        cpu = engine.comms.get("cpu")
        self._drive_in_backward = cpu is not None and (cpu.name == "mpi" or cpu.plane in ("shm", "hierarchical"))
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
        groups; there the next world group closes one left open: see :func:`_create`).
        """
        if self.engine.global_ranks is None:
            if self is _current:
                destroy()
        elif _groups.forget(self):
            self.engine.close()
            _shut_down_native(self)

    # collectives torch calls by these names
    def allreduce(self, tensors, opts=None):
        tensor = _single(tensors, "allreduce")
        if tensor.is_sparse:
            # Sparse tensors (an embedding's gradients) go through torch's own gloo, as with gloo.
            return self._native(tensor, "allreduce of a sparse tensor").allreduce(tensors, opts)
        op = torch_op(opts.reduceOp if isinstance(opts, tdist.AllreduceOptions) else opts or tdist.ReduceOp.SUM)
        # Inside backward this is DDP's reducer: errors then name the uneven-batches case.
        handle = self.engine.all_reduce(tensor, op, async_op=True, backward=_compat.in_backward())
        if self._drive_in_backward and tensor.is_cpu:
            self._finish_with_backward(handle)
        return Work(handle, [tensor])

    def _finish_with_backward(self, handle: Handle) -> None:
        """Complete ``handle`` in this thread when the running backward pass ends.

        DDP's reducer starts each gradient bucket's all-reduce from backward and, once
        backward ends, blocks on the buckets' futures. MPI moves data only while a thread
        calls into it; left to the progress thread, which sleeps between polls, the last
        buckets wait for its wake-ups (whole scheduler slices on a busy CPU). Finishing them
        in the thread that would otherwise block, just before the reducer's own
        end-of-backward step, takes those waits out of every training step.
        """
        task = _compat.backward_task()
        if task == -1:
            return
        handles = self._backward_handles.get(task)
        if handles is None:
            handles = self._backward_handles[task] = []
            _compat.queue_backward_callback(lambda: self._finish_backward(task))
        handles.append(handle)

    def _finish_backward(self, task: int) -> None:
        # Poll, yielding the CPU to any other runnable thread between polls, for at most
        # _FINISH_SECONDS; past that, the progress thread completes the rest as usual. An
        # operation that completes on a thread of its own (its Pending has block()) is slept
        # on instead: polling would only take the CPU from that thread.
        give_up = time.monotonic() + _FINISH_SECONDS
        for handle in self._backward_handles.pop(task, ()):
            if not poll(handle.is_completed, give_up, getattr(handle._pending, "block", None), _yield_cpu):
                return

    def broadcast(self, tensors, opts=None):
        tensor = _single(tensors, "broadcast")
        root = opts.rootRank if opts is not None else 0
        return Work(self.engine.broadcast(tensor, root, async_op=True), [tensor])

    def allgather(self, output_tensors, input_tensors, opts=None):
        tensor = _single(input_tensors, "allgather")
        outputs = _single(output_tensors, "allgather")
        return Work(self.engine.all_gather(outputs, tensor, async_op=True), outputs)

    def _allgather_base(self, output, input, opts=None):
        return Work(self.engine.all_gather_into_tensor(output, input, async_op=True), [output])

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        handle = self.engine.all_to_all_single(output, input, output_split_sizes, input_split_sizes, async_op=True)
        return Work(handle, [output])

    all_to_all_single = alltoall_base

    def barrier(self, opts=None):
        return Work(self.engine.barrier(async_op=True), [])

    # the rest of torch's ProcessGroup, built in smddp.comm.algorithms.derived
    all_gather_single = _allgather_base  # torch >= 2.13 calls it by this name

    def _reduce_scatter_base(self, output, input, opts=None):
        return Work(derived.reduce_scatter_tensor(self.engine, output, input, _reduce_op(opts)), [output])

    reduce_scatter_single = _reduce_scatter_base

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        output = _single(output_tensors, "reduce_scatter")
        inputs = _single(input_tensors, "reduce_scatter")
        return Work(derived.reduce_scatter(self.engine, output, inputs, _reduce_op(opts)), [output])

    def reduce(self, tensors, opts=None):
        tensor = _single(tensors, "reduce")
        self.engine._check_rank(opts.rootRank if opts is not None else 0, "dst")
        return Work(derived.reduce(self.engine, tensor, _reduce_op(opts)), [tensor])

    def gather(self, output_tensors, input_tensors, opts=None):
        tensor = _single(input_tensors, "gather")
        outputs = _single(output_tensors, "gather") if output_tensors else []
        root = opts.rootRank if opts is not None else 0
        return Work(derived.gather(self.engine, outputs, tensor, root), [list(outputs)])

    def scatter(self, output_tensors, input_tensors, opts=None):
        tensor = _single(output_tensors, "scatter")
        inputs = _single(input_tensors, "scatter") if input_tensors else []
        root = opts.rootRank if opts is not None else 0
        return Work(derived.scatter(self.engine, tensor, inputs, root), [tensor])

    def alltoall(self, output_tensors, input_tensors, opts=None):
        return Work(derived.all_to_all(self.engine, output_tensors, input_tensors), list(output_tensors))

    def allreduce_coalesced(self, tensors, opts=None):
        op = _reduce_op(opts)
        joined = derived.each(lambda t: self.engine.all_reduce(t, op, async_op=True), tensors)
        return Work(joined, list(tensors))

    def allgather_coalesced(self, output_lists, input_tensors, opts=None):
        # output_lists[r][i] receives rank r's input_tensors[i] (torch's all_gather_coalesced).
        _check_gather_coalesced(output_lists, input_tensors, self.size())
        per_tensor = [[outputs[i] for outputs in output_lists] for i in range(len(input_tensors))]
        joined = derived.each(lambda out, t: self.engine.all_gather(out, t, async_op=True), per_tensor, input_tensors)
        return Work(joined, list(output_lists))

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        joined = derived.each(
            lambda out, t: self.engine.all_gather_into_tensor(out, t, async_op=True), outputs, inputs)
        return Work(joined, list(outputs))

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        op = _reduce_op(opts)
        joined = derived.each(lambda out, t: derived.reduce_scatter_tensor(self.engine, out, t, op), outputs, inputs)
        return Work(joined, list(outputs))

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    # point-to-point: the communicator's own, else the device's torch-native backend
    def send(self, tensors, dstRank, tag=0):  # noqa: N803 - torch's name
        tensor = _single(tensors, "send")
        try:
            return Work(derived.send(self.engine, tensor, dstRank, tag), [tensor])
        except BackendUnavailableError:
            return self._native(tensor, "send").send(tensors, dstRank, tag)

    def recv(self, tensors, srcRank, tag=0):  # noqa: N803 - torch's name
        tensor = _single(tensors, "recv")
        try:
            handle, source = derived.recv(self.engine, tensor, srcRank, tag)
        except BackendUnavailableError:
            return self._native(tensor, "recv").recv(tensors, srcRank, tag)
        return RecvWork(handle, [tensor], source)

    def recv_anysource(self, tensors, tag=0):
        tensor = _single(tensors, "recv")
        try:
            handle, source = derived.recv(self.engine, tensor, None, tag)
        except BackendUnavailableError:
            return self._native(tensor, "recv").recv_anysource(tensors, tag)
        return RecvWork(handle, [tensor], source)

    def _native(self, tensor: torch.Tensor, what: str):
        try:
            return self._get_backend(tensor.device)
        except RuntimeError:
            raise BackendUnavailableError(
                f"{what}: neither the {self.engine.backend!r} backend nor a torch-native one can move "
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


# ---------------------------------------------------------------------------- creation
_requested_backend: Optional[str] = None
_current: Optional[SmddpProcessGroup] = None
_world_topology: Optional[Topology] = None


#: torch destroys the world group through its shutdown() (see _compat): then ``_current``
#: alone says whether it is live, and current() costs no call into torch (it is on the path
#: of every smdistributed-API call).
_DESTROY_CALLS_SHUTDOWN = _compat.DESTROY_CALLS_SHUTDOWN


def current() -> Optional[SmddpProcessGroup]:
    """The active smddp group, if torch's default group is still it."""
    if _current is None or not (_DESTROY_CALLS_SHUTDOWN or tdist.is_initialized()):
        return None
    return _current


def request_backend(name: Optional[str]) -> None:
    """The backend the next group creation should use (None: ``SMDDP_BACKEND`` or automatic)."""
    global _requested_backend
    _requested_backend = name


def resolve_timeout(torch_timeout: timedelta) -> timedelta:
    """The collective timeout: ``SMDDP_TIMEOUT`` seconds when torch's is its default.

    Args:
        torch_timeout: the timeout torch passes (``init_process_group(timeout=...)``).

    Returns:
        ``torch_timeout``, or ``SMDDP_TIMEOUT`` seconds when it is set and
        ``torch_timeout`` is torch's default.

    Raises:
        InvalidArgumentError: ``SMDDP_TIMEOUT`` is not a number of seconds.
    """
    env = os.environ.get("SMDDP_TIMEOUT")
    if env and torch_timeout == _compat.default_timeout():
        try:
            return timedelta(seconds=float(env))
        except ValueError:
            raise InvalidArgumentError(
                f"SMDDP_TIMEOUT={env!r} is not a number of seconds; set it to how long a collective may "
                f"take (for example SMDDP_TIMEOUT=600), or unset it for torch's default"
            ) from None
    return torch_timeout


def _topology(rank: int, size: int) -> Topology:
    found = discover(os.environ)
    if (found.rank, found.size) == (rank, size):
        return found
    launcher = "explicit" if found.launcher == "none" else found.launcher
    local_size = found.local_size if found.size == size else size
    return dataclasses.replace(
        found, rank=rank, size=size, local_size=local_size, local_rank=rank % local_size,
        node_rank=rank // local_size, launcher=launcher,
    )


def _create(options, backend_options=None) -> SmddpProcessGroup:
    global _current, _world_topology
    if tdist.is_initialized():
        return _groups.create_subgroup(options, _current, _world_topology, resolve_timeout(options.timeout))
    # A world group torch destroyed without calling its shutdown() (older torch calls it
    # only on NCCL's groups): close it before its successor opens, or its threads and
    # shared memory would stay until exit, one set per init_process_group().
    destroy()
    _tear_down_at_exit()
    rank, size = options.group_rank, options.group_size
    topology = _topology(rank, size)
    timeout = resolve_timeout(options.timeout)
    # smddp's init_process_group has chosen the backend already (and probed the machine for it).
    name = _requested_backend or comm.choose_backend(None, os.environ, topology, comm.probe())
    communicators = comm.create_communicators(name, Context(topology, timeout, options.store))
    group = SmddpProcessGroup(Engine(communicators, timeout.total_seconds(), options.store), rank, size)
    group_name = getattr(options, "group_id", "") or ""
    group._set_group_name(group_name)
    # torch's functional collectives (FSDP2 state dicts, DTensor) need a native backend per device.
    group.native_backends = _native.attach(group, options.store, rank, size, timeout, group_name)
    _current, _world_topology = group, topology
    return group


def register() -> None:
    """Register the ``"smddp"`` backend with ``torch.distributed`` (idempotent).

    Also teaches torch's ``env://``, ``tcp://`` and ``file://`` rendezvous to read the job
    from the launcher (:mod:`smddp.torch._rendezvous`): under ``mpirun`` or ``srun`` no
    ``MASTER_ADDR``/``MASTER_PORT`` is needed, and a plain ``python train.py`` is a world of one.
    """
    _compat.register_backend(BACKEND_NAME, _create, ("cpu", "cuda", "xpu"))
    _rendezvous.install()


_exit_hook_registered = False


def _tear_down_at_exit() -> None:
    """Destroy the group when the interpreter exits, before it stops its threads.

    Registered before the engine exists, so it runs after the engine's own exit handling
    (``atexit`` runs handlers last-in first-out). Left to interpreter shutdown, gloo's and
    the engine's threads can wake while Python is finalizing and abort the process
    ("terminate called without an active exception") after the script has succeeded.
    """
    global _exit_hook_registered
    if _exit_hook_registered:
        return
    _exit_hook_registered = True

    def tear_down() -> None:
        if current() is None:
            return
        try:
            destroy()
            tdist.destroy_process_group()
        except Exception:  # noqa: BLE001 - exiting anyway; nothing to report to
            pass

    atexit.register(tear_down)


def destroy() -> None:
    """Close the engine and forget the group (torch's own group is destroyed by the caller)."""
    global _current
    for group in _groups.forget_all():
        group.engine.close()
        _shut_down_native(group)
    if _current is not None:
        _current.engine.close()
        _shut_down_native(_current)
        _current = None


def _shut_down_native(group: SmddpProcessGroup) -> None:
    """Stop the torch-native backends' threads now.

    A script may keep the group object alive (``pg = dist.group.WORLD``) past
    ``destroy_process_group()``; its gloo backend would then be torn down during interpreter
    shutdown, where its threads abort the process after the script has succeeded.
    """
    for device in list(group.native_backends):
        try:
            group._get_backend(torch.device(device)).shutdown()
        except Exception:  # noqa: BLE001 - a backend without shutdown, or already gone
            pass
