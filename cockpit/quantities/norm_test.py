"""NormTest: is the mini-batch large enough for the gradient's norm? (Byrd et al.)."""

from __future__ import annotations

from cockpit.needs import Need
from cockpit.param_view import ParamView
from cockpit.quantities import defined
from cockpit.quantities.base import Missing, SingleStepQuantity, TrackContext
from cockpit.quantities.batch_statistics import (
    PerParameter,
    share_squared_norms,
    squared_norm_entry,
    total_squared_norms,
)


class NormTest(SingleStepQuantity):
    """The norm test of Byrd et al. (2012) over the whole gradient.

    ``sqrt( sum_i ||g_i - g||^2 / (N (N-1) ||g||^2) )`` with ``g_i`` the gradient of
    sample ``i`` and ``g`` their mean. The test with tolerance ``theta`` passes iff
    ``theta >= value``: small values mean the mini-batch gradient is precise enough.

    Per-sample squared norms come from BackPACK's ``BatchL2Grad`` (no per-sample
    gradients are formed) or, when another quantity needs ``BatchGrad`` at the same
    step, from the per-sample gradients; ``||g||^2`` then comes from their mean,
    otherwise from ``.grad``. Each parameter contributes two scalars.

    Missing (see :mod:`cockpit.quantities.defined`) with fewer than 2 samples, a
    zero or non-finite ``||g||``, or a numerator lost to rounding.
    """

    needs = frozenset({Need.BATCH_L2, Need.GRADIENT})
    Accumulator = PerParameter

    def accumulate(self, global_step: int, view: ParamView) -> None:
        """Reduce the parameter to ``sum_i ||g_i,p||^2`` and ``||g_p||^2``."""
        self.acc.entries[view.index] = squared_norm_entry(view)

    def share(self, global_step: int, ctx: TrackContext, bucket) -> None:
        """Sum the per-sample squared norms over processes."""
        share_squared_norms(self.acc, ctx.comm.n_global, bucket)

    def _compute(self, global_step: int, ctx: TrackContext) -> float | Missing:
        per_sample, mean, n = total_squared_norms(self.acc, ctx.gradients())
        undefined = defined.first(defined.samples(n), defined.divisor(mean))
        spread = undefined or defined.difference(per_sample, n * mean)
        if isinstance(spread, Missing):
            return spread
        value = (spread / (n * (n - 1) * defined.wide(mean))).sqrt()
        return defined.finite(value, per_sample.dtype)
