"""MeanGSNR: the average gradient signal-to-noise ratio (Liu et al.)."""

from __future__ import annotations

from cockpit.needs import Need
from cockpit.param_view import ParamView
from cockpit.quantities import defined
from cockpit.quantities.base import Missing, SingleStepQuantity, TrackContext
from cockpit.quantities.batch_statistics import (
    SUM,
    PerParameter,
    keep_snr_parts,
    share_snr,
    snr_entry,
    total_snr,
)
from cockpit.quantities.compat import Alias102
from cockpit.utils.host import Deferred


class MeanGSNR(SingleStepQuantity):
    """The mean gradient signal-to-noise ratio of Liu et al. (2020).

    ``(1/D) sum_d g_d^2 / (v_d + epsilon)`` with ``g`` the mini-batch gradient and
    ``v_d = (1/N) sum_i g_i,d^2 - g_d^2`` the biased variance of coordinate ``d`` of
    the per-sample gradients. Each parameter's elementwise statistics are summed to
    a scalar in its hook. Works with any optimizer.

    The variances are formed with the mean subtracted first (corrected two-pass,
    :meth:`cockpit.param_view.ParamView.centered`), so a coordinate on which the
    samples agree has variance 0 and each term ``g_d^2 / (v_d + epsilon)`` is
    within a few ``eps`` (relative) of its float64 value from the same
    per-sample gradients; so is the mean. In a data-parallel run the joined
    batch's variances are the difference of the summed second moments, each
    within ``ULPS eps (1/N) sum_i g_i,d^2`` of the centred value.

    Missing (see :mod:`cockpit.quantities.defined`) with fewer than 2 samples, or
    a non-finite mean or spread (an overflow near the dtype's largest values).

    Args:
        track_schedule: When to track.
        verbose: Extra diagnostics.
        epsilon: Added to the variances (default ``1e-5``, as in cockpit-for-pytorch).
        key: History key (default ``"MeanGSNR"``).
    """

    needs = frozenset({Need.INDIVIDUAL_GRADIENTS})
    Accumulator = PerParameter
    shard_local = True
    #: FSDP2: ``sum_i g_i^2`` reduce-scattered unit by unit in the backward pass.
    sums_in_backward = ("sum_grad_squared",)
    common_sums = sums_in_backward  # (the same sum: sent once for both)

    def __init__(self, track_schedule, verbose=False, epsilon=1e-5, key=None):
        super().__init__(track_schedule, verbose=verbose, key=key)
        self.epsilon = epsilon

    _epsilon = Alias102("epsilon")  # 1.0.2's name

    def accumulate(self, global_step: int, view: ParamView) -> None:
        """Sum ``g_d^2 / (v_d + epsilon)`` over the parameter's coordinates."""
        if self.shared is not None:  # the joined batch's g is known only later
            units, channel = self.unit_sums, self.channel(SUM)
            keep_snr_parts(self.acc, view, self.shared, units, channel)
            return
        self.acc.entries[view.index] = snr_entry(view, self.epsilon, unbiased=False)

    def share(self, global_step: int, ctx: TrackContext, bucket) -> None:
        """Sum ``sum_i g_i^2`` over processes; reduce with the joined ``g``."""
        rows = self.rows_of(ctx)
        units, channel = self.unit_sums, self.channel(SUM)
        share_snr(self.acc, ctx, bucket, self.epsilon, False, rows, units, channel)

    def _compute(self, global_step: int, ctx: TrackContext) -> Deferred | Missing:
        snr, dim, _, dtype, conditions = total_snr(self.acc, len(ctx.params))
        if isinstance(snr, Missing):
            return snr
        return defined.decided(snr, dtype, *conditions, then=lambda v: v / dim)
