"""Fully Sharded Data Parallel (FSDP) on smddp: a small CNN sharded with ``fully_shard``.

The shape of PyTorch's FSDP tutorial as Intel's oneCCL guide adapts it (a CNN on MNIST,
``DistributedSampler``, train and test loops that all-reduce loss sums, a checkpoint saved
after a barrier), with smddp's process group in place of ``ccl``. FSDP2's ``fully_shard``
shards each layer's parameters, gradients and optimizer state across the ranks; it runs on
CPUs and GPUs alike::

    mpirun -np 2 python examples/fsdp_train.py
    smddprun -np 2 examples/fsdp_train.py --epochs 3 --save-model
    torchrun --nproc-per-node 2 examples/fsdp_train.py
    python examples/fsdp_train.py          # a world of one

The data is synthetic (generated from a fixed seed, the same on every rank), so it runs
offline, in seconds on a CPU. On a machine with CUDA each rank uses the GPU of its local rank.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader, Subset, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import smddp.torch.distributed as smddp_dist


class Net(nn.Module):
    """The tutorial's MNIST network, narrower so that a CPU trains it in seconds."""

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
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = self.dropout2(x)
        return F.log_softmax(self.fc2(x), dim=1)


def synthetic_mnist(samples: int, seed: int) -> TensorDataset:
    """MNIST-shaped images: one fixed random pattern per digit class, plus noise. Offline, learnable."""
    gen = torch.Generator().manual_seed(seed)
    patterns = torch.randn(10, 1, 28, 28, generator=gen)
    labels = torch.randint(0, 10, (samples,), generator=gen)
    images = patterns[labels] + 1.5 * torch.randn(samples, 1, 28, 28, generator=gen)
    return TensorDataset(images, labels)


def train(model, rank, device, train_loader, optimizer, epoch, sampler=None):
    model.train()
    ddp_loss = torch.zeros(2, device=device)
    if sampler:
        sampler.set_epoch(epoch)
    for data, target in train_loader:
        data, target = data.to(device), target.to(device)
        optimizer.zero_grad()
        output = model(data)
        loss = F.nll_loss(output, target, reduction="sum")
        loss.backward()
        optimizer.step()
        ddp_loss[0] += loss.item()
        ddp_loss[1] += len(data)
    # Every rank's loss sum and sample count, summed on smddp's communicator.
    dist.all_reduce(ddp_loss, op=dist.ReduceOp.SUM)
    if rank == 0:
        print(f"Train Epoch: {epoch} \tLoss: {ddp_loss[0] / ddp_loss[1]:.6f}", flush=True)


def test(model, rank, device, test_loader):
    model.eval()
    ddp_loss = torch.zeros(3, device=device)
    with torch.no_grad():
        for data, target in test_loader:
            data, target = data.to(device), target.to(device)
            output = model(data)
            ddp_loss[0] += F.nll_loss(output, target, reduction="sum").item()
            pred = output.argmax(dim=1, keepdim=True)
            ddp_loss[1] += pred.eq(target.view_as(pred)).sum().item()
            ddp_loss[2] += len(data)
    dist.all_reduce(ddp_loss, op=dist.ReduceOp.SUM)
    if rank == 0:
        test_loss = ddp_loss[0] / ddp_loss[2]
        print(f"Test set: Average loss: {test_loss:.4f}, Accuracy: {int(ddp_loss[1])}/{int(ddp_loss[2])} "
              f"({100.0 * ddp_loss[1] / ddp_loss[2]:.2f}%)\n", flush=True)


def fsdp_main(args):
    # smddp's world: mpirun, smddprun, torchrun, Slurm, or a plain `python` (a world of one).
    # torch.distributed is then initialised on it: dist.* below run on smddp's communicator.
    smddp_dist.init_process_group()
    rank, world_size = dist.get_rank(), dist.get_world_size()

    if torch.cuda.is_available() and not args.no_cuda:
        torch.cuda.set_device(smddp_dist.get_local_rank())
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")

    dataset = synthetic_mnist(args.train_samples + args.test_samples, seed=1234)
    dataset1 = Subset(dataset, range(args.train_samples))
    dataset2 = Subset(dataset, range(args.train_samples, len(dataset)))
    sampler1 = DistributedSampler(dataset1, rank=rank, num_replicas=world_size, shuffle=True)
    sampler2 = DistributedSampler(dataset2, rank=rank, num_replicas=world_size)
    train_loader = DataLoader(dataset1, batch_size=args.batch_size, sampler=sampler1)
    test_loader = DataLoader(dataset2, batch_size=args.test_batch_size, sampler=sampler2)

    model = Net().to(device)
    # Each layer is a unit of sharding (all-gathered just before it runs), then the root.
    for layer in (model.conv1, model.conv2, model.fc1, model.fc2):
        fully_shard(layer)
    fully_shard(model)

    optimizer = optim.Adadelta(model.parameters(), lr=args.lr)
    scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)
    start = time.perf_counter()
    for epoch in range(1, args.epochs + 1):
        train(model, rank, device, train_loader, optimizer, epoch, sampler=sampler1)
        test(model, rank, device, test_loader)
        scheduler.step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    if rank == 0:
        print(f"{world_size} rank(s) on {device.type}: {time.perf_counter() - start:.2f} s elapsed", flush=True)
        print(f"{model}", flush=True)

    if args.save_model:
        # use a barrier to make sure training is done on all ranks
        dist.barrier()
        # The full (unsharded) weights, gathered to rank 0's CPU memory.
        states = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            torch.save(states, args.save_path)
            print(f"Saved {args.save_path}", flush=True)

    smddp_dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="FSDP on smddp (synthetic MNIST)")
    parser.add_argument("--batch-size", type=int, default=64, metavar="N",
                        help="input batch size per rank for training (default: 64)")
    parser.add_argument("--test-batch-size", type=int, default=256, metavar="N",
                        help="input batch size per rank for testing (default: 256)")
    parser.add_argument("--epochs", type=int, default=3, metavar="N", help="number of epochs to train (default: 3)")
    parser.add_argument("--lr", type=float, default=1.0, metavar="LR", help="learning rate (default: 1.0)")
    parser.add_argument("--gamma", type=float, default=0.7, metavar="M", help="learning rate step gamma (default: 0.7)")
    parser.add_argument("--train-samples", type=int, default=1024, help="synthetic training images (default: 1024)")
    parser.add_argument("--test-samples", type=int, default=512, help="synthetic test images (default: 512)")
    parser.add_argument("--no-cuda", action="store_true", default=False, help="disables CUDA training")
    parser.add_argument("--seed", type=int, default=1, metavar="S", help="random seed (default: 1)")
    parser.add_argument("--save-model", action="store_true", default=False, help="for saving the current model")
    parser.add_argument("--save-path", default="mnist_cnn.pt", help="where --save-model writes (default: mnist_cnn.pt)")
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    fsdp_main(args)
