"""The SageMaker data parallel training script, with its smdistributed imports unchanged.

This is the script of SageMaker's "Modify a PyTorch training script to use SageMaker data
parallel" guide (v1 API): a small CNN on MNIST-shaped images. The imports still say
``smdistributed.dataparallel``; run it with ``smddprun``, which maps them to smddp::

    smddprun -np 2 examples/train_smdistributed.py --epochs 2

The data is synthetic (generated from a fixed seed, the same on every rank), so it runs
offline on a CPU in seconds. Each rank ends by printing ``WEIGHTS <rank> <sha256>`` of its
model's parameters: they are identical on every rank when gradients were averaged.
"""

from __future__ import annotations

import argparse
import hashlib
import os

# Import distributed data parallel library PyTorch API
import smdistributed.dataparallel.torch.distributed as dist
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim

# Import distributed data parallel library PyTorch DDP
from smdistributed.dataparallel.torch.parallel.distributed import DistributedDataParallel as DDP
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

# Initialize distributed data parallel library
dist.init_process_group()


class Net(nn.Module):
    """The guide's MNIST network, narrower so that a CPU trains it in seconds."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3, 1)
        self.conv2 = nn.Conv2d(4, 8, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(8 * 12 * 12, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = torch.flatten(self.dropout1(x), 1)
        x = self.dropout2(F.relu(self.fc1(x)))
        return F.log_softmax(self.fc2(x), dim=1)


def synthetic_mnist(samples, seed=1234):
    """MNIST-shaped images: one fixed random pattern per digit class, plus noise. Offline, learnable."""
    gen = torch.Generator().manual_seed(seed)
    patterns = torch.randn(10, 1, 28, 28, generator=gen)
    labels = torch.randint(0, 10, (samples,), generator=gen)
    images = patterns[labels] + 1.5 * torch.randn(samples, 1, 28, 28, generator=gen)
    return TensorDataset(images, labels)


def weights_sha256(model):
    """SHA-256 of every parameter and buffer, in state-dict order."""
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        digest.update(name.encode())
        digest.update(bytes(tensor.detach().cpu().clone().untyped_storage()))
    return digest.hexdigest()


def train(args, model, device, train_loader, optimizer, epoch):
    model.train()
    for batch_idx, (data, target) in enumerate(train_loader):
        data, target = data.to(device), target.to(device)
        optimizer.zero_grad()
        loss = F.nll_loss(model(data), target)
        loss.backward()
        optimizer.step()
        if batch_idx % args.log_interval == 0 and dist.get_rank() == 0:
            seen = batch_idx * len(data) * dist.get_world_size()
            print(f"Train Epoch: {epoch} [{seen}/{len(train_loader.dataset)}]\tLoss: {loss.item():.6f}", flush=True)


def test(model, device, test_loader):
    # Rank 0 alone evaluates, so use the wrapped module: DDP's forward may communicate.
    model.eval()
    loss, correct = 0.0, 0
    with torch.no_grad():
        for data, target in test_loader:
            data, target = data.to(device), target.to(device)
            output = model(data)
            loss += F.nll_loss(output, target, reduction="sum").item()
            correct += (output.argmax(dim=1) == target).sum().item()
    total = len(test_loader.dataset)
    print(f"Test set: Average loss: {loss / total:.4f}, Accuracy: {correct}/{total} "
          f"({100.0 * correct / total:.0f}%)", flush=True)


def main():
    parser = argparse.ArgumentParser(description="smdistributed data parallel example (synthetic MNIST)")
    parser.add_argument("--batch-size", type=int, default=64, help="global batch size (default 64)")
    parser.add_argument("--test-batch-size", type=int, default=256)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1.0)
    parser.add_argument("--gamma", type=float, default=0.7, help="learning rate step gamma")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--samples", type=int, default=1024, help="synthetic training images")
    parser.add_argument("--log-interval", type=int, default=10)
    parser.add_argument("--model-dir", default=os.environ.get("SM_MODEL_DIR", "model"))
    args = parser.parse_args()

    world_size, rank, local_rank = dist.get_world_size(), dist.get_rank(), dist.get_local_rank()
    # Scale batch size by world size. (The guide divides by world_size // 8, which is zero
    # below 8 processes; the global batch is split evenly here.)
    batch_size = max(args.batch_size // world_size, 1)
    torch.manual_seed(args.seed)

    # Pin each GPU to a single distributed data parallel library process.
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")

    dataset = synthetic_mnist(args.samples + 256)
    train_dataset = torch.utils.data.Subset(dataset, range(args.samples))
    test_dataset = torch.utils.data.Subset(dataset, range(args.samples, len(dataset)))
    # Set num_replicas and rank in DistributedSampler
    train_sampler = DistributedSampler(train_dataset, num_replicas=world_size, rank=rank)
    train_loader = DataLoader(train_dataset, batch_size=batch_size, shuffle=False, sampler=train_sampler)
    test_loader = DataLoader(test_dataset, batch_size=args.test_batch_size)

    # Wrap the PyTorch model with distributed data parallel library's DDP
    model = DDP(Net().to(device))

    optimizer = optim.Adadelta(model.parameters(), lr=args.lr)
    scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)
    for epoch in range(1, args.epochs + 1):
        train_sampler.set_epoch(epoch)
        train(args, model, device, train_loader, optimizer, epoch)
        if rank == 0:
            test(model.module, device, test_loader)
        scheduler.step()

    # Save model on master node.
    if rank == 0:
        os.makedirs(args.model_dir, exist_ok=True)
        path = os.path.join(args.model_dir, "model.pt")
        torch.save(model.module.state_dict(), path)
        print(f"Saved {path}", flush=True)
    print(f"WEIGHTS {rank} {weights_sha256(model.module)}", flush=True)


if __name__ == "__main__":
    main()
