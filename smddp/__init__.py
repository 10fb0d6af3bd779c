"""smddp: SageMaker's distributed data parallel library for PyTorch, open and runnable anywhere.

Import the PyTorch API as ``smddp.torch.distributed`` (the twin of
``smdistributed.dataparallel.torch.distributed``) and the DDP wrapper from
``smddp.torch.parallel``.
"""

from smddp.errors import (
    BackendUnavailableError,
    CollectiveError,
    CollectiveMismatchError,
    CollectiveTimeout,
    InvalidArgumentError,
    InvalidGroupError,
    InvalidTypeError,
    NotInitializedError,
    SMDDPError,
    UnsafePathError,
    WaitTimeout,
)

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "SMDDPError",
    "NotInitializedError",
    "InvalidGroupError",
    "InvalidArgumentError",
    "InvalidTypeError",
    "BackendUnavailableError",
    "UnsafePathError",
    "CollectiveError",
    "CollectiveMismatchError",
    "CollectiveTimeout",
    "WaitTimeout",
]
