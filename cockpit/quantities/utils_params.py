"""Helpers shared by quantities that read parameters and gradients after backward."""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from cockpit.precision import compute_dtype, upcast


def gradients(params: Sequence[Tensor]) -> list[Tensor]:
    """Return each parameter's ``.grad`` (a zero tensor where it is ``None``).

    Half-precision gradients are returned in float32 (statistics of them are sums).
    """
    return [
        upcast(p.grad.detach())
        if p.grad is not None
        else torch.zeros_like(p, dtype=compute_dtype(p.dtype))
        for p in params
    ]


def snapshot(params: Sequence[Tensor]) -> list[Tensor]:
    """Return detached copies of the parameter values (half precision: float32).

    Differences to later values (``p - p0``) are then formed in float32, where
    the difference of two bfloat16 numbers is exact.
    """
    return [p.detach().to(compute_dtype(p.dtype), copy=True) for p in params]


def norms(tensors: Sequence[Tensor]) -> Tensor | list:
    """The Euclidean norm of each tensor, stacked (no sync; recorded as a list)."""
    if not tensors:
        return []
    return torch.stack([t.norm() for t in tensors])
