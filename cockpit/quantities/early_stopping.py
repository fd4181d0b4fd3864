"""EarlyStopping: the evidence-based stopping criterion (Mahsereci et al.)."""

from __future__ import annotations

from cockpit.needs import Need
from cockpit.param_view import ParamView
from cockpit.quantities import defined
from cockpit.quantities import functional as F
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
from cockpit.quantities.optim import require_plain_sgd
from cockpit.utils.host import Deferred


class EarlyStopping(SingleStepQuantity):
    """The evidence-based early-stopping criterion of Mahsereci et al. (2017).

    ``1 - (N/D) sum_d g_d^2 / (s_d^2 + epsilon)`` with ``g`` the mini-batch gradient
    and ``s_d^2 = (1/(N-1)) sum_i (g_i,d - g_d)^2`` the unbiased variance of
    coordinate ``d`` of the per-sample gradients. Positive values suggest stopping.
    Each parameter's elementwise statistics are summed to a scalar in its hook.
    The variances are centred as for :class:`MeanGSNR`, so the value is within a
    few ``eps * N * MeanGSNR`` of its float64 value from the same per-sample
    gradients. Missing as :class:`MeanGSNR` (see
    :mod:`cockpit.quantities.defined`).

    Args:
        track_schedule: When to track.
        verbose: Extra diagnostics.
        epsilon: Added to the variances (default ``1e-5``, as in cockpit-for-pytorch).
        key: History key (default ``"EarlyStopping"``).

    Raises:
        ValueError: When tracked with anything but plain ``torch.optim.SGD``; the
            message names the setting at fault.
    """

    info_keys = ("optimizer",)

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

    def prepare(self, global_step: int, info) -> None:
        """Fail before the backward pass unless the optimizer is plain SGD."""
        if info is not None and self.should_compute(global_step):
            require_plain_sgd(info.require("optimizer", self.key), self.key)

    def accumulate(self, global_step: int, view: ParamView) -> None:
        """Sum ``g_d^2 / (s_d^2 + epsilon)`` over the parameter's coordinates."""
        if self.shared is not None:  # the joined batch's g is known only later
            units, channel = self.unit_sums, self.channel(SUM)
            keep_snr_parts(self.acc, view, self.shared, units, channel)
            return
        self.acc.entries[view.index] = snr_entry(view, self.epsilon, unbiased=True)

    def share(self, global_step: int, ctx: TrackContext, bucket) -> None:
        """Sum ``sum_i g_i^2`` over processes; reduce with the joined ``g``."""
        rows = self.rows_of(ctx)
        units, channel = self.unit_sums, self.channel(SUM)
        share_snr(self.acc, ctx, bucket, self.epsilon, True, rows, units, channel)

    def _compute(self, global_step: int, ctx: TrackContext) -> Deferred | Missing:
        snr, dim, n, dtype, conditions = total_snr(self.acc, len(ctx.params))
        if isinstance(snr, Missing):
            return snr
        return defined.decided(
            snr, dtype, *conditions, then=lambda v: F.early_stopping(v, n, dim)
        )
