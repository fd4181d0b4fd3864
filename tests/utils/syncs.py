"""Counting the host synchronisations of cockpit code on the CPU.

A device-to-host copy is what ``.item()``, ``.tolist()``, ``.cpu()``, ``.numpy()``,
``.to("cpu")`` and Python's ``float()``/``bool()``/``int()`` of a tensor do; on a
GPU each one waits for the device. :class:`SyncCounter` (a ``TorchFunctionMode``)
counts the calls made from cockpit's code, by place, except the recorder's
conversion of a step's values when it flushes them (``cockpit/utils/host.py``: one
copy per device, then Python numbers from host tensors).
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
            frames = [
                f
                for f in traceback.extract_stack()[:-1]
                if "/cockpit/" in f.filename and "/tests/" not in f.filename
            ]
            if frames:
                where = frames[-1].filename.split("/cockpit/", 1)[-1]
                if f"cockpit/{where}" != FLUSH:
                    self.places[(func.__name__, f"{where}:{frames[-1].lineno}")] += 1
        return func(*args, **kwargs)
