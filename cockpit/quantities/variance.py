"""Variance: the spread of the per-sample gradients, per parameter tensor."""

from __future__ import annotations

import torch

from cockpit.needs import Need
from cockpit.param_view import ParamView
from cockpit.quantities.base import SingleStepQuantity, TrackContext
from cockpit.quantities.utils_params import gradients


class Variance(SingleStepQuantity):
    """Trace of the per-sample gradient covariance, per parameter tensor.

    With ``g_i`` the gradient of sample ``i``'s loss and ``g = (1/N) sum_i g_i`` the
    mini-batch gradient (mean-reduced loss), the value for tensor ``p`` is::

        (1/N) sum_i ||g_i,p - g_p||^2  =  (1/N) sum_i ||g_i,p||^2 - ||g_p||^2

    The per-sample squared norms come from BackPACK's ``BatchL2Grad`` (which does not
    materialise per-sample gradients) or, when another quantity already needs them,
    from ``BatchGrad``; ``g`` is read from ``.grad``. Not part of cockpit-for-pytorch.
    """

    def needs(self, global_step: int):
        """Per-sample squared norms, on scheduled steps."""
        return {Need.BATCH_L2} if self.should_compute(global_step) else set()

    def accumulate(self, global_step: int, view: ParamView) -> None:
        """Sum the per-sample squared norms of the parameter."""
        batch_l2 = view.batch_l2()
        self._acc[view.index] = (batch_l2.sum(), batch_l2.shape[0])

    def _compute(self, global_step: int, ctx: TrackContext) -> list[float]:
        values = []
        for i, grad in enumerate(gradients(ctx.params)):
            sum_sq, n = self._acc[i]
            values.append(sum_sq / n - (grad**2).sum())
        return torch.stack(values).tolist()
