"""What quantities written for cockpit-for-pytorch 1.0.2 use of their base class.

The base class (:mod:`cockpit.quantities.base`) runs such quantities unchanged; this
module holds the pieces of 1.0.2's API it builds on:

* :class:`QuantityOutput`, the ``output`` dictionary (``step -> value``) of a
  quantity. It shows what the cockpit recorded under the quantity's key, and a value
  written into it (``self.output[step] = value``, as a 1.0.2 ``track`` does) is
  recorded like any computed value: it shows up in ``Cockpit.get_output()``, the log
  and the dashboard.
* :class:`Helpers102`, 1.0.2's static helpers that read ``.grad`` and BackPACK's
  results off the parameters (``_fetch_grad``, ``_fetch_batch_grad``, ...), which a
  quantity copied from one of 1.0.2's built-ins calls.
* :class:`Alias102`, 1.0.2's private attribute names of the built-in quantities'
  settings (``_epsilon``, ``_bins``, ...), which such a copy reads.
"""

from __future__ import annotations

import collections
from typing import Any, Callable

import torch


class QuantityOutput(collections.defaultdict):
    """A quantity's ``{step: value}``, as 1.0.2's ``Quantity.output``.

    A ``defaultdict(dict)``. Reading it gives the values recorded under the
    quantity's key, with histograms as numpy arrays (what
    :meth:`cockpit.Cockpit.get_output` holds); the quantity refills it when the
    history changed. Writing ``output[step] = value`` hands the value to the
    quantity, which records it (see :meth:`cockpit.quantities.Quantity.output`).

    Args:
        on_write: Called with ``(step, value)`` for every value written.
    """

    def __init__(self, on_write: Callable[[Any, Any], None]):
        super().__init__(dict)
        self._on_write = on_write
        #: What the content was read from (the quantity's business).
        self.stamp: Any = None

    def __setitem__(self, step, value) -> None:
        dict.__setitem__(self, step, value)
        self._on_write(step, value)

    def refill(self, items, stamp) -> None:
        """Replace the content by ``items`` (no value is recorded)."""
        dict.clear(self)
        dict.update(self, items)
        self.stamp = stamp

    def __reduce__(self):
        """Copies and pickles are plain ``defaultdict(dict)`` objects."""
        return (collections.defaultdict, (dict,), None, None, iter(dict.items(self)))


class Alias102:
    """A setting under 1.0.2's private attribute name, e.g. ``_epsilon``.

    ``_epsilon = Alias102("epsilon")`` in a class body makes ``self._epsilon`` read
    and write ``self.epsilon``.

    Args:
        name: The attribute that holds the setting.
    """

    def __init__(self, name: str):
        self.name = name

    def __get__(self, instance, owner=None):
        if instance is None:
            return self
        return getattr(instance, self.name)

    def __set__(self, instance, value) -> None:
        setattr(instance, self.name, value)


def _concat(tensors, start_dim: int = 0):
    return torch.cat([t.flatten(start_dim=start_dim) for t in tensors], dim=start_dim)


class Helpers102:
    """1.0.2's static helpers of ``Quantity``: read results off the parameters.

    Each takes the parameters and ``aggregate``: with ``aggregate=True`` the
    per-parameter results are combined over parameters (concatenated, or summed for
    per-sample norms and dot products), as 1.0.2 did. They read what is on the
    parameters: ``.grad``, and the BackPACK results of the extensions a 1.0.2
    quantity returns from ``extensions(global_step)`` (``BatchGrad``'s,
    ``batch_l2``, ``batch_dot``, ``sum_grad_squared``, a curvature diagonal).
    """

    @staticmethod
    def _fetch_grad(params, aggregate=False):
        """The gradients ``.grad`` (concatenated into one vector if ``aggregate``)."""
        grads = [p.grad for p in params]
        return _concat(grads) if aggregate else grads

    @staticmethod
    def _fetch_grad_l2_squared(params, aggregate=False):
        """``||g_p||^2`` per parameter (summed if ``aggregate``)."""
        norms = [p.grad.pow(2).sum() for p in params]
        return sum(norms) if aggregate else norms

    @staticmethod
    def _fetch_batch_grad(params, aggregate=False):
        """BackPACK's per-sample gradients (``BatchGrad``) per parameter.

        ``[N, D]`` over all parameters if ``aggregate``.
        """
        from cockpit.engines.backpack.api import stored_per_sample

        per_sample = [stored_per_sample(p) for p in params]
        return _concat(per_sample, start_dim=1) if aggregate else per_sample

    @staticmethod
    def _fetch_batch_l2_squared(params, aggregate=False):
        """BackPACK's ``batch_l2`` per parameter (summed if ``aggregate``)."""
        batch_l2 = [p.batch_l2 for p in params]
        return sum(batch_l2) if aggregate else batch_l2

    @staticmethod
    def _fetch_batch_dot(params, aggregate=False):
        """BackPACK's ``batch_dot`` per parameter (summed if ``aggregate``)."""
        batch_dot = [p.batch_dot for p in params]
        return sum(batch_dot) if aggregate else batch_dot

    @staticmethod
    def _fetch_sum_grad_squared(params, aggregate=False):
        """BackPACK's ``sum_grad_squared`` (concatenated if ``aggregate``)."""
        moments = [p.sum_grad_squared for p in params]
        return _concat(moments) if aggregate else moments

    @staticmethod
    def _fetch_diag_curvature(params, savefield, aggregate=True):
        """A BackPACK curvature diagonal (``"diag_h"``, ...), concatenated."""
        diagonals = [getattr(p, savefield) for p in params]
        return _concat(diagonals) if aggregate else diagonals

    def _verbose_prefix(self, global_step) -> str:
        return f"[Step {global_step} | {type(self).__name__}]"

    def _save(self, global_step, result) -> None:
        """Record ``result`` under ``global_step`` (1.0.2's ``_save``)."""
        self.output[global_step] = result
