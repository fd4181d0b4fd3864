"""Values to the host once per step: every tensor of a record in one copy per device.

Quantities may return tensors (0-d for a number, ``[P]`` for one value per
parameter, nested in dicts and lists). The recorder converts a step's values when
it flushes them: the tensors of each device are flattened into one float64 vector,
copied to the host in one transfer (a single device synchronisation), and turned
into Python numbers and lists (a 0-d tensor a number, others nested lists; each in
its own dtype, as ``.item()`` and ``.tolist()`` give them).

A value whose fate depends on its numbers (a statistic that is undefined where a
sum overflowed, a fit that may be singular) is handed over as a :class:`Deferred`:
its tensors travel in the same copy, and its ``finish`` decides on the host what
is recorded (the number, or a reason it is missing). The check costs no
synchronisation of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor


@dataclass(frozen=True)
class Deferred:
    """A value decided on the host, when the step's values are copied there.

    Attributes:
        tensors: Tensors (nested in tuples, lists and dicts) the decision needs.
        finish: Called with ``tensors`` as Python numbers and lists (as
            :func:`to_host` gives them); returns what is recorded.
    """

    tensors: Any
    finish: Callable[[Any], Any]


def _collect(value, found: list, deferred: list) -> None:
    """Add the tensors in ``value`` to ``found``, its Deferred ones to ``deferred``."""
    if isinstance(value, Tensor):
        found.append(value)
    elif isinstance(value, Deferred):
        deferred.append(value)
        _collect(value.tensors, found, deferred)
    elif isinstance(value, dict):
        for item in value.values():
            _collect(item, found, deferred)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _collect(item, found, deferred)


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
    deferred: list[Deferred] = []
    _collect(value, found, deferred)
    if not found and not deferred:
        return value
    host = _copied(found)

    def rebuild(item):
        if isinstance(item, Tensor):
            moved = host[id(item)]
            return moved.item() if moved.dim() == 0 else moved.tolist()
        if isinstance(item, Deferred):
            return item.finish(rebuild(item.tensors))
        if isinstance(item, dict):
            return {key: rebuild(entry) for key, entry in item.items()}
        if isinstance(item, list):
            return [rebuild(entry) for entry in item]
        if isinstance(item, tuple):
            return tuple(rebuild(entry) for entry in item)
        return item

    return rebuild(value)
