"""What torch is doing around a call: a ``torch.func`` transform, autocast.

Hooks and wrappers that must stay out of the way of such calls (the replay and
ghost engines' forward hooks, the attention wrapper) ask here.
"""

from __future__ import annotations

import torch

__all__ = ["autocast_on", "in_transform"]


def in_transform() -> bool:
    """Whether a ``torch.func`` transform (``vmap``, ``grad``, ...) is running."""
    try:
        return torch._C._functorch.maybe_current_level() is not None
    except AttributeError:  # pragma: no cover - builds without functorch
        return False


def autocast_on() -> bool:
    """Whether autocast is enabled for a device type this build knows."""
    for device in ("cpu", "cuda"):
        try:
            if torch.is_autocast_enabled(device):
                return True
        except (RuntimeError, TypeError):  # a device type this build lacks
            continue
    return False
