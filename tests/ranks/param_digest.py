"""The digest of a model's parameters and buffers that the integration scripts print before and after training."""

from __future__ import annotations

import hashlib

import torch


def digest(model: torch.nn.Module) -> str:
    """The first 16 hex digits of the SHA-256 of every state-dict entry's name and bytes, by name."""
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]
