"""``smddp.torch.distributed``: the API of ``smdistributed.dataparallel.torch.distributed``.

Swap the import and a SageMaker training script runs anywhere::

    import smddp.torch.distributed as dist
    from smddp.torch.parallel.distributed import DistributedDataParallel as DDP

    dist.init_process_group()
    torch.cuda.set_device(dist.get_local_rank())   # on GPU machines

Names, parameters and defaults follow the smdistributed v1 reference. After
:func:`init_process_group`, ``torch.distributed`` is initialized on the same world (the
``"smddp"`` backend), so libraries that call ``torch.distributed`` directly keep working.
"""

from __future__ import annotations

import enum
import os
from datetime import timedelta
from typing import Optional, Sequence

import torch
import torch.distributed as tdist

from smddp import _compat, comm
from smddp.comm.engine import Engine, Handle
from smddp.comm.reduction import Op
from smddp.comm.store import make_store
from smddp.errors import (
    InvalidArgumentError,
    InvalidGroupError,
    InvalidTypeError,
    NotInitializedError,
)
from smddp.job import excepthook
from smddp.job.topology import discover
from smddp.torch import _repeated_init, groups, process_group

__all__ = [
    "ReduceOp",
    "group",
    "is_available",
    "init_process_group",
    "is_initialized",
    "destroy_process_group",
    "get_world_size",
    "get_rank",
    "get_local_rank",
    "get_local_size",
    "get_backend",
    "all_reduce",
    "broadcast",
    "all_gather",
    "all_to_all_single",
    "barrier",
]


class ReduceOp(enum.Enum):
    """An enum-like class for supported reduction operations in smddp.

    The values of this class can be accessed as attributes, for example,
    ``ReduceOp.SUM``. They are used in specifying strategies for reduction collectives such
    as :func:`all_reduce`. ``torch.distributed.ReduceOp.SUM``, ``AVG``, ``MIN`` and ``MAX``
    are accepted too.
    """

    AVERAGE = "average"
    SUM = "sum"
    MIN = "min"
    MAX = "max"

    __hash__ = object.__hash__  # singletons compared by identity: hashed in C (see _op)


class _World:
    __slots__ = ()

    def __repr__(self) -> str:
        return "smddp.torch.distributed.group.WORLD"


class group:  # noqa: N801 - the reference's name
    """Process groups. Only ``group.WORLD``, every process of the job, is supported."""

    WORLD = _World()


_WORLD = group.WORLD


_OPS = {ReduceOp.AVERAGE: Op.AVERAGE, ReduceOp.SUM: Op.SUM, ReduceOp.MIN: Op.MIN, ReduceOp.MAX: Op.MAX}
_V1_OPS = frozenset(_OPS.values())

_INIT_KWARGS = ("backend", "init_method", "timeout", "world_size", "rank", "store", "group_name",
                "pg_options", "device_id")


# ---------------------------------------------------------------------------- checks
def _group() -> process_group.SmddpProcessGroup:
    pg = groups.current()
    if pg is None:
        raise NotInitializedError(
            "smddp is not initialized: call smddp.torch.distributed.init_process_group() first"
        )
    return pg


def _engine() -> Engine:
    return _group().engine


def _check_group(grp) -> None:
    if grp is None or grp is group.WORLD:
        return
    pg = groups.current()
    if pg is not None and grp is pg:
        return
    raise InvalidGroupError(
        f"smddp.torch.distributed's functions take only smddp.torch.distributed.group.WORLD, as "
        f"smdistributed's reference says; got {grp!r}. For a subgroup (torch.distributed.new_group, "
        f"DeviceMesh) call torch.distributed's function with group=... instead"
    )


def _check_tensor(tensor, what: str = "tensor") -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise InvalidTypeError(f"{what} must be a torch.Tensor, got {type(tensor).__name__}")
    return tensor


def _op(op) -> Op:
    if op is None:
        return Op.SUM
    if op.__class__ is ReduceOp:  # the common case first: one lookup
        return _OPS[op]
    try:
        found = process_group.torch_op(op)  # torch's ReduceOp: one translation of it, the backend's
    except InvalidArgumentError:
        found = None
    if found not in _V1_OPS:  # the reference's four
        name = getattr(getattr(op, "op", op), "name", None) or getattr(found, "name", None) or repr(op)
        raise InvalidArgumentError(
            f"unsupported reduction op {name}; supported: ReduceOp.AVERAGE, ReduceOp.SUM, ReduceOp.MIN, ReduceOp.MAX "
            f"(smdistributed's four; torch.distributed.all_reduce takes PRODUCT and BAND, BOR, BXOR)"
        )
    return found


# ---------------------------------------------------------------------------- the delegated route
#: smdistributed's reductions as torch's, for a group's device tensors (torch's own backend takes them).
_TORCH_OPS = {Op.AVERAGE: tdist.ReduceOp.AVG, Op.SUM: tdist.ReduceOp.SUM, Op.MIN: tdist.ReduceOp.MIN,
              Op.MAX: tdist.ReduceOp.MAX}


def _options(kind, async_op: bool):
    """torch's options of kind ``kind`` for a call, as ``torch.distributed``'s functions make them."""
    opts = kind()
    if _compat.SYNC_RETURNS_NONE:
        opts.asyncOp = async_op
    return opts


def _as_torch(work, async_op: bool):
    """What ``torch.distributed``'s functions do with the Work of a device collective: hand it back
    (asynchronous), or wait on it here (which orders the caller's stream, as torch's own call)."""
    if async_op:
        return work
    if work is not None:
        work.wait()
    return None


# ---------------------------------------------------------------------------- setup
def is_available() -> bool:
    """Check if script started as a distributed job.

    For local runs user can check that is_available returns False and run the training
    script without calls to smddp.

    Returns:
        ``True`` if started as a distributed job (by mpirun, smddprun, torchrun, srun, or on
        several SageMaker hosts), ``False`` otherwise.
    """
    return discover(os.environ).distributed


def init_process_group(*args, **kwargs) -> None:
    """Initialize smddp. Must be called at the beginning of the training script, before
    calling any other methods.

    After this call, :func:`is_initialized` returns ``True``, and so does
    ``torch.distributed.is_initialized()``: torch's default group is smddp's.
    A plain ``python train.py`` gets rank 0 of a world of one, without MPI or ports.

    Calling it again once initialized (a library that initializes too) returns and changes
    nothing when the call has no arguments or only the running group's own (its backend,
    timeout, rank, world size, and the rendezvous and device it was made with); a call that asks
    for anything else raises, as torch raises on any second initialization. To initialize with
    other arguments, call :func:`destroy_process_group` first.

    Args:
        backend (str, optional): ``"mpi"``, ``"gloo"``, ``"nccl"``, ``"torch-nccl"``,
            ``"xccl"``, ``"local"``, or ``None``/``"smddp"``/``"auto"`` to choose from the
            machine and launcher. Overrides the ``SMDDP_BACKEND`` environment variable.
        timeout (datetime.timedelta, optional): how long a collective may take before
            :class:`smddp.CollectiveTimeout`; default ``SMDDP_TIMEOUT`` seconds, else 30 minutes.
        init_method, world_size, rank, store, group_name, pg_options, device_id: as in
            ``torch.distributed.init_process_group``, for scripts written for it.

    Under an MPI launcher, a rank that fails here (or later) with an exception it does not catch
    ends every rank of the job (``MPI_Abort``) instead of leaving them waiting for it.

    Raises:
        BackendUnavailableError: an unknown backend (the valid ones are listed), or one
            whose library is not installed (the pip extra is named).
        InvalidArgumentError: an ``SMDDP_*`` variable or a launcher's (``RANK``, ``WORLD_SIZE``,
            ``MASTER_PORT`` ...) has a value outside what it takes (the error names it, its value,
            where it came from and what is allowed; ``SMDDP_TIMEOUT`` above 0, or ``none``); or, once
            initialized, an argument asks for something the running group is not (the message
            names each one beside the group's value).
        TypeError: an argument torch's ``init_process_group`` does not have either.
    """
    if len(args) > 1:
        raise TypeError("init_process_group() takes at most one positional argument (backend)")
    unknown = sorted(set(kwargs) - set(_INIT_KWARGS))
    if unknown:
        raise TypeError(f"init_process_group() got unexpected keyword arguments: {', '.join(unknown)}")
    if args:
        if "backend" in kwargs:
            raise TypeError("init_process_group() got backend twice")
        kwargs["backend"] = args[0]
    world = groups.current()
    if world is not None:
        _repeated_init.check(world, kwargs)
        return
    if excepthook.mpi_running():
        # The script started MPI and smddp joins it: from here a rank whose set-up fails ends the job
        # (MPI_Abort), or the others would wait for it while it waits in MPI_Finalize. Where smddp
        # starts MPI itself, it arms the same path then (smddp.job.mca.one_host_defaults).
        excepthook.install()
    timeout = kwargs.get("timeout")
    if timeout is None:
        timeout = groups.resolve_timeout(_compat.default_timeout())
    elif not isinstance(timeout, timedelta):
        raise InvalidTypeError(f"timeout must be a datetime.timedelta, got {type(timeout).__name__}")
    rank, world_size = kwargs.get("rank"), kwargs.get("world_size")
    if rank == -1 and world_size == -1:  # torch's defaults
        rank = world_size = None
    topology = discover(os.environ, rank, world_size)
    backend = kwargs.get("backend")
    name = comm.choose_backend(None if backend in (None, "smddp") else backend, os.environ, topology, comm.probe())
    comm.backend_class(name)  # fail here, naming the pip extra, before any rendezvous

    groups.register()
    groups.request_backend(name)
    extra = {k: kwargs[k] for k in ("group_name", "pg_options", "device_id") if kwargs.get(k) is not None}
    try:
        store = kwargs.get("store")
        init_method = kwargs.get("init_method")
        if store is None and (init_method is not None or topology.launcher == "torchrun"):
            tdist.init_process_group(
                process_group.BACKEND_NAME, init_method=init_method or "env://", timeout=timeout,
                rank=topology.rank if rank is not None else -1,
                world_size=topology.size if world_size is not None else -1, **extra,
            )
        else:
            tdist.init_process_group(
                process_group.BACKEND_NAME, store=store or make_store(topology, timeout),
                rank=topology.rank, world_size=topology.size, timeout=timeout, **extra,
            )
    finally:
        groups.request_backend(None)
    _repeated_init.remember(groups.current(), kwargs)


def is_initialized() -> bool:
    """Checks if the default process group has been initialized.

    Returns:
        ``True`` if initialized, else ``False``.
    """
    return groups.current() is not None


def destroy_process_group() -> None:
    """Tear down smddp and torch's default group; :func:`init_process_group` may be called again."""
    if groups.current() is None:
        return
    groups.destroy()
    tdist.destroy_process_group()


def get_world_size(group=group.WORLD) -> int:
    """The total number of processes (GPUs) across all the nodes in the cluster.

    For example, in a 8 node cluster with 8 GPU each, size will be equal to 64.

    Args:
        group: only ``group.WORLD`` is supported; the parameter exists for API parity
            with ``torch.distributed``.

    Returns:
        An integer scalar containing the total number of processes in the training job.

    Raises:
        NotInitializedError: called before :func:`init_process_group`.
        InvalidGroupError: ``group`` is not ``group.WORLD``.
    """
    engine = _engine()
    _check_group(group)
    return engine.size


def get_rank(group=group.WORLD) -> int:
    """The rank of the process in the job, from 0 to ``get_world_size() - 1``.

    This is similar to MPI's world rank.

    Args:
        group: only ``group.WORLD`` is supported.

    Returns:
        An integer scalar containing the rank of the worker.

    Raises:
        NotInitializedError: called before :func:`init_process_group`.
        InvalidGroupError: ``group`` is not ``group.WORLD``.
    """
    engine = _engine()
    _check_group(group)
    return engine.rank


def get_local_rank() -> int:
    """Local rank refers to the relative rank of the smddp process within the node the
    current process is running on.

    For example, if a node contains 8 GPUs, it has 8 smddp processes, each with a
    ``local_rank`` ranging from 0 to 7. Use it to pin one GPU per process:
    ``torch.cuda.set_device(dist.get_local_rank())``.

    Returns:
        An integer scalar containing the rank of the GPU and its smddp process on this node.

    Raises:
        NotInitializedError: called before :func:`init_process_group`.
    """
    return _engine().primary.local_rank


def get_local_size() -> int:
    """The number of smddp processes on the node the current process is running on.

    Raises:
        NotInitializedError: called before :func:`init_process_group`.
    """
    return _engine().primary.local_size


def get_backend() -> str:
    """The name of the active backend (``"mpi"``, ``"gloo"``, ``"nccl"``, ``"local"``, ...).

    Raises:
        NotInitializedError: called before :func:`init_process_group`.
    """
    return _group().backend_name


# ---------------------------------------------------------------------------- collectives
def all_reduce(tensor, op=ReduceOp.SUM, group=group.WORLD, async_op=False) -> Optional[Handle]:
    """Performs an all-reduce operation on a tensor across all smddp workers.

    The tensor is reduced across all workers in such a way that all get the final
    result; after the call ``tensor`` is bitwise identical in all processes.

    Args:
        tensor (torch.Tensor): input and output of the collective; the function operates
            in place (non-contiguous tensors too).
        op (ReduceOp): the reduction to combine tensors across ranks: ``AVERAGE``, ``SUM``,
            ``MIN`` or ``MAX``. Defaults to ``SUM`` (also when ``None`` is given). Integer
            ``AVERAGE`` rounds toward zero.
        group: only ``group.WORLD`` is supported.
        async_op (bool): whether this op should be an async op. Defaults to ``False``.

    Returns:
        Async op work handle (``wait()``, ``is_completed()``) if ``async_op`` is True,
        ``None`` otherwise.

    Raises:
        NotInitializedError: called before :func:`init_process_group`.
        InvalidGroupError: ``group`` is not ``group.WORLD``.
        InvalidTypeError: ``tensor`` is not a tensor, or its dtype is not supported.
        InvalidArgumentError: ``op`` is not one of the supported ops.
        CollectiveTimeout: the other ranks did not join within the timeout.
    """
    pg = _group()
    if group is not _WORLD:  # the checks' common case inline: the call costs microseconds
        _check_group(group)
    if not isinstance(tensor, torch.Tensor):
        _check_tensor(tensor)
    if pg.delegated is not None and pg.delegated(tensor):  # a GPU's tensor: torch's own group
        opts = _options(tdist.AllreduceOptions, async_op)
        opts.reduceOp = _TORCH_OPS[_op(op)]
        return _as_torch(pg.allreduce([tensor], opts), async_op)
    return pg.engine.all_reduce(tensor, _op(op), async_op)  # the engine's Handle, or None when synchronous


def broadcast(tensor, src=0, group=group.WORLD, async_op=False) -> Optional[Handle]:
    """Broadcasts the tensor to the whole group.

    Args:
        tensor (torch.Tensor): data to be sent if ``src`` is the rank of the current
            process, and tensor to be used to save received data otherwise.
        src (int): source rank. Defaults to 0.
        group: only ``group.WORLD`` is supported.
        async_op (bool): whether this op should be an async op. Defaults to ``False``.

    Returns:
        Async op work handle if ``async_op`` is True, ``None`` otherwise.

    Raises:
        NotInitializedError, InvalidGroupError, InvalidTypeError: as :func:`all_reduce`.
        InvalidArgumentError: ``src`` is not a rank of the job.
        CollectiveTimeout: the other ranks did not join within the timeout.
    """
    pg = _group()
    _check_group(group)
    _check_tensor(tensor)
    if pg.delegated is not None and pg.delegated(tensor):
        pg.engine.checks.rank_arg(src, "src")
        opts = _options(_compat.BroadcastOptions, async_op)
        opts.rootRank, opts.rootTensor = src, 0
        return _as_torch(pg.broadcast([tensor], opts), async_op)
    return pg.engine.broadcast(tensor, src, async_op)


def all_gather(tensor_list, tensor, group=group.WORLD, async_op=False) -> Optional[Handle]:
    """Gathers tensors from the whole group in a list.

    Args:
        tensor_list (list[torch.Tensor]): output list. It should contain one correctly
            sized tensor per rank; ``tensor_list[i]`` receives rank ``i``'s tensor.
        tensor (torch.Tensor): tensor to be broadcast from current process.
        group: only ``group.WORLD`` is supported.
        async_op (bool): whether this op should be an async op. Defaults to ``False``.

    Returns:
        Async op work handle if ``async_op`` is True, ``None`` otherwise.

    Raises:
        NotInitializedError, InvalidGroupError: as :func:`all_reduce`.
        InvalidTypeError: a non-tensor, or dtypes that differ.
        InvalidArgumentError: ``tensor_list`` does not hold one tensor per rank, or one has
            a different number of elements than ``tensor``.
        CollectiveTimeout: the other ranks did not join within the timeout.
    """
    pg = _group()
    _check_group(group)
    _check_tensor(tensor)
    if not isinstance(tensor_list, (list, tuple)):
        raise InvalidTypeError(f"tensor_list must be a list of tensors, got {type(tensor_list).__name__}")
    for i, out in enumerate(tensor_list):
        _check_tensor(out, f"tensor_list[{i}]")
    if pg.delegated is not None and pg.delegated(tensor):
        pg.engine.checks.per_rank(tensor_list, tensor, "all_gather", "tensor_list", "input")
        return _as_torch(pg.allgather([list(tensor_list)], [tensor], _options(_compat.AllgatherOptions, async_op)),
                         async_op)
    return pg.engine.all_gather(tensor_list, tensor, async_op)


def all_to_all_single(
    output_t,
    input_t,
    output_split_sizes: Optional[Sequence[int]] = None,
    input_split_sizes: Optional[Sequence[int]] = None,
    group=group.WORLD,
    async_op=False,
) -> Optional[Handle]:
    """Each process scatters input tensor to all processes in a group and return gathered
    tensor in output.

    Slices are taken along dim 0: rank ``j`` receives ``input_split_sizes[j]`` rows of
    ``input_t``, and ``output_t`` receives ``output_split_sizes[i]`` rows from rank ``i``,
    in rank order. Without split sizes dim 0 is split equally.

    Args:
        output_t (torch.Tensor): gathered output.
        input_t (torch.Tensor): input to scatter.
        output_split_sizes (list[int], optional): rows received from each rank.
        input_split_sizes (list[int], optional): rows sent to each rank.
        group: only ``group.WORLD`` is supported.
        async_op (bool): whether this op should be an async op. Defaults to ``False``.

    Returns:
        Async op work handle if ``async_op`` is True, ``None`` otherwise.

    Raises:
        NotInitializedError, InvalidGroupError, InvalidTypeError: as :func:`all_reduce`.
        InvalidArgumentError: split sizes that are not one per rank or do not add up to
            dim 0, or a dim 0 that does not divide equally without them.
        CollectiveTimeout: the other ranks did not join within the timeout.
    """
    pg = _group()
    _check_group(group)
    _check_tensor(output_t, "output_t")
    _check_tensor(input_t, "input_t")
    if pg.delegated is not None and pg.delegated(input_t):
        checks = pg.engine.checks
        out_counts = checks.split_counts(output_t, output_split_sizes, "output")
        in_counts = checks.split_counts(input_t, input_split_sizes, "input")
        checks.self_split(out_counts, in_counts, "all_to_all_single")
        work = pg.alltoall_base(output_t, input_t, list(output_split_sizes or []), list(input_split_sizes or []),
                                _options(_compat.AllToAllOptions, async_op))
        return _as_torch(work, async_op)
    return pg.engine.all_to_all_single(output_t, input_t, output_split_sizes, input_split_sizes, async_op)


def barrier(group=group.WORLD, async_op=False) -> Optional[Handle]:
    """Synchronizes all smddp processes.

    Args:
        group: only ``group.WORLD`` is supported.
        async_op (bool): whether this op should be an async op. Defaults to ``False``.

    Returns:
        Async op work handle if ``async_op`` is True, ``None`` otherwise.

    Raises:
        NotInitializedError, InvalidGroupError: as :func:`all_reduce`.
        CollectiveTimeout: the other ranks did not arrive within the timeout.
    """
    pg = _group()
    _check_group(group)
    if pg.delegate is not None:  # a GPU job: torch's barrier on the group's device, as torch's own group
        opts = _options(_compat.BarrierOptions, async_op)
        if pg.delegate.device.index is not None:
            opts.device_ids = [pg.delegate.device.index]
        return _as_torch(pg.barrier(opts), async_op)
    return pg.engine.barrier(async_op)
