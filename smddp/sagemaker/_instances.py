"""GPUs per SageMaker instance type: the default number of processes on each host."""

from __future__ import annotations

import re
from typing import Optional

#: Local mode instance types: this machine's CPU, or its CUDA GPUs.
LOCAL_TYPES = ("local", "local_gpu")

_GPUS = {
    "ml.p3.2xlarge": 1, "ml.p3.8xlarge": 4, "ml.p3.16xlarge": 8, "ml.p3dn.24xlarge": 8,
    "ml.p4d.24xlarge": 8, "ml.p4de.24xlarge": 8,
    "ml.p5.48xlarge": 8, "ml.p5e.48xlarge": 8, "ml.p5en.48xlarge": 8,
    "ml.g4dn.xlarge": 1, "ml.g4dn.2xlarge": 1, "ml.g4dn.4xlarge": 1, "ml.g4dn.8xlarge": 1,
    "ml.g4dn.16xlarge": 1, "ml.g4dn.12xlarge": 4,
    "ml.g5.xlarge": 1, "ml.g5.2xlarge": 1, "ml.g5.4xlarge": 1, "ml.g5.8xlarge": 1,
    "ml.g5.16xlarge": 1, "ml.g5.12xlarge": 4, "ml.g5.24xlarge": 4, "ml.g5.48xlarge": 8,
    "ml.g6.xlarge": 1, "ml.g6.2xlarge": 1, "ml.g6.4xlarge": 1, "ml.g6.8xlarge": 1,
    "ml.g6.16xlarge": 1, "ml.g6.12xlarge": 4, "ml.g6.24xlarge": 4, "ml.g6.48xlarge": 8,
    "ml.g6e.xlarge": 1, "ml.g6e.2xlarge": 1, "ml.g6e.4xlarge": 1, "ml.g6e.8xlarge": 1,
    "ml.g6e.16xlarge": 1, "ml.g6e.12xlarge": 4, "ml.g6e.24xlarge": 4, "ml.g6e.48xlarge": 8,
}

# Families without accelerators: one process per host unless told otherwise.
_CPU_FAMILY = re.compile(r"ml\.(c|m|r|t|x|z)\d")
_GPU_FAMILY = re.compile(r"ml\.(p|g)\d")


def is_local(instance_type: str) -> bool:
    """True for ``"local"`` and ``"local_gpu"``."""
    return instance_type in LOCAL_TYPES


def is_gpu(instance_type: str) -> bool:
    """True when ``instance_type`` has NVIDIA GPUs (ml.p*, ml.g*, ``local_gpu``)."""
    return instance_type == "local_gpu" or bool(_GPU_FAMILY.match(instance_type))


def gpus(instance_type: str) -> Optional[int]:
    """GPUs of a SageMaker instance type: 0 for CPU families, None when not in the table."""
    if instance_type in _GPUS:
        return _GPUS[instance_type]
    if _CPU_FAMILY.match(instance_type):
        return 0
    return None


def default_processes_per_host(instance_type: str) -> Optional[int]:
    """Processes per host when the distribution does not say: one per GPU, one on CPU.

    Returns None for an accelerated type missing from the table; the job then starts one
    process per GPU that the container reports (``SM_NUM_GPUS``), as SageMaker's drivers do.
    """
    count = gpus(instance_type)
    if count is None:
        return None
    return max(count, 1)
