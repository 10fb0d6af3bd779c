"""The implementations smddp-bench can measure: smddp's API, or torch.distributed on a group."""

from __future__ import annotations


class Impl:
    """One way to run the collectives: smddp's API, or torch.distributed on some group."""

    name = ""
    backend = ""
    api = ""

    @property
    def label(self) -> str:
        """``name(backend)`` as tables show it (just ``name`` when they are the same)."""
        return f"{self.name}({self.backend})" if self.backend and self.backend != self.name else self.name

    def all_reduce(self, tensor, redop: str) -> None:
        """Reduce ``tensor`` over all ranks in place with ``redop`` (``"sum"``, ``"avg"``, ``"min"``, ``"max"``)."""
        raise NotImplementedError

    def broadcast(self, tensor, root: int) -> None:
        """Copy rank ``root``'s ``tensor`` into every rank's."""
        raise NotImplementedError

    def all_gather(self, outputs, tensor) -> None:
        """Fill ``outputs[r]`` with rank ``r``'s ``tensor``."""
        raise NotImplementedError

    def all_to_all(self, output, tensor) -> None:
        """Send slice ``r`` of ``tensor`` to rank ``r``; ``output``'s slice ``r`` comes from rank ``r``."""
        raise NotImplementedError

    def barrier(self) -> None:
        """Return once every rank has called it."""
        raise NotImplementedError


class SmddpImpl(Impl):
    """``smddp.torch.distributed`` functions, as a SageMaker script calls them."""

    name = "smddp"
    api = "smddp"

    def __init__(self):
        import smddp.torch.distributed as dist

        self.dist = dist
        self.backend = dist.get_backend()
        self._ops = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVERAGE,
                     "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}

    def all_reduce(self, tensor, redop):
        self.dist.all_reduce(tensor, op=self._ops[redop])

    def broadcast(self, tensor, root):
        self.dist.broadcast(tensor, src=root)

    def all_gather(self, outputs, tensor):
        self.dist.all_gather(outputs, tensor)

    def all_to_all(self, output, tensor):
        self.dist.all_to_all_single(output, tensor)

    def barrier(self):
        self.dist.barrier()


class TorchImpl(Impl):
    """``torch.distributed`` functions on a group: the default (smddp's) or one made by ``new_group``.

    Args:
        group: the group, or None for torch's default group.
        name: the implementation's name in tables and plots.
        backend: the backend's name.
        emulate_avg: the backend has no AVG (gloo): sum, then divide on each rank.
    """

    api = "torch"

    def __init__(self, group, name: str, backend: str, emulate_avg: bool = False):
        import torch.distributed as tdist

        from smddp.comm.reduction import average as _average

        self._average = _average
        self.tdist, self.group, self.name, self.backend = tdist, group, name, backend
        self.emulate_avg = emulate_avg
        self.size = tdist.get_world_size(group)
        self._ops = {"sum": tdist.ReduceOp.SUM, "avg": tdist.ReduceOp.AVG,
                     "min": tdist.ReduceOp.MIN, "max": tdist.ReduceOp.MAX}

    def all_reduce(self, tensor, redop):
        if redop == "avg" and self.emulate_avg:
            self.tdist.all_reduce(tensor, op=self.tdist.ReduceOp.SUM, group=self.group)
            self._average(tensor, self.size)
            return
        self.tdist.all_reduce(tensor, op=self._ops[redop], group=self.group)

    def broadcast(self, tensor, root):
        self.tdist.broadcast(tensor, src=root, group=self.group)

    def all_gather(self, outputs, tensor):
        self.tdist.all_gather(outputs, tensor, group=self.group)

    def all_to_all(self, output, tensor):
        self.tdist.all_to_all_single(output, tensor, group=self.group)

    def barrier(self):
        self.tdist.barrier(group=self.group)

