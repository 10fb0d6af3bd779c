"""The private torch APIs smddp relies on, each wrapped in one place.

When torch changes one of these, this file is the only one to mend. Each says which torch
versions have it, checked against the wheels of torch 2.4.0, 2.9.0, 2.10.0, 2.11.0 and 2.13.0
(``setup.cfg`` admits torch >= 2.4; the test suite runs on 2.13, and the NCCL communicator's tests
(``tests/comm/backends/nccl/``) and the torch-API tests were also run on 2.11.0, the GPU machine's),
and what a version without it gets.
"""

from __future__ import annotations

import sys
import types
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as tdist

#: torch 2.8 and later: every function of ``torch.distributed`` that passes ``asyncOp=False``
#: to a process group accepts ``None`` back (the backend has completed the call); earlier ones
#: call ``wait()`` on what they get.
SYNC_RETURNS_NONE = torch.__version__ >= (2, 8)

_C10D_GLOBALS = vars(sys.modules["torch.distributed.distributed_c10d"])


def requested_device_id() -> torch.device | None:
    """The ``device_id`` torch's ``init_process_group`` or ``new_group`` was given, while torch
    creates the group (called from the backend's creator); None outside that or without one.

    torch hands ``device_id`` to ``_new_process_group_helper`` (a parameter in 2.4 through 2.13)
    but not to a third-party backend's creator, and sets ``bound_device_id`` only on the group
    object it then replaces with the backend's own. So it is read from that frame; a torch whose
    helper lacks it gives None, and the device is chosen as without ``device_id``.
    """
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "_new_process_group_helper" and frame.f_globals is _C10D_GLOBALS:
            device = frame.f_locals.get("device_id")
            return device if isinstance(device, torch.device) else None
        frame = frame.f_back
    return None


def register_backend(name: str, creator: Callable, devices) -> None:
    """Register ``creator(options, backend_options)`` as torch backend ``name`` (once).

    ``extended_api`` and ``devices``: keyword arguments of ``Backend.register_backend`` in 2.4 to 2.13.
    """
    if getattr(tdist.Backend, name.upper(), None) is not None:
        return
    tdist.Backend.register_backend(name, creator, extended_api=True, devices=list(devices))


#: torch 2.7 and later call every group's ``shutdown()`` from ``destroy_process_group()``
#: (2.9, 2.10, 2.11 and 2.13 checked); torch 2.4 to 2.6 call it only on NCCL's (their
#: ``_shutdown_backend``), and there the next ``init_process_group()`` closes the old world.
DESTROY_CALLS_SHUTDOWN = torch.__version__ >= (2, 7)


def rendezvous_handlers() -> dict:
    """torch's table of ``init_method`` schemes to rendezvous functions (``_rendezvous_handlers``, 2.4 to 2.13)."""
    return sys.modules["torch.distributed.rendezvous"]._rendezvous_handlers


def default_timeout():
    """torch's default process-group timeout (30 minutes for non-NCCL backends)."""
    from torch.distributed import constants

    return constants.default_pg_timeout


#: The id of the autograd backward pass running in this thread, -1 outside one (a C function:
#: ``torch._C._current_graph_task_id``, 2.4 to 2.13; without it nothing counts as inside backward).
graph_task_id = getattr(torch._C, "_current_graph_task_id", None) or (lambda: -1)


def in_backward() -> bool:
    """True inside autograd's backward pass (where DDP's reducer starts its all-reduces)."""
    return graph_task_id() != -1


# ---------------------------------------------------------------------------- native backends
def backend_type(name: str):
    """torch's ``ProcessGroup.BackendType`` member called ``name`` (``"GLOO"``, ``"NCCL"``; ``"XCCL"`` from 2.8)."""
    return getattr(tdist.ProcessGroup.BackendType, name)


def register_device_backend(pg, device_type: str, backend_type_name: str, backend) -> None:
    """Make ``backend`` serve ``device_type`` tensors of ``pg`` in torch's C++ dispatch
    (``ProcessGroup._register_backend``, 2.4 to 2.13)."""
    pg._register_backend(torch.device(device_type), backend_type(backend_type_name), backend)


def gloo_options(devices, timeout, threads=None):
    """``ProcessGroupGloo``'s options with these devices, timeout and worker threads (None: torch's).

    ``ProcessGroupGloo._Options`` and its ``_devices``, ``_timeout`` and ``_threads``: private in
    torch, stable since 1.x (2.4 to 2.14 checked): the only way to give gloo its devices.
    """
    options = tdist.ProcessGroupGloo._Options()
    options._devices = devices
    options._timeout = timeout
    if threads is not None:
        options._threads = threads
    return options


def name_backend(backend, group_name: str, size: int, ranks: Optional[Sequence[int]] = None):
    """Give a torch-native backend its group's name and global ``ranks`` (default ``range(size)``), as
    torch's own groups have them."""
    backend.options.group_name = group_name
    backend.options.global_ranks_in_group = list(range(size)) if ranks is None else list(ranks)
    return backend


def nccl_backend(store, rank: int, size: int, timeout, group_name: Optional[str] = None,
                 ranks: Optional[Sequence[int]] = None, split_from=None):
    """A ``ProcessGroupNCCL`` (its communicator is created on first use), named as its group if
    ``group_name`` is given, as torch's ``new_group`` makes one.

    ``ranks``: the group's global ranks (default ``range(size)``). ``split_from``: the world's
    ``ProcessGroupNCCL``, whose communicator the new one is split from (``ncclCommSplit``, with
    torch's colour for ``ranks``); torch then calls the non-members' side itself (see
    :func:`smddp.comm.backends.torch_native.create`).

    ``Options``' ``is_high_priority_stream``, ``_timeout``, ``group_name`` and
    ``global_ranks_in_group``: 2.4 to 2.13; ``split_from`` and ``split_color``: 2.3 and later
    (a torch without them makes the subgroup's communicator from the group's store instead).
    """
    options = tdist.ProcessGroupNCCL.Options()
    options.is_high_priority_stream = False
    options._timeout = timeout
    ranks = list(range(size)) if ranks is None else list(ranks)
    if group_name is not None:
        options.group_name = group_name
        options.global_ranks_in_group = ranks
    if split_from is not None and hasattr(options, "split_from"):
        options.split_from = split_from
        options.split_color = process_group_color(ranks)
    return tdist.ProcessGroupNCCL(store, rank, size, options)


def process_group_color(ranks: Sequence[int]) -> int:
    """torch's ``ncclCommSplit`` colour for the group of global ``ranks`` (``_process_group_color``,
    2.3 to 2.13): every member computes the same one."""
    return tdist.distributed_c10d._process_group_color(list(ranks))


def set_sequence_number(backend) -> None:
    """Start ``backend``'s collective sequence numbers as torch does for the groups it makes
    (``_set_sequence_number_for_group``, gloo's and NCCL's, 2.4 to 2.13; absent elsewhere: nothing)."""
    start = getattr(backend, "_set_sequence_number_for_group", None)
    if start is not None:
        start()


def debug_wrapper(backend, store, group_name: str, rank: int, size: int, timeout):
    """``backend`` inside torch's ``ProcessGroupWrapper``, as ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` wraps
    torch's own groups: before each collective the ranks compare its kind, shapes and dtypes over a
    gloo group of the wrapper's own and raise, naming both calls, where they differ
    (``distributed_c10d._create_process_group_wrapper``, 2.4 to 2.13)."""
    return tdist.distributed_c10d._create_process_group_wrapper(
        wrapped_pg=backend, store_prefix=group_name, store=store, rank=rank, world_size=size, timeout=timeout)


def plain_group(store, rank: int, size: int, device_type: str, backend_type_name: str, backend):
    """A torch ``ProcessGroup`` (C++) whose ``device_type`` tensors go to ``backend`` through torch's
    dispatcher, for the collectives a c10d ``Backend``'s Python binding lacks
    (``allgather_into_tensor_coalesced``, ``reduce_scatter_tensor_coalesced``: 2.4 to 2.13).
    ``ProcessGroup(store, rank, size)``, ``_set_default_backend`` and ``_register_backend``: 2.4 to 2.13."""
    group = tdist.ProcessGroup(store, rank, size)
    group._set_default_backend(backend_type(backend_type_name))
    group._register_backend(torch.device(device_type), backend_type(backend_type_name), backend)
    return group


def xccl_backend(store, rank: int, size: int, timeout, group_name: Optional[str] = None,
                 ranks: Optional[Sequence[int]] = None):
    """A ``ProcessGroupXCCL`` (torch >= 2.8 XPU builds), named as its group of global ``ranks``
    (default ``range(size)``) if ``group_name`` is given; early XPU builds take no options."""
    try:
        options = tdist.ProcessGroupXCCL.Options()
        options._timeout = timeout
    except AttributeError:
        return tdist.ProcessGroupXCCL(store, rank, size)
    if group_name is not None:
        options.group_name = group_name
        options.global_ranks_in_group = list(range(size)) if ranks is None else list(ranks)
    return tdist.ProcessGroupXCCL(store, rank, size, options)


def plugin_backend(name: str, store, rank: int, size: int, timeout):
    """A backend a third-party plugin registered with torch (``"CCL"``: oneCCL's bindings), or None
    if none is registered under ``name`` (``Backend._plugins`` and ``_DistributedBackendOptions``:
    2.4 to 2.14)."""
    plugin = tdist.Backend._plugins.get(name)
    if plugin is None:
        return None
    if getattr(plugin, "extended_api", False):
        options = tdist.distributed_c10d._DistributedBackendOptions()
        options.store, options.group_rank, options.group_size, options.timeout = store, rank, size, timeout
        options.group_id = "smddp"
        options.global_ranks_in_group = list(range(size))
        return plugin.creator_fn(options, None)
    return plugin.creator_fn(store, rank, size, timeout)


def set_group_name(group, name: str) -> None:
    """Give a ProcessGroup its name (``ProcessGroup._set_group_name``, 2.4 to 2.14)."""
    group._set_group_name(name)


def device_backend(group, device: torch.device):
    """The backend ``group`` runs ``device``'s tensors on (``ProcessGroup._get_backend``, 2.4 to 2.14)."""
    return group._get_backend(device)


def register_builtin_comm_hook(ddp_class, ddp, comm_hook_type) -> None:
    """``ddp_class``'s ``_register_builtin_comm_hook`` on ``ddp`` (torch's DDP, 2.4 to 2.14)."""
    ddp_class._register_builtin_comm_hook(ddp, comm_hook_type)


# ---------------------------------------------------------------------------- c10d's Work and the profiler
#: The options of c10d's collectives (``torch._C._distributed_c10d``'s; torch.distributed re-exports
#: some of them, not ``AllgatherOptions``, in 2.4 to 2.14).
_C10D = torch._C._distributed_c10d
AllgatherOptions, AllreduceOptions, AllToAllOptions, BarrierOptions, BroadcastOptions = (
    _C10D.AllgatherOptions, _C10D.AllreduceOptions, _C10D.AllToAllOptions, _C10D.BarrierOptions,
    _C10D.BroadcastOptions)
#: The C++ ``Work`` whose ``wait()`` calls a Python function (torch 2.10 and later), or None.
PythonCallbackWork = getattr(_C10D, "PythonCallbackWork", None)

#: True while torch's profiler records in the calling thread (one C call, 2.4 to 2.14).
profiler_enabled = torch._C._autograd._profiler_enabled
#: Begin and end a ``record_function`` event with arguments (``torch.autograd``'s private
#: ``_record_function_with_args_enter``/``_exit``, 2.4 to 2.14).
record_function_enter = torch.autograd._record_function_with_args_enter
record_function_exit = torch.autograd._record_function_with_args_exit
#: torch's fast ``RecordFunction`` (the dispatcher's events; ``torch._C._profiler._RecordFunctionFast``, 2.4 to 2.14).
RecordFunctionFast = torch._C._profiler._RecordFunctionFast


def end_record_function_on(event, future) -> None:
    """End profiler ``event`` when ``future`` completes (``torch.ops.profiler._call_end_callbacks_on_jit_fut``)."""
    torch.ops.profiler._call_end_callbacks_on_jit_fut._RecordFunction(event, future)


# ---------------------------------------------------------------------------- torch.compile
_eval_frame = getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None)
_set_code_exec_strategy = getattr(_eval_frame, "set_code_exec_strategy", None)
_FrameAction = getattr(_eval_frame, "_FrameAction", None)
_FrameExecStrategy = getattr(_eval_frame, "_FrameExecStrategy", None)

#: Whether :func:`opaque_to_dynamo` can hide code from torch.compile (torch 2.7 and later).
DYNAMO_OPAQUE = None not in (_set_code_exec_strategy, _FrameAction, _FrameExecStrategy)


def opaque_to_dynamo(*targets):
    """Have torch.compile run ``targets``, and all they call, as it runs C++: unseen, eagerly.

    While a compiled function runs, dynamo's frame hook sees every Python frame its thread starts,
    those C++ calls back into included. torch's DDP forward runs eagerly under it, and its reducer
    calls the group's ``broadcast`` (the bucket rebuild of the second step, buffers), ``allreduce``
    (``join()``) and the ``Work``'s ``wait()``; a ``backward()`` inside a compiled function runs
    the reducer's all-reduces and communication hook under the hook too. gloo's methods are C++;
    a Python group's are traced (torch 2.13: and fail, dynamo taking ``self``, a
    ``ProcessGroup``, for an opaque script object whose attributes it refuses). Here each code
    object of ``targets`` gets dynamo's exec strategy ``(SKIP, SKIP)``, the one dynamo gives a
    frame it must skip with all it calls (its ``SkipCodeRecursiveException``): the frame runs
    with the hook off. Eager code pays nothing: only the hook reads the strategy, and torch
    installs the hook only while a compiled function runs.

    ``torch._C._dynamo.eval_frame.set_code_exec_strategy``, ``_FrameAction`` and
    ``_FrameExecStrategy``: torch 2.7 to 2.14 (2.7.0, 2.13.0 and 2.14.1 checked). torch 2.4 to
    2.6 lack them (2.6.0 checked: a non-recursive ``skip_code``, and a recursive skip only
    dynamo's callback can ask for): there this does nothing, and dynamo may trace the group's
    methods as it did before; ``DDP(torch.compile(model))`` keeps DDP's forward out of dynamo
    on every version.

    Args:
        targets: functions, classes (their functions, properties, static and class methods)
            and modules (the functions and classes defined in them); nested functions and
            lambdas included, for C++ may call those later (future callbacks).

    Returns:
        The first target, so that this decorates a class or a function.
    """
    if DYNAMO_OPAQUE:
        strategy = _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP)
        for target in targets:
            for code in _code_objects(target):
                _set_code_exec_strategy(code, strategy)
    return targets[0] if targets else None


def _code_objects(target, seen=None):
    """Every code object defined in ``target`` (a function, class or module), nested ones included."""
    seen = set() if seen is None else seen
    if id(target) in seen:
        return
    seen.add(id(target))
    if isinstance(target, types.CodeType):
        yield target
        for const in target.co_consts:
            if isinstance(const, types.CodeType):
                yield from _code_objects(const, seen)
    elif isinstance(target, types.FunctionType):
        yield from _code_objects(target.__code__, seen)
    elif isinstance(target, (staticmethod, classmethod)):
        yield from _code_objects(target.__func__, seen)
    elif isinstance(target, property):
        for accessor in (target.fget, target.fset, target.fdel):
            if accessor is not None:
                yield from _code_objects(accessor, seen)
    elif isinstance(target, type):
        for member in vars(target).values():
            yield from _code_objects(member, seen)
    elif isinstance(target, types.ModuleType):
        for member in vars(target).values():
            if isinstance(member, (types.FunctionType, type)) and member.__module__ == target.__name__:
                yield from _code_objects(member, seen)


# ---------------------------------------------------------------------------- CUDA streams
class CudaStreams:
    """The calling thread's current CUDA stream on one device, asked cheaply, and made current.

    ``torch.cuda.current_stream(i)`` makes a new ``Stream`` per call (1.8 us of host time on an
    H100 machine, 3.2 us given a ``torch.device``); its C call, ``torch._C._cuda_getCurrentStream``,
    costs 0.13 us and returns the stream's ids, a tuple: here the tuple is the key of a ``Stream``
    made once. ``_cuda_getCurrentStream``, ``_cuda_setStream`` (the C calls behind
    ``torch.cuda.current_stream`` and ``torch.cuda.set_stream``) and ``_cuda_isCurrentStreamCapturing``:
    torch 2.4 to 2.14's CUDA builds. Where they are missing (a CPU build, as under the suite's
    NCCL stand-in) the public functions serve, the key being the ``Stream`` itself.

    Args:
        index: the CUDA device index.
    """

    #: At most this many streams are remembered (torch's pools hold 32 per priority; external
    #: streams are the rest).
    CACHE = 256

    def __init__(self, index: int):
        self.index = index
        get = getattr(torch._C, "_cuda_getCurrentStream", None)
        put = getattr(torch._C, "_cuda_setStream", None)
        capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None)
        #: Key to the ``Stream`` made for it (what :meth:`current` gives for a key it has seen).
        self.known: dict = {}
        self._public = get is None or put is None or capturing is None
        if self._public:
            #: ``ask(index)``: the key of the calling thread's current stream on the device (a C call).
            self.ask = torch.cuda.current_stream
            self.make_current = torch.cuda.set_stream
            #: True while the calling thread's current stream captures a CUDA graph (a C call).
            self.capturing = torch.cuda.is_current_stream_capturing
        else:
            self.ask, self._put = get, put
            self.capturing = capturing

    def current(self):
        """``(key, stream)``: the calling thread's current stream on the device; ``key`` for :meth:`make_current`.

        A caller on the host's path of every collective may inline it: ``key = ask(index)``, then
        ``known.get(key)``, then :meth:`stream_of` where that gives None."""
        key = self.ask(self.index)
        stream = self.known.get(key)
        return key, stream if stream is not None else self.stream_of(key)

    def stream_of(self, key):
        """The ``Stream`` of ``key`` (from :attr:`ask`), made once and then :attr:`known`."""
        if self._public:
            return key
        if len(self.known) >= self.CACHE:
            self.known.clear()
        stream = self.known[key] = torch.cuda.Stream(stream_id=key[0], device_index=key[1], device_type=key[2])
        return stream

    def make_current(self, key) -> None:
        """Make the stream of ``key`` (from :meth:`current` or :meth:`key_of`) the calling thread's current one."""
        self._put(*key)  # stream_id, device_index, device_type, positional: the C call takes them so

    def key_of(self, stream):
        """The key of ``stream`` for :meth:`make_current`."""
        return stream if self._public else (stream.stream_id, stream.device_index, stream.device_type)


def device_future(device: torch.device) -> torch.futures.Future:
    """A CUDA-aware future on ``device``: completing it records an event on the device's current
    stream, and a wait or a ``then`` callback makes the waiter's current stream wait on it
    (``torch.futures.Future(devices=...)``, torch 1.9 and later)."""
    return torch.futures.Future(devices=[device])


# ---------------------------------------------------------------------------- autograd
def queue_backward_callback(callback: Callable[[], None]) -> None:
    """Run ``callback()`` when the running backward pass ends, before ``backward()`` returns
    (``Variable._execution_engine.queue_callback``, 2.4 to 2.13)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


# ---------------------------------------------------------------------------- CUDA events, Works from futures
_CudaEventBase = getattr(torch._C, "_CudaEventBase", None)
#: ``event.record(stream)`` and ``event.wait(stream)`` (``cudaEventRecord``, ``cudaStreamWaitEvent``) as
#: the C methods of ``torch._C._CudaEventBase`` (2.4 to 2.14's CUDA builds): ``torch.cuda.Event``'s own
#: are Python wrappers around them (and ``Stream.wait_event`` one more), a microsecond of host time per
#: collective on the NCCL path. A CPU build has no such methods: the public ones serve (the NCCL
#: stand-in of the tests replaces these two).
record_event = getattr(_CudaEventBase, "record", None) or (lambda event, stream: event.record(stream))
wait_event = getattr(_CudaEventBase, "wait", None) or (lambda event, stream: event.wait(stream))

#: torch 2.7 and later wrap a Work that a Python group returns to C++ with the Python object that
#: made it (``PyProcessGroup::PyWorkHolder``): C++ (DDP's reducer) may keep and use it after Python
#: dropped it. torch 2.4 to 2.6 keep only its C++ half, whose overridden methods are lost once
#: Python frees the object.
PY_WORK_HOLDER = torch.__version__ >= (2, 7)


def work_from_future(future: torch.futures.Future):
    """A C++ ``Work`` that is ``future`` (``_create_work_from_future``, 2.4 to 2.14): its ``wait()``
    waits on the future (a CUDA-aware one makes the caller's current streams wait on its events),
    its ``get_future()`` is the future, and it needs no Python object to live."""
    return _C10D._create_work_from_future(future)
