"""Data parallel training in the v2 style: torch.distributed with the "smddp" backend.

smdistributed 1.4 and later let scripts keep PyTorch's own API: import the module that
registers the backend, initialize ``torch.distributed`` with ``backend="smddp"`` and wrap the
model in PyTorch's ``DistributedDataParallel``. With smddp the import is
``smddp.torch.torch_smddp`` (``smdistributed.dataparallel.torch.torch_smddp`` also works
under ``smddprun``)::

    smddprun -np 2 examples/train_v2.py
    torchrun --nproc-per-node 2 examples/train_v2.py
    mpirun -np 2 python examples/train_v2.py

Synthetic MNIST-shaped data, offline, seconds on a CPU. Each rank ends by printing
``WEIGHTS <rank> <sha256>`` of its model: identical on every rank.
"""

from __future__ import annotations

import argparse
import hashlib
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import smddp.torch.torch_smddp  # noqa: F401  (registers the "smddp" backend)


def local_rank():
    """This process's rank on its host, from whichever launcher started it."""
    for name in ("SMDATAPARALLEL_LOCAL_RANK", "LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID"):
        if name in os.environ:
            return int(os.environ[name])
    return 0


def synthetic_mnist(samples, seed=1234):
    """MNIST-shaped images: one fixed random pattern per digit class, plus noise."""
    gen = torch.Generator().manual_seed(seed)
    patterns = torch.randn(10, 1, 28, 28, generator=gen)
    labels = torch.randint(0, 10, (samples,), generator=gen)
    images = patterns[labels] + 1.5 * torch.randn(samples, 1, 28, 28, generator=gen)
    return TensorDataset(images, labels)


def make_model():
    return nn.Sequential(
        nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Conv2d(4, 8, 3), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(8 * 12 * 12, 32), nn.ReLU(), nn.Linear(32, 10),
    )


def weights_sha256(model):
    """SHA-256 of every parameter and buffer, in state-dict order."""
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        digest.update(name.encode())
        digest.update(bytes(tensor.detach().cpu().clone().untyped_storage()))
    return digest.hexdigest()


def main():
    parser = argparse.ArgumentParser(description="torch.distributed with the smddp backend (synthetic MNIST)")
    parser.add_argument("--batch-size", type=int, default=64, help="global batch size")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--samples", type=int, default=1024)
    parser.add_argument("--model-dir", default=os.environ.get("SM_MODEL_DIR", "model"))
    args = parser.parse_args()

    dist.init_process_group(backend="smddp")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank())
        device = torch.device("cuda", local_rank())
    else:
        device = torch.device("cpu")
    torch.manual_seed(0)

    dataset = synthetic_mnist(args.samples)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank)
    loader = DataLoader(dataset, batch_size=max(args.batch_size // world_size, 1), sampler=sampler)
    model = DDP(make_model().to(device), device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * world_size, momentum=0.9)

    for epoch in range(1, args.epochs + 1):
        sampler.set_epoch(epoch)
        total = torch.zeros(2, device=device)
        for images, labels in loader:
            images, labels = images.to(device), labels.to(device)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(images), labels)
            loss.backward()
            optimizer.step()
            total += torch.stack([loss.detach() * len(labels), torch.tensor(float(len(labels)), device=device)])
        dist.all_reduce(total)  # the mean loss over every rank's samples
        if rank == 0:
            print(f"epoch {epoch}: loss {(total[0] / total[1]).item():.4f}", flush=True)

    if rank == 0:
        os.makedirs(args.model_dir, exist_ok=True)
        torch.save(model.module.state_dict(), os.path.join(args.model_dir, "model.pt"))
    print(f"WEIGHTS {rank} {weights_sha256(model.module)}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
