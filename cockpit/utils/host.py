"""Values to the host once per step: every tensor of a record in one copy per device.

Quantities may return tensors (0-d for a number, ``[P]`` for one value per
parameter, nested in dicts and lists). The recorder converts a step's values when
it flushes them: the tensors of each device are flattened into one float64 vector,
copied to the host in one transfer (a single device synchronisation), and turned
into Python numbers and lists (a 0-d tensor a number, others nested lists; each in
its own dtype, as ``.item()`` and ``.tolist()`` give them).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


def _collect(value, found: list) -> None:
    if isinstance(value, Tensor):
        found.append(value)
    elif isinstance(value, dict):
        for item in value.values():
            _collect(item, found)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _collect(item, found)


def _copied(tensors: list[Tensor]) -> dict[int, Tensor]:
    """``id(tensor) -> the tensor on the CPU``: one copy per device."""
    by_device: dict[torch.device, list[Tensor]] = {}
    for tensor in tensors:
        by_device.setdefault(tensor.device, []).append(tensor)
    host = {}
    for device, group in by_device.items():
        if device.type == "cpu":
            host.update({id(t): t.detach() for t in group})
            continue
        flat = torch.cat([t.detach().reshape(-1).to(torch.float64) for t in group])
        pieces = flat.cpu().split([t.numel() for t in group])
        for tensor, piece in zip(group, pieces, strict=True):
            host[id(tensor)] = piece.reshape(tensor.shape).to(tensor.dtype)
    return host


def to_host(value: Any) -> Any:
    """``value`` with every tensor in it as Python numbers (see the module)."""
    found: list[Tensor] = []
    _collect(value, found)
    if not found:
        return value
    host = _copied(found)

    def rebuild(item):
        if isinstance(item, Tensor):
            moved = host[id(item)]
            return moved.item() if moved.dim() == 0 else moved.tolist()
        if isinstance(item, dict):
            return {key: rebuild(entry) for key, entry in item.items()}
        if isinstance(item, list):
            return [rebuild(entry) for entry in item]
        if isinstance(item, tuple):
            return tuple(rebuild(entry) for entry in item)
        return item

    return rebuild(value)
