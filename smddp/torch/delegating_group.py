"""smddp's process group on a GPU: its device tensors go straight to torch's own backend object.

On CUDA (``torch-nccl``, the default) and Intel GPUs (``xccl``, ``ccl``) the group hands every
collective on device tensors to torch's ``ProcessGroupNCCL`` (``ProcessGroupXCCL``, oneCCL's) with
torch's options as given, ``asyncOp`` included, and returns torch's ``Work`` as it is: its own
CUDA-aware future, ``wait()`` ordering the caller's stream, tensors unstashed at ``wait()``. No
engine, Handle, Pending or thread of smddp's is on that route: what torch's group does is what
happens, as torch's own CI checks it on many GPUs (this project sees one GPU at a time).

The same object serves torch's functional collectives (it is registered as the group's backend
for its device: :mod:`smddp.torch._functional_backends`) and torch's coalescing manager
(``_start_coalescing``/``_end_coalescing`` reach it through torch's C++), so a group has one
device communicator. CPU tensors (metrics, counters) keep the group's CPU plane through
:class:`~smddp.torch.process_group.SmddpProcessGroup`'s methods. ``torch-gloo`` hands CPU tensors to
torch's gloo the same way: the suite runs this route on every CI run without a GPU.

torch's ``batch_isend_irecv`` groups sends and receives into one launch only on a plain
``ProcessGroup`` (``type(group) is ProcessGroup``); on a Python group, smddp's or any other, it
issues them one by one. Exchanges that NCCL would need grouped (two ranks sending to each other
first) belong in ``torch.distributed.distributed_c10d._coalescing_manager(group, device,
async_ops=True)``, which reaches this group's NCCL backend (docs/backends.md).
"""

from __future__ import annotations

import operator

import torch.distributed as tdist

from smddp import _compat
from smddp.comm.engine import Engine
from smddp.comm.engine import events as _events
from smddp.torch import _c10d_events
from smddp.torch.process_group import SmddpProcessGroup

__all__ = ["DelegatingProcessGroup"]

_Base = SmddpProcessGroup
_profiling = _events.active  # one C call: is torch's profiler recording in this thread


@_compat.opaque_to_dynamo
class DelegatingProcessGroup(SmddpProcessGroup):
    """An smddp process group whose ``delegate.device_type`` tensors go to ``delegate.backend``.

    Args:
        engine: the group's engine (its CPU communicator serves CPU tensors).
        rank: this process's rank in the group.
        size: the group's size.
        delegate: the group's :class:`~smddp.comm.backends.torch_native.Delegate`.
        on_shutdown: called by ``shutdown()`` (see :class:`SmddpProcessGroup`).
    """

    def __init__(self, engine: Engine, rank: int, size: int, delegate, on_shutdown=None):
        super().__init__(engine, rank, size, on_shutdown)
        self.delegate = delegate
        self.backend_name = delegate.name
        #: True for a tensor torch's backend takes (one C property read: ``tensor.is_cuda``, ...).
        self.delegated = operator.attrgetter(f"is_{delegate.device_type}")
        self._backend = delegate.backend
        self._plain = None  # a C++ ProcessGroup over the backend, made at its first use (see _coalesced)

    # The most frequent calls first, each: the first tensor's device, then torch's backend or smddp's plane.
    def allreduce(self, tensors, opts=None):
        if self.delegated(tensors[0]):
            _event = _c10d_events.begin("allreduce_", locals()) if _profiling() else None
            return self._backend.allreduce(tensors, opts) if opts is not None else self._backend.allreduce(tensors)
        return _Base.allreduce(self, tensors, opts)

    def broadcast(self, tensors, opts=None):
        if self.delegated(tensors[0]):
            _event = _c10d_events.begin("broadcast_", locals()) if _profiling() else None
            return self._backend.broadcast(tensors, *_given(opts))
        return _Base.broadcast(self, tensors, opts)

    def _allgather_base(self, output, input, opts=None):
        if self.delegated(input):
            _event = _c10d_events.begin("_allgather_base_", locals()) if _profiling() else None
            return self._backend._allgather_base(output, input, *_given(opts))
        return _Base._allgather_base(self, output, input, opts)

    all_gather_single = _allgather_base

    def _reduce_scatter_base(self, output, input, opts=None):
        if self.delegated(input):
            _event = _c10d_events.begin("_reduce_scatter_base_", locals()) if _profiling() else None
            return self._backend._reduce_scatter_base(output, input, *_given(opts))
        return _Base._reduce_scatter_base(self, output, input, opts)

    reduce_scatter_single = _reduce_scatter_base

    def allgather(self, output_tensors, input_tensors, opts=None):
        if self.delegated(input_tensors[0]):
            _event = _c10d_events.begin("allgather_", locals()) if _profiling() else None
            return self._backend.allgather(output_tensors, input_tensors, *_given(opts))
        return _Base.allgather(self, output_tensors, input_tensors, opts)

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        if self.delegated(output_tensors[0]):
            _event = _c10d_events.begin("reduce_scatter_", locals()) if _profiling() else None
            return self._backend.reduce_scatter(output_tensors, input_tensors, *_given(opts))
        return _Base.reduce_scatter(self, output_tensors, input_tensors, opts)

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        if self.delegated(input):
            _event = _c10d_events.begin("alltoall_base_", locals()) if _profiling() else None
            return self._backend.alltoall_base(output, input, output_split_sizes, input_split_sizes, *_given(opts))
        return _Base.alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts)

    all_to_all_single = alltoall_base

    def alltoall(self, output_tensors, input_tensors, opts=None):
        if self.delegated(input_tensors[0]):
            _event = _c10d_events.begin("alltoall_", locals()) if _profiling() else None
            return self._backend.alltoall(output_tensors, input_tensors, *_given(opts))
        return _Base.alltoall(self, output_tensors, input_tensors, opts)

    def barrier(self, opts=None):
        """torch's barrier on the group's device, as on torch's own group of that backend."""
        _event = _c10d_events.begin("barrier", locals()) if _profiling() else None
        return self._backend.barrier(*_given(opts))

    def reduce(self, tensors, opts=None):
        if self.delegated(tensors[0]):
            _event = _c10d_events.begin("reduce_", locals()) if _profiling() else None
            return self._backend.reduce(tensors, *_given(opts))
        return _Base.reduce(self, tensors, opts)

    def gather(self, output_tensors, input_tensors, opts=None):
        if self.delegated(input_tensors[0]):
            _event = _c10d_events.begin("gather_", locals()) if _profiling() else None
            return self._backend.gather(output_tensors, input_tensors, *_given(opts))
        return _Base.gather(self, output_tensors, input_tensors, opts)

    def scatter(self, output_tensors, input_tensors, opts=None):
        if self.delegated(output_tensors[0]):
            _event = _c10d_events.begin("scatter_", locals()) if _profiling() else None
            return self._backend.scatter(output_tensors, input_tensors, *_given(opts))
        return _Base.scatter(self, output_tensors, input_tensors, opts)

    def allreduce_coalesced(self, tensors, opts=None):
        if tensors and self.delegated(tensors[0]):
            _event = _c10d_events.begin("allreduce_coalesced_", locals()) if _profiling() else None
            return self._backend.allreduce_coalesced(tensors, *_given(opts))
        return _Base.allreduce_coalesced(self, tensors, opts)

    def allgather_coalesced(self, output_lists, input_tensors, opts=None):
        if input_tensors and self.delegated(input_tensors[0]):
            _event = _c10d_events.begin("allgather_coalesced_", locals()) if _profiling() else None
            return self._backend.allgather_coalesced(output_lists, input_tensors, *_given(opts))
        return _Base.allgather_coalesced(self, output_lists, input_tensors, opts)

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        if inputs and self.delegated(inputs[0]):
            _event = _c10d_events.begin("allgather_into_tensor_coalesced_", locals()) if _profiling() else None
            return self._coalesced().allgather_into_tensor_coalesced(outputs, inputs, *_given(opts))
        return _Base.allgather_into_tensor_coalesced(self, outputs, inputs, opts)

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        if inputs and self.delegated(inputs[0]):
            _event = _c10d_events.begin("reduce_scatter_tensor_coalesced_", locals()) if _profiling() else None
            return self._coalesced().reduce_scatter_tensor_coalesced(outputs, inputs, *_given(opts))
        return _Base.reduce_scatter_tensor_coalesced(self, outputs, inputs, opts)

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    def send(self, tensors, dstRank, tag=0):  # noqa: N803 - torch's name
        if self.delegated(tensors[0]):
            _event = _c10d_events.begin("send", locals()) if _profiling() else None
            return self._backend.send(tensors, dstRank, tag)
        return _Base.send(self, tensors, dstRank, tag)

    def recv(self, tensors, srcRank, tag=0):  # noqa: N803 - torch's name
        if self.delegated(tensors[0]):
            _event = _c10d_events.begin("recv_", locals()) if _profiling() else None
            return self._backend.recv(tensors, srcRank, tag)
        return _Base.recv(self, tensors, srcRank, tag)

    def recv_anysource(self, tensors, tag=0):
        if self.delegated(tensors[0]):
            _event = _c10d_events.begin("recv_any_source_", locals()) if _profiling() else None
            return self._backend.recv_anysource(tensors, tag)
        return _Base.recv_anysource(self, tensors, tag)

    def _coalesced(self):
        """A plain C++ ProcessGroup over the backend: the coalesced tensor forms, which a ``Backend``'s
        Python binding lacks, through torch's dispatcher as torch's own group calls them."""
        if self._plain is None:
            self._plain = _compat.plain_group(tdist.HashStore(), self.rank(), self.size(),
                                              self.delegate.device_type, self.delegate.kind, self._backend)
        return self._plain


def _given(opts) -> tuple:
    """torch's options as the caller gave them: ``(opts,)``, or nothing for the binding's default."""
    return () if opts is None else (opts,)
