"""A SageMaker training script for smddp: fits a small regression from a CSV channel.

Written the way SageMaker scripts are: hyperparameters arrive as ``--name value`` arguments,
the data in ``SM_CHANNEL_TRAINING`` (CSV files, last column the target), the model goes to
``SM_MODEL_DIR``. It runs unchanged on SageMaker (``smddp.sagemaker.PyTorch`` with an
``ml.*`` instance type), in local mode (``instance_type="local"``), or directly::

    smddprun -np 2 examples/sagemaker_train.py --epochs 5

Without a training channel it generates its data from a fixed seed. Rank 0 writes
``model.pt`` and ``metrics.json`` (the loss of every epoch, averaged over all ranks).
"""

from __future__ import annotations

import argparse
import glob
import json
import os

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import smddp.torch.distributed as dist
from smddp.torch.parallel.distributed import DistributedDataParallel as DDP


def load_data(channel):
    """Features and targets from every CSV file in ``channel``; synthetic data when there is none."""
    files = sorted(glob.glob(os.path.join(channel, "**", "*.csv"), recursive=True)) if channel else []
    if not files:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(512, 8, generator=gen)
        y = x @ torch.linspace(-1, 1, 8).unsqueeze(1) + 0.1 * torch.randn(512, 1, generator=gen)
        return x, y
    rows = []
    for name in files:
        with open(name) as f:
            rows += [[float(v) for v in line.split(",")] for line in f if line.strip() and line[0] not in "#x"]
    table = torch.tensor(rows)
    return table[:, :-1], table[:, -1:]


def main():
    parser = argparse.ArgumentParser(description="smddp regression example")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32, help="per-process batch size")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--model-dir", default=os.environ.get("SM_MODEL_DIR", "model"))
    parser.add_argument("--train", default=os.environ.get("SM_CHANNEL_TRAINING"))
    args = parser.parse_args()

    dist.init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)

    x, y = load_data(args.train)
    dataset = TensorDataset(x, y)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)
    model = DDP(nn.Linear(x.shape[1], 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    loss_fn = nn.MSELoss()

    losses = []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        total, batches = torch.zeros(1), 0
        for features, target in loader:
            optimizer.zero_grad()
            loss = loss_fn(model(features), target)
            loss.backward()
            optimizer.step()
            total += loss.detach()
            batches += 1
        epoch_loss = total / max(batches, 1)
        dist.all_reduce(epoch_loss, op=dist.ReduceOp.AVERAGE)
        losses.append(epoch_loss.item())
        if rank == 0:
            print(f"epoch {epoch + 1}/{args.epochs} loss {losses[-1]:.4f} ({world} processes)", flush=True)

    if rank == 0:
        os.makedirs(args.model_dir, exist_ok=True)
        torch.save(model.module.state_dict(), os.path.join(args.model_dir, "model.pt"))
        with open(os.path.join(args.model_dir, "metrics.json"), "w") as f:
            json.dump({"loss": losses, "world_size": world}, f)
    dist.barrier()


if __name__ == "__main__":
    main()
