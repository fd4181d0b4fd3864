"""Variance: the spread of the per-sample gradients, per parameter tensor."""

from __future__ import annotations

import torch

from cockpit.needs import Need
from cockpit.param_view import ParamView
from cockpit.quantities.base import SingleStepQuantity, TrackContext
from cockpit.quantities.batch_statistics import PerParameter


class Variance(SingleStepQuantity):
    """Trace of the per-sample gradient covariance, per parameter tensor.

    With ``g_i`` the gradient of sample ``i``'s loss and ``g = (1/N) sum_i g_i`` the
    mini-batch gradient (mean-reduced loss), the value for tensor ``p`` is::

        (1/N) sum_i ||g_i,p - g_p||^2  =  (1/N) sum_i ||g_i,p||^2 - ||g_p||^2

    The per-sample squared norms come from BackPACK's ``BatchL2Grad`` (which does not
    materialise per-sample gradients) or, when another quantity already needs them,
    from ``BatchGrad``; ``g`` is read from ``.grad``. Not part of cockpit-for-pytorch.
    """

    needs = frozenset({Need.BATCH_L2, Need.GRADIENT})
    Accumulator = PerParameter

    def accumulate(self, global_step: int, view: ParamView) -> None:
        """Sum the per-sample squared norms of the parameter."""
        batch_l2 = view.batch_l2()
        self.acc.entries[view.index] = (batch_l2.sum(), batch_l2.shape[0])

    def share(self, global_step: int, ctx: TrackContext, bucket) -> None:
        """Sum ``sum_i ||g_i,p||^2`` over processes (``N`` of the joined batch)."""
        entries, n = self.acc.entries, ctx.comm.n_global
        for index, (sum_sq, _) in list(entries.items()):
            bucket.sum(sum_sq, lambda v, i=index: entries.__setitem__(i, (v, n)))

    def _compute(self, global_step: int, ctx: TrackContext) -> list[float]:
        values = []
        entries = self.acc.ordered(len(ctx.params))
        for (sum_sq, n), grad in zip(entries, ctx.gradients(), strict=True):
            values.append(sum_sq / n - (grad**2).sum())
        return torch.stack(values).tolist()
