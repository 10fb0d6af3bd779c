"""An accelerate training loop on smddp's world, for tests/integrations/test_integrations.py.

Two ways in:

- by default the script initializes nothing: accelerate's SageMaker switch
  (``ACCELERATE_USE_SAGEMAKER=true``, ``ACCELERATE_SAGEMAKER_DISTRIBUTED_TYPE=DATA_PARALLEL``,
  what ``accelerate launch`` puts in a SageMaker job, with SageMaker's own
  ``SM_FRAMEWORK_PARAMS``) makes ``Accelerator()`` import
  ``smdistributed.dataparallel.torch.torch_smddp`` and initialize the ``smddp`` group;
- ``--init-first``: the pattern for CPU without the switch. The script first shows that
  accelerate refuses ``InitProcessGroupKwargs(backend="smddp")`` with ``cpu=True``, then
  initializes the ``smddp`` group itself and creates ``Accelerator(cpu=True)``, which uses it.

Under ``torchrun`` with ``ACCELERATE_USE_CPU=true`` and no switch, the same script trains on
torch's gloo: the test's reference. Each rank prints ``ACCELERATE <rank> <json>`` with digests
of its parameters before and after (and writes the JSON into ``SM_OUTPUT_DATA_DIR`` when local
mode sets it).
"""

from __future__ import annotations

import gc
import json
import os
import sys

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from accelerate.utils import InitProcessGroupKwargs
from param_digest import digest

refused = None
if "--init-first" in sys.argv[1:]:
    try:
        Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(backend="smddp")])
    except ValueError as exc:
        refused = str(exc)
    AcceleratorState._reset_state(reset_partial_state=True)  # forget the refused attempt

    import smdistributed.dataparallel.torch.torch_smddp  # noqa: F401

    dist.init_process_group(backend="smddp")
    accelerator = Accelerator(cpu=True)
else:
    accelerator = Accelerator()


torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
initial = digest(model)
inputs = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
labels = (inputs.sum(1) > 0).long()
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(inputs, labels), batch_size=8)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
for x, y in loader:
    optimizer.zero_grad()
    accelerator.backward(torch.nn.functional.cross_entropy(model(x), y))
    optimizer.step()
rank = dist.get_rank()
report = {
    "world": dist.get_world_size(), "backend": dist.get_backend(), "initial": initial,
    "final": digest(accelerator.unwrap_model(model)), "wrapped": type(model).__name__,
    "device": str(accelerator.device), "refused": refused,
}
print(f"ACCELERATE {rank} {json.dumps(report)}", flush=True)
if os.environ.get("SM_OUTPUT_DATA_DIR"):
    with open(os.path.join(os.environ["SM_OUTPUT_DATA_DIR"], f"accelerate-{rank}.json"), "w") as f:
        json.dump(report, f)
accelerator.end_training()
# torch's gloo drops a finished collective's Work on its own worker thread, and a Work that
# outlives the interpreter aborts the process at exit ("terminate called without an active
# exception", pytorch/pytorch#179291); the wrapped model keeps the group alive past
# destroy_process_group, so free it now: the group's destructor joins its threads.
del model, optimizer, loader, accelerator
gc.collect()
