"""accelerate's SageMaker switch under smddprun, for tests/test_integrations.py.

The test exports ``SM_FRAMEWORK_PARAMS`` as SageMaker's toolkit does for
``distribution={"smdistributed": {"dataparallel": {"enabled": True}}}``. transformers then
finds ``is_sagemaker_dp_enabled()``, and ``TrainingArguments`` hands ``_use_sagemaker_dp`` to
accelerate's ``PartialState``, which imports ``smdistributed.dataparallel.torch.torch_smddp``
and calls ``init_process_group(backend="smddp")``. On a machine without CUDA accelerate then
stops in its own GPU-only device setup; the script reports that error and shows the group
works. Each rank prints ``ACCELERATE <rank> <json>``.
"""

from __future__ import annotations

import json
import os
import tempfile
import traceback

import torch
import torch.distributed as dist
from transformers import TrainingArguments
from transformers.utils import is_sagemaker_dp_enabled

report = {"sagemaker_dp": is_sagemaker_dp_enabled()}
with tempfile.TemporaryDirectory() as out:
    try:
        report["device"] = str(TrainingArguments(output_dir=out, report_to=[]).device)
        report["error"] = report["where"] = None
    except Exception as exc:  # the CUDA-only step accelerate takes after init_process_group
        frame = traceback.extract_tb(exc.__traceback__)[-1]
        report["error"] = f"{type(exc).__name__}: {exc}"
        report["where"] = f"{frame.filename}:{frame.name}"
report["initialized"] = dist.is_initialized()
if dist.is_initialized():
    rank = dist.get_rank()
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    report.update(backend=dist.get_backend(), world=dist.get_world_size(), sum=t.item(),
                  env_rank=int(os.environ["RANK"]))
    dist.destroy_process_group()
print(f"ACCELERATE {os.environ.get('RANK')} {json.dumps(report)}", flush=True)
