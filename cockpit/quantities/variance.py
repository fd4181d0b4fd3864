"""Variance: the spread of the per-sample gradients, per parameter tensor."""

from __future__ import annotations

from cockpit.needs import Need
from cockpit.param_view import ParamView
from cockpit.quantities import defined
from cockpit.quantities.base import Missing, SingleStepQuantity, TrackContext
from cockpit.quantities.batch_statistics import (
    PerParameter,
    batch_size_of,
    checked_spreads,
    share_squared_norms,
    squared_norm_entry,
)
from cockpit.utils.host import Deferred


class Variance(SingleStepQuantity):
    """Trace of the per-sample gradient covariance, per parameter tensor.

    With ``g_i`` the gradient of sample ``i``'s loss and ``g = (1/N) sum_i g_i`` the
    mini-batch gradient (mean-reduced loss), the value for tensor ``p`` is::

        (1/N) sum_i ||g_i,p - g_p||^2  =  (1/N) sum_i ||g_i,p||^2 - ||g_p||^2

    The per-sample squared norms come from BackPACK's ``BatchL2Grad`` (which does not
    materialise per-sample gradients) or, when another quantity already needs them,
    from ``BatchGrad``; ``g`` is then their mean, otherwise ``.grad``. Not part of
    cockpit-for-pytorch.

    Each parameter's spread is centred (two-pass, exact to the dtype) where its
    per-sample gradients exist as a tensor; from ``BatchL2Grad`` alone it is the
    difference of the two sums in float64, clamped at 0, within ``ULPS eps
    ((1/N) sum_i ||g_i,p||^2 + ||g_p||^2)`` of the float64 value of the same
    per-sample gradients (:data:`~cockpit.quantities.defined.ULPS`).

    Missing (see :mod:`cockpit.quantities.defined`) with fewer than 2 samples, or
    when a parameter's sums are not finite.
    """

    needs = frozenset({Need.BATCH_L2, Need.GRADIENT})
    Accumulator = PerParameter
    shard_local = True

    def accumulate(self, global_step: int, view: ParamView) -> None:
        """Reduce the parameter to ``sum_i ||g_i,p||^2`` (and ``||g_p||^2``)."""
        self.acc.entries[view.index] = squared_norm_entry(view)

    def share(self, global_step: int, ctx: TrackContext, bucket) -> None:
        """Sum ``sum_i ||g_i,p||^2`` over processes (``N`` of the joined batch)."""
        share_squared_norms(self.acc, ctx, bucket, self.rows_of(ctx))

    def _compute(self, global_step: int, ctx: TrackContext) -> Deferred | Missing:
        if not ctx.params:
            return []
        n = batch_size_of(self.acc.ordered(len(ctx.params)))
        undefined = defined.samples(n)
        if undefined is not None:
            return undefined
        spreads, _, _, dtype, conditions = checked_spreads(self.acc, ctx.gradients())
        return defined.decided(spreads / n, dtype, *conditions)
