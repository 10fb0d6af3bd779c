"""Data parallel training with smddp, written like a SageMaker data parallel script.

A SageMaker script for ``smdistributed.dataparallel`` with two imports swapped: a small CNN
learns MNIST-shaped images, each process training on its shard of every epoch. Run it on
two CPU processes, on GPUs (one process per GPU), or as a plain single process::

    mpirun -np 2 python examples/train.py --epochs 3
    smddprun -np 2 examples/train.py
    torchrun --nproc-per-node 2 examples/train.py
    python examples/train.py

The data is synthetic (one seeded random pattern per class plus noise), so it runs offline in
seconds. ``--data-dir`` (or SageMaker's ``SM_CHANNEL_TRAINING``) may instead hold ``train.pt``
(and optionally ``test.pt``): a ``{"images": N x 1 x 28 x 28 float, "labels": N int}`` dict
saved with ``torch.save``. Rank 0 prints the loss of every epoch and saves the model to
``--model-dir``; every rank ends with ``WEIGHTS <rank> <sha256 of its parameters>``, the same
on every rank because gradients were averaged, and rank 0 gathers every rank's digest and says
whether they agree (the run fails when they do not).
"""

from __future__ import annotations

import argparse
import hashlib
import os
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

# Import smddp's PyTorch API (was: smdistributed.dataparallel.torch.distributed)
import smddp.torch.distributed as dist

# Import smddp's DDP (was: smdistributed.dataparallel.torch.parallel.distributed)
from smddp.torch.parallel.distributed import DistributedDataParallel as DDP

# Initialize smddp
dist.init_process_group()


class Net(nn.Module):
    """A small MNIST network: two convolutions, max pooling, two fully connected layers."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3, 1)
        self.conv2 = nn.Conv2d(4, 8, 3, 1)
        self.dropout = nn.Dropout(0.25)
        self.fc1 = nn.Linear(8 * 12 * 12, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = self.dropout(torch.flatten(x, 1))
        x = F.relu(self.fc1(x))
        return F.log_softmax(self.fc2(x), dim=1)


def synthetic_mnist(samples: int, seed: int) -> TensorDataset:
    """MNIST-shaped images of 10 classes: a fixed random pattern per class plus noise."""
    patterns = torch.randn(10, 1, 28, 28, generator=torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (samples,), generator=gen)
    images = patterns[labels] + 2.0 * torch.randn(samples, 1, 28, 28, generator=gen)
    return TensorDataset(images, labels)


def load_channel(data_dir: Optional[str], name: str) -> Optional[TensorDataset]:
    """``<data_dir>/<name>.pt`` as a dataset, or None when there is none."""
    if not data_dir or not os.path.isfile(os.path.join(data_dir, name)):
        return None
    data = torch.load(os.path.join(data_dir, name), map_location="cpu", weights_only=True)
    images, labels = (data["images"], data["labels"]) if isinstance(data, dict) else data
    return TensorDataset(images.float(), labels.long())


def parameters_sha256(model: nn.Module) -> str:
    """SHA-256 of the concatenated bytes of the model's parameters."""
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(bytes(p.detach().to("cpu", copy=True).contiguous().untyped_storage()))
    return digest.hexdigest()


def same_weights_everywhere(digest: str, device) -> bool:
    """Whether every rank's parameter digest equals rank 0's (an all_gather of the 32 bytes)."""
    mine = torch.tensor(list(bytes.fromhex(digest)), dtype=torch.int32, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return all(torch.equal(other, every[0]) for other in every)


def train(model, device, train_loader, optimizer) -> float:
    """One epoch; returns the mean training loss over every process's batches."""
    model.train()
    total = torch.zeros(2, dtype=torch.float64, device=device)  # sum of losses, batches
    for data, target in train_loader:
        data, target = data.to(device), target.to(device)
        optimizer.zero_grad()
        loss = F.nll_loss(model(data), target)
        loss.backward()
        optimizer.step()
        total += torch.stack([loss.detach().double(), torch.ones((), dtype=torch.float64, device=device)])
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return (total[0] / total[1]).item()


def test(model, device, test_loader) -> float:
    """Accuracy on the test set (rank 0 only: uses the plain module, no communication)."""
    model.eval()
    correct = 0
    with torch.no_grad():
        for data, target in test_loader:
            output = model(data.to(device))
            correct += (output.argmax(dim=1) == target.to(device)).sum().item()
    return correct / len(test_loader.dataset)


def main():
    parser = argparse.ArgumentParser(description="smddp data parallel training (MNIST-shaped data)")
    parser.add_argument("--epochs", type=int, default=3, help="number of epochs (default 3)")
    parser.add_argument("--batch-size", type=int, default=64,
                        help="global batch size, split over the processes (default 64)")
    parser.add_argument("--lr", type=float, default=1.0, help="Adadelta learning rate (default 1.0)")
    parser.add_argument("--gamma", type=float, default=0.7, help="learning rate decay per epoch (default 0.7)")
    parser.add_argument("--samples", type=int, default=2048, help="synthetic training images (default 2048)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--model-dir", default=os.environ.get("SM_MODEL_DIR", "model"),
                        help="where rank 0 saves model.pt (default $SM_MODEL_DIR or ./model)")
    parser.add_argument("--data-dir", default=os.environ.get("SM_CHANNEL_TRAINING"),
                        help="a directory with train.pt (and test.pt); default synthetic data")
    args = parser.parse_args()

    rank, world_size = dist.get_rank(), dist.get_world_size()
    # Scale batch size by world size: each process takes its share of the global batch.
    batch_size = max(args.batch_size // world_size, 1)
    torch.manual_seed(args.seed)

    # Pin each GPU to a single smddp process.
    if torch.cuda.is_available():
        torch.cuda.set_device(dist.get_local_rank())
        device = torch.device("cuda", dist.get_local_rank())
    else:
        device = torch.device("cpu")

    train_dataset = load_channel(args.data_dir, "train.pt") or synthetic_mnist(args.samples, seed=1)
    test_dataset = load_channel(args.data_dir, "test.pt")
    if test_dataset is None and not args.data_dir:
        test_dataset = synthetic_mnist(512, seed=2)
    # Set num_replicas and rank in DistributedSampler
    train_sampler = DistributedSampler(train_dataset, num_replicas=world_size, rank=rank)
    train_loader = DataLoader(train_dataset, batch_size=batch_size, sampler=train_sampler)

    # Wrap the PyTorch model with smddp's DDP
    model = DDP(Net().to(device))
    optimizer = optim.Adadelta(model.parameters(), lr=args.lr)
    scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)
    if rank == 0:
        print(f"Training on {world_size} process(es), backend {dist.get_backend()}, device {device}, "
              f"{len(train_dataset)} images, batch {batch_size} per process", flush=True)

    for epoch in range(1, args.epochs + 1):
        train_sampler.set_epoch(epoch)
        loss = train(model, device, train_loader, optimizer)
        if rank == 0:
            line = f"EPOCH {epoch} loss {loss:.6f}"
            if test_dataset is not None:
                line += f" test_accuracy {test(model.module, device, DataLoader(test_dataset, 256)):.4f}"
            print(line, flush=True)
        scheduler.step()

    # Save the model on the leader node only.
    if rank == 0:
        os.makedirs(args.model_dir, exist_ok=True)
        path = os.path.join(args.model_dir, "model.pt")
        torch.save(model.module.state_dict(), path)
        print(f"Saved {path}", flush=True)
    digest = parameters_sha256(model.module)
    print(f"WEIGHTS {rank} {digest}", flush=True)
    same = same_weights_everywhere(digest, device)
    if rank == 0:
        print(f"Every rank holds the same weights ({world_size} of {world_size})" if same else
              "The ranks' weights differ: gradients were not averaged alike", flush=True)
    dist.destroy_process_group()
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
