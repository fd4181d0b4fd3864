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
    total_spread,
)
from cockpit.utils.host import Deferred


class NormTest(SingleStepQuantity):
    """The norm test of Byrd et al. (2012) over the whole gradient.

    ``sqrt( sum_i ||g_i - g||^2 / (N (N-1) ||g||^2) )`` with ``g_i`` the gradient of
    sample ``i`` and ``g`` their mean. The test with tolerance ``theta`` passes iff
    ``theta >= value``: small values mean the mini-batch gradient is precise enough.

    Per-sample squared norms come from BackPACK's ``BatchL2Grad`` (no per-sample
    gradients are formed) or, when another quantity needs ``BatchGrad`` at the same
    step, from the per-sample gradients; ``||g||^2`` then comes from their mean,
    otherwise from ``.grad``. Each parameter contributes two scalars.

    The numerator is centred (two-pass, exact to the dtype) where the per-sample
    gradients exist as a tensor; from ``BatchL2Grad`` alone it is the difference
    ``sum_i ||g_i||^2 - N ||g||^2`` in float64, so the value is then within
    ``sqrt(ULPS eps (sum_i ||g_i||^2 + N ||g||^2) / (N (N-1) ||g||^2))`` of the
    float64 value of the same per-sample gradients (``eps`` of their dtype,
    :data:`~cockpit.quantities.defined.ULPS`): about ``0.1 / sqrt(N-1)`` in float32
    where the samples agree, when the exact value is near 0.

    Missing (see :mod:`cockpit.quantities.defined`) with fewer than 2 samples, a
    zero ``||g||``, or non-finite sums.
    """

    needs = frozenset({Need.BATCH_L2, Need.GRADIENT})
    Accumulator = PerParameter
    shard_local = True

    def accumulate(self, global_step: int, view: ParamView) -> None:
        """Reduce the parameter to ``sum_i ||g_i,p||^2`` and ``||g_p||^2``."""
        self.acc.entries[view.index] = squared_norm_entry(view)

    def share(self, global_step: int, ctx: TrackContext, bucket) -> None:
        """Sum the per-sample squared norms over processes."""
        share_squared_norms(self.acc, ctx, bucket, self.rows_of(ctx))

    def _compute(self, global_step: int, ctx: TrackContext) -> Deferred | Missing:
        spread, mean, n, dtype, conditions = total_spread(self.acc, ctx.gradients())
        undefined = defined.samples(n)
        if undefined is not None:
            return undefined
        value = (spread / (n * (n - 1) * mean)).sqrt()
        return defined.decided(value, dtype, *conditions, *defined.divisor(mean))
