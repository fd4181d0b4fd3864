"""Counting the host synchronisations (and default-device tensors) of cockpit code.

A device-to-host copy is what ``.item()``, ``.tolist()``, ``.cpu()``, ``.numpy()``,
``.to("cpu")`` and Python's ``float()``/``bool()``/``int()`` of a tensor do; on a
GPU each one waits for the device. :class:`SyncCounter` (a ``TorchFunctionMode``)
counts the calls made from cockpit's code, by place, except the recorder's
conversion of a step's values when it flushes them (``cockpit/utils/host.py``: one
copy per device, then Python numbers from host tensors).

:class:`FactoryCounter` counts the tensors cockpit's code creates through a
factory function without naming a device (``torch.tensor(x)``, ``torch.zeros(n)``):
on a CUDA step each would be a CPU tensor on the hot path, and a copy.
"""

from __future__ import annotations

import collections
import traceback

import torch
from torch.overrides import TorchFunctionMode

SYNCS = {
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.cpu,
    torch.Tensor.numpy,
    torch.Tensor.__bool__,
    torch.Tensor.__float__,
    torch.Tensor.__int__,
    torch.Tensor.__index__,
}
FLUSH = "cockpit/utils/host.py"


def _to_cpu(func, args, kwargs) -> bool:
    return func is torch.Tensor.to and any(
        isinstance(a, str) and a == "cpu" for a in (*args[1:], *kwargs.values())
    )


def _place() -> str | None:
    """``file:line`` of the innermost frame in cockpit's own code, if any."""
    frames = [
        f
        for f in traceback.extract_stack()[:-2]
        if "/cockpit/" in f.filename and "/tests/" not in f.filename
    ]
    if not frames:
        return None
    return f"{frames[-1].filename.split('/cockpit/', 1)[-1]}:{frames[-1].lineno}"


class SyncCounter(TorchFunctionMode):
    """Counts the host synchronisations made from cockpit's code while active."""

    def __init__(self):
        super().__init__()
        self.places: collections.Counter = collections.Counter()

    @property
    def total(self) -> int:
        """Every counted synchronisation."""
        return sum(self.places.values())

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in SYNCS or _to_cpu(func, args, kwargs):
            where = _place()
            if where is not None and f"cockpit/{where.split(':')[0]}" != FLUSH:
                self.places[(func.__name__, where)] += 1
        return func(*args, **kwargs)


#: Functions that make a tensor on the default device unless told another.
FACTORIES = {
    torch.tensor,
    torch.as_tensor,
    torch.scalar_tensor,
    torch.zeros,
    torch.ones,
    torch.empty,
    torch.full,
    torch.arange,
    torch.linspace,
    torch.eye,
    torch.rand,
    torch.randn,
    torch.randint,
}


class FactoryCounter(SyncCounter):
    """Counts factory calls without a device from cockpit's code, by place.

    ``torch.as_tensor`` of a tensor is left alone (it keeps the tensor's device).
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FACTORIES and kwargs.get("device") is None:
            kept = func is torch.as_tensor and isinstance(args[0], torch.Tensor)
            where = None if kept else _place()
            if where is not None:
                self.places[(func.__name__, where)] += 1
        return func(*args, **kwargs)
