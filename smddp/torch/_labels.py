"""The labels the torch layer gives collectives, and the advice that goes with each.

The engine knows nothing of DDP: it names a collective by the label its caller passes
(``all_reduce (during backward: DDP gradients)``) and adds the advice registered for that
label (:data:`ADVICE`, given to every group's engine) to a timeout or mismatch report.
"""

from __future__ import annotations

from typing import Optional

from smddp import _compat

#: An all-reduce started inside autograd's backward: DDP's reducer reducing a gradient bucket.
DDP_GRADIENTS = "during backward: DDP gradients"

#: What a stall or mismatch of :data:`DDP_GRADIENTS` usually means, and its fix.
UNEVEN_BATCHES = (
    "A collective started during backward is DDP's gradient all-reduce: if some ranks ran "
    "backward while others did not, the ranks probably have different numbers of batches (the "
    "end of an epoch with unequal data shards). Fix: give every rank the same number of batches "
    "(DistributedSampler(..., drop_last=True), or equal shards), or wrap the training loop in "
    "torch.distributed.algorithms.join.Join([model]) so that ranks which run out of data shadow "
    "the others' all-reduces."
)

#: Every group's engine gets this table (``Engine(advice=...)``).
ADVICE = {DDP_GRADIENTS: UNEVEN_BATCHES}


def all_reduce_label() -> Optional[str]:
    """The label of an all-reduce started here and now: :data:`DDP_GRADIENTS` inside backward."""
    return DDP_GRADIENTS if _compat.in_backward() else None
