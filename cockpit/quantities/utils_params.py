"""Helpers shared by quantities that read parameters and gradients after backward."""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor


def gradients(params: Sequence[Tensor]) -> list[Tensor]:
    """Return each parameter's ``.grad`` (a zero tensor where it is ``None``)."""
    return [
        p.grad.detach() if p.grad is not None else torch.zeros_like(p) for p in params
    ]


def snapshot(params: Sequence[Tensor]) -> list[Tensor]:
    """Return detached copies of the parameter values."""
    return [p.detach().clone() for p in params]


def norms(tensors: Sequence[Tensor]) -> list[float]:
    """Return the Euclidean norm of each tensor, with a single device sync."""
    if not tensors:
        return []
    return torch.stack([t.norm() for t in tensors]).tolist()
