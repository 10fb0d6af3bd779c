"""Hugging Face ``Trainer`` on smddp's world, for tests/test_integrations.py.

The script initializes the ``smddp`` process group the SageMaker v2 way (through the
``smdistributed`` alias smddprun provides), then trains a 2-layer BERT built from a config on
data made here. accelerate finds the group initialized and wraps the model in DDP over it.
Each rank prints ``HF_TRAINER <rank> <json>`` with digests of its parameters before and after.
"""

from __future__ import annotations

import hashlib
import json
import tempfile

import smdistributed.dataparallel.torch.torch_smddp  # noqa: F401
import torch
import torch.distributed as dist
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

dist.init_process_group(backend="smddp")
rank, world = dist.get_rank(), dist.get_world_size()


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


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
        output_dir=out, per_device_train_batch_size=4, max_steps=3, learning_rate=1e-2, use_cpu=True,
        report_to=[], save_strategy="no", logging_strategy="no", seed=0, dataloader_num_workers=0,
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=Pairs())
    trainer.train()
report = {
    "world": world, "backend": dist.get_backend(), "initial": initial, "final": digest(model),
    "wrapped": type(trainer.model_wrapped).__name__, "distributed_type": str(trainer.accelerator.distributed_type),
}
print(f"HF_TRAINER {rank} {json.dumps(report)}", flush=True)
dist.destroy_process_group()
