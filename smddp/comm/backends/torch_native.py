"""torch's own device backends behind smddp's interface: ``torch-nccl``, ``xccl``, ``ccl``.

- ``torch-nccl``: torch's ``ProcessGroupNCCL`` on CUDA tensors. For comparison with smddp's
  ``nccl`` (CuPy), and the automatic choice on CUDA when CuPy is not installed.
- ``xccl``: Intel GPUs. torch's native ``ProcessGroupXCCL`` (torch >= 2.8 XPU builds) when
  ``torch.distributed.is_xccl_available()``, else Intel's ``oneccl_bindings_for_pytorch``.
- ``ccl``: Intel's ``oneccl_bindings_for_pytorch`` only; it moves XPU and CPU tensors.

Each is created from the job's store (under its own key prefix) and wrapped so its torch
``Work`` becomes a :class:`~smddp.comm.base.Pending`. NCCL and XCCL Work is stream-ordered:
``Work.wait()`` makes the caller's current stream wait for the collective without blocking
the host, so ``test()`` calls it and returns True. oneCCL's Work is polled with
``is_completed()``.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, ClassVar, Dict, Optional, Sequence

import torch
import torch.distributed as tdist

from smddp import _compat
from smddp.comm.backends.c10d_work import WorkPending
from smddp.comm.backends.devices import check_device, pick_device, with_cpu_companion
from smddp.comm.backends.nccl.bindings import CONVERTED, check_op
from smddp.comm.base import Communicator, Context, Op, Pending, average
from smddp.comm.needs import TORCH_CUDA_INSTALL, XPU_INSTALL
from smddp.errors import BackendUnavailableError

_REDUCE_OPS = {
    Op.SUM: tdist.ReduceOp.SUM,
    Op.AVERAGE: tdist.ReduceOp.AVG,
    Op.MIN: tdist.ReduceOp.MIN,
    Op.MAX: tdist.ReduceOp.MAX,
    Op.PRODUCT: tdist.ReduceOp.PRODUCT,
    Op.BAND: tdist.ReduceOp.BAND,
    Op.BOR: tdist.ReduceOp.BOR,
    Op.BXOR: tdist.ReduceOp.BXOR,
}

class TorchBackendCommunicator(Communicator):
    """Collectives through a torch c10d backend object (``allreduce``, ``broadcast``, ...).

    Subclasses create the backend in :meth:`_create`.

    Attributes:
        device: this rank's device.
        backend: the torch backend object.
    """

    device_type: ClassVar[str] = "cpu"
    #: The backend reduces AVERAGE itself (``ReduceOp.AVG``); otherwise SUM, then divide.
    native_average: ClassVar[bool] = False
    #: ``Work.wait()`` orders the current stream without blocking the host.
    stream_ordered: ClassVar[bool] = False

    def __init__(self, ctx: Context, backend: Any = None, device: Optional[torch.device] = None):
        """Create the backend for this rank's device.

        Args:
            ctx: the job's context.
            backend: an existing torch backend object to use (tests); default :meth:`_create`.
            device: its device (with ``backend``).

        Raises:
            BackendUnavailableError: the device or library is missing (says what to install).
        """
        super().__init__(ctx)
        #: torch makes a group's NCCL communicator at first use, eagerly only for a device_id.
        self.eager = ctx.device is not None
        if backend is None:
            self.device = self._pick_device(ctx)
            store = ctx.store
            if store is None:
                if self.size > 1:
                    raise BackendUnavailableError(f"the {self.name!r} backend needs the job's store (MASTER_ADDR)")
                store = tdist.HashStore()
            # The group's store is the group's own: one communicator of this name per group.
            prefixed = tdist.PrefixStore(f"smddp/{self.name}", store)
            backend = self._create(prefixed, ctx.timeout)
        else:
            self.device = device if device is not None else torch.device(self.device_type)
        self.backend = backend

    def _pick_device(self, ctx: Context) -> torch.device:
        return pick_device(ctx, self.device_type)

    def _create(self, store, timeout: timedelta):
        raise NotImplementedError

    def _check(self, *tensors: torch.Tensor) -> None:
        for tensor in tensors:
            if tensor.device.type == self.device_type:
                check_device(tensor, self.device, self.name)

    @staticmethod
    def _capturing() -> bool:
        """True while the calling thread captures a graph on the device (CUDA: see TorchNCCLCommunicator)."""
        return False

    def _pending(self, work) -> WorkPending:
        return WorkPending(work, self.stream_ordered, captured=self.stream_ordered and self._capturing())

    # ------------------------------------------------------------------ collectives
    def all_reduce(self, tensor: torch.Tensor, op: Op, tag: int) -> Pending:
        self._check(tensor)
        self.check_reduction(tensor.dtype, op)
        opts = _compat.AllreduceOptions()
        divide = op is Op.AVERAGE and not self.native_average
        opts.reduceOp = _REDUCE_OPS[Op.SUM if divide else op]
        work = self.backend.allreduce([tensor], opts)
        if not divide:
            return self._pending(work)
        if self.stream_ordered:
            # Order the division on the caller's stream now, not in whichever thread tests.
            work.wait()
            average(tensor, self.size)
            return WorkPending(None, True)
        return WorkPending(work, False, lambda: average(tensor, self.size))

    def broadcast(self, tensor: torch.Tensor, src: int, tag: int) -> Pending:
        self._check(tensor)
        opts = _compat.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        return self._pending(self.backend.broadcast([tensor], opts))

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, tag: int) -> Pending:
        self._check(output, input)
        gather_base = getattr(self.backend, "_allgather_base", None)
        if gather_base is not None:
            work = gather_base(output, input, _compat.AllgatherOptions())
        else:
            work = self.backend.allgather([list(output.chunk(self.size))], [input], _compat.AllgatherOptions())
        return self._pending(work)

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_counts: Sequence[int],
        input_counts: Sequence[int],
        tag: int,
    ) -> Pending:
        self._check(output, input)
        work = self.backend.alltoall_base(
            output, input, [int(c) for c in output_counts], [int(c) for c in input_counts], _compat.AllToAllOptions()
        )
        return self._pending(work)

    def barrier(self, tag: int) -> Pending:
        opts = _compat.BarrierOptions()
        if self.device.type != "cpu" and self.device.index is not None:
            opts.device_ids = [self.device.index]
        # A barrier means every rank arrived: poll it, whatever the backend's streams.
        return WorkPending(self.backend.barrier(opts), False)

    def close(self) -> None:
        """Shut the torch backend down (``shutdown()`` where torch has it)."""
        backend, self.backend = self.backend, None
        shutdown = getattr(backend, "shutdown", None) if backend is not None else None
        if shutdown is not None:
            try:
                shutdown()
            except Exception:  # noqa: BLE001 - best effort at teardown; nothing to report to
                pass


class TorchNCCLCommunicator(TorchBackendCommunicator):
    """torch's ``ProcessGroupNCCL`` on CUDA tensors (backend ``torch-nccl``)."""

    name = "torch-nccl"
    # torch's NCCL group sends bool as uint8, complex as its real view, and float8 as bytes.
    dtypes = Communicator.dtypes | CONVERTED
    device_types = ("cuda",)
    device_type = "cuda"
    native_average = True
    stream_ordered = True
    _capturing = staticmethod(torch.cuda.is_current_stream_capturing)

    @classmethod
    def build(cls, ctx: Context) -> Dict[str, Communicator]:
        """This communicator for CUDA tensors and a CPU communicator for CPU ones."""
        return with_cpu_companion("cuda", cls, ctx)

    def check_reduction(self, dtype: torch.dtype, op: Op, what: str = "all_reduce") -> None:
        """NCCL's refusals by name (the bitwise reductions), not torch's ValueError from the call."""
        check_op(op, what)
        super().check_reduction(dtype, op, what)

    def _pick_device(self, ctx: Context) -> torch.device:
        if not torch.cuda.is_available():
            raise BackendUnavailableError(
                f"the 'torch-nccl' backend needs a CUDA GPU and torch {torch.__version__} sees none; "
                f"install {TORCH_CUDA_INSTALL}"
            )
        if not tdist.is_nccl_available():
            raise BackendUnavailableError(f"this torch build has no NCCL; install {TORCH_CUDA_INSTALL}")
        device = pick_device(ctx, "cuda")
        torch.cuda.set_device(device)
        return device

    def _create(self, store, timeout: timedelta):
        backend = _compat.nccl_backend(store, self.rank, self.size, timeout)
        connect = getattr(backend, "eager_connect_single_device", None)
        if connect is not None and self.eager:
            # As torch's init_process_group(device_id=...): the NCCL communicator now, on this device.
            connect(self.device)
        return backend


class XCCLCommunicator(TorchBackendCommunicator):
    """Intel GPUs: torch's native XCCL, else oneCCL's bindings (backend ``xccl``)."""

    name = "xccl"
    device_types = ("xpu",)
    device_type = "xpu"

    @classmethod
    def build(cls, ctx: Context) -> Dict[str, Communicator]:
        """This communicator for XPU tensors and a CPU communicator for CPU ones."""
        return with_cpu_companion("xpu", cls, ctx)

    def _pick_device(self, ctx: Context) -> torch.device:
        xpu = getattr(torch, "xpu", None)
        if xpu is None or not xpu.is_available():
            raise BackendUnavailableError(
                f"the {self.name!r} backend needs an Intel GPU and torch {torch.__version__} sees none; "
                f"install {XPU_INSTALL}"
            )
        device = pick_device(ctx, "xpu")
        xpu.set_device(device)
        return device

    def _create(self, store, timeout: timedelta):
        if not xccl_available():
            self.stream_ordered = False  # oneCCL's bindings: poll their Work
            return ccl_backend(store, self.rank, self.size, timeout)
        self.stream_ordered = True
        return _compat.xccl_backend(store, self.rank, self.size, timeout)


class CCLCommunicator(XCCLCommunicator):
    """Intel's ``oneccl_bindings_for_pytorch`` on XPU and CPU tensors (backend ``ccl``)."""

    name = "ccl"
    device_types = ("xpu", "cpu")

    @classmethod
    def build(cls, ctx: Context) -> Dict[str, Communicator]:
        """One communicator for both XPU and CPU tensors."""
        comm = cls(ctx)
        return {"xpu": comm, "cpu": comm}

    def _pick_device(self, ctx: Context) -> torch.device:
        xpu = getattr(torch, "xpu", None)
        if xpu is None or not xpu.is_available():
            return torch.device("cpu")  # oneCCL moves CPU tensors too
        return super()._pick_device(ctx)

    def _create(self, store, timeout: timedelta):
        self.stream_ordered = False
        return ccl_backend(store, self.rank, self.size, timeout)


def xccl_available() -> bool:
    """True when this torch has its native XCCL backend (XPU builds of torch >= 2.8)."""
    available = getattr(tdist, "is_xccl_available", None)
    return bool(available and available())


def ccl_backend(store, rank: int, size: int, timeout: timedelta):
    """A oneCCL backend object from Intel's ``oneccl_bindings_for_pytorch``.

    Importing the bindings registers torch backend ``"ccl"``; its creator is called here.

    Raises:
        BackendUnavailableError: the bindings are not installed (says what to install).
    """
    try:
        import oneccl_bindings_for_pytorch  # noqa: F401 - registers torch backend "ccl"
    except ImportError as exc:
        raise BackendUnavailableError(
            f"no oneCCL for this Intel GPU job ({exc}); install {XPU_INSTALL}"
        ) from exc
    backend = _compat.plugin_backend("CCL", store, rank, size, timeout)
    if backend is None:
        raise BackendUnavailableError(
            "oneccl_bindings_for_pytorch did not register the 'ccl' backend with this torch; "
            f"install the bindings built for torch {torch.__version__}"
        )
    return backend
