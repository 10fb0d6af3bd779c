"""``smddp.torch.parallel``: smddp's ``DistributedDataParallel``."""

from smddp.torch.parallel.distributed import DistributedDataParallel

__all__ = ["DistributedDataParallel"]
