"""Variance: the spread of the per-sample gradients, per parameter tensor."""

from __future__ import annotations

import torch

from cockpit.needs import Need
from cockpit.param_view import ParamView
from cockpit.quantities import defined
from cockpit.quantities.base import Missing, SingleStepQuantity, TrackContext
from cockpit.quantities.batch_statistics import (
    PerParameter,
    share_squared_norms,
    squared_norm_entry,
)


class Variance(SingleStepQuantity):
    """Trace of the per-sample gradient covariance, per parameter tensor.

    With ``g_i`` the gradient of sample ``i``'s loss and ``g = (1/N) sum_i g_i`` the
    mini-batch gradient (mean-reduced loss), the value for tensor ``p`` is::

        (1/N) sum_i ||g_i,p - g_p||^2  =  (1/N) sum_i ||g_i,p||^2 - ||g_p||^2

    The per-sample squared norms come from BackPACK's ``BatchL2Grad`` (which does not
    materialise per-sample gradients) or, when another quantity already needs them,
    from ``BatchGrad``; ``g`` is then their mean, otherwise ``.grad``. Not part of
    cockpit-for-pytorch.

    Missing (see :mod:`cockpit.quantities.defined`) with fewer than 2 samples, or
    when a parameter's sums are not finite; a variance within the rounding error
    of the sums (or below zero by rounding) is 0.
    """

    needs = frozenset({Need.BATCH_L2, Need.GRADIENT})
    Accumulator = PerParameter

    def accumulate(self, global_step: int, view: ParamView) -> None:
        """Reduce the parameter to ``sum_i ||g_i,p||^2`` (and ``||g_p||^2``)."""
        self.acc.entries[view.index] = squared_norm_entry(view)

    def share(self, global_step: int, ctx: TrackContext, bucket) -> None:
        """Sum ``sum_i ||g_i,p||^2`` over processes (``N`` of the joined batch)."""
        share_squared_norms(self.acc, ctx.comm.n_global, bucket)

    def _compute(self, global_step: int, ctx: TrackContext) -> list[float] | Missing:
        entries = self.acc.ordered(len(ctx.params))
        if not entries:
            return []
        undefined = defined.first(*(defined.samples(n) for _, _, n in entries))
        if undefined is not None:
            return undefined
        means, squares, coarsest = [], [], entries[0][0].dtype
        for (sum_sq, grad_sq, n), grad, param in zip(
            entries, ctx.gradients(), ctx.params, strict=True
        ):
            means.append(sum_sq / n)
            if grad_sq is None:  # ||g_p||^2 from .grad, rounded to the param's dtype
                grad_sq = (grad**2).sum()
                if defined.eps(param.dtype) > defined.eps(coarsest):
                    coarsest = param.dtype
            squares.append(grad_sq.to(sum_sq.dtype))
        means, squares = torch.stack(means), torch.stack(squares)
        spread = defined.difference(means, squares, coarsest, floor=True)
        return spread if isinstance(spread, Missing) else spread.tolist()
