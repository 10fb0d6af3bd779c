"""Hugging Face ``Trainer`` on smddp's world, for tests/integrations/test_integrations.py.

Two ways in, both written as SageMaker scripts are:

- by default the script initializes nothing: SageMaker's data-parallel switch
  (``"sagemaker_distributed_dataparallel_enabled": true`` in ``SM_FRAMEWORK_PARAMS``) makes
  ``TrainingArguments`` have accelerate import ``smdistributed.dataparallel.torch.torch_smddp``
  and initialize the ``smddp`` group, and ``Trainer`` wraps the model in DDP over it;
- ``--init-first``: the script initializes the ``smddp`` group itself (v2 style, through the
  ``smdistributed`` alias smddprun provides) and asks for the CPU (``use_cpu=True``).

Under ``torchrun`` with ``ACCELERATE_USE_CPU=true`` and no switch, the same script trains on
torch's gloo: the test's reference. It trains a 2-layer BERT built from a config on data made
here, and each rank prints ``HF_TRAINER <rank> <json>`` with digests of its parameters before
and after (and writes the JSON into ``SM_OUTPUT_DATA_DIR`` when local mode sets it).
"""

from __future__ import annotations

import gc
import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist
from param_digest import digest
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

init_first = "--init-first" in sys.argv[1:]
if init_first:
    import smdistributed.dataparallel.torch.torch_smddp  # noqa: F401

    dist.init_process_group(backend="smddp")


class Pairs(torch.utils.data.Dataset):
    """Seeded token sequences; the label is whether token 0 is in the upper half of the vocabulary."""

    def __len__(self) -> int:
        return 32

    def __getitem__(self, index: int) -> dict:
        ids = torch.randint(0, 64, (12,), generator=torch.Generator().manual_seed(index))
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": int(ids[0] >= 32)}


torch.manual_seed(0)
config = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                    intermediate_size=37, max_position_embeddings=16, num_labels=2)
model = BertForSequenceClassification(config)
initial = digest(model)
with tempfile.TemporaryDirectory() as out:
    args = TrainingArguments(
        output_dir=out, per_device_train_batch_size=4, max_steps=3, learning_rate=1e-2, use_cpu=init_first,
        report_to=[], save_strategy="no", logging_strategy="no", seed=0, dataloader_num_workers=0,
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=Pairs())
    trainer.train()
rank = dist.get_rank()
report = {
    "world": dist.get_world_size(), "backend": dist.get_backend(), "initial": initial, "final": digest(model),
    "wrapped": type(trainer.model_wrapped).__name__, "device": str(args.device),
}
print(f"HF_TRAINER {rank} {json.dumps(report)}", flush=True)
if os.environ.get("SM_OUTPUT_DATA_DIR"):
    with open(os.path.join(os.environ["SM_OUTPUT_DATA_DIR"], f"hf_trainer-{rank}.json"), "w") as f:
        json.dump(report, f)
dist.destroy_process_group()
# As accelerate_sagemaker.py: the wrapped model keeps torch's gloo group (the reference run's) alive
# past destroy_process_group, and its worker threads may abort the process at exit (pytorch#179291).
del trainer, model
gc.collect()
