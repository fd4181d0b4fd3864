"""CABS: the batch size suggested by coupled adaptive batch sizes (Balles et al.)."""

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
from cockpit.quantities.optim import require_plain_sgd
from cockpit.utils.host import Deferred

ZERO_LOSS = (
    "the loss is zero, and CABS divides by it. Fix: none needed (nothing left to "
    "learn at this step)"
)


class CABS(SingleStepQuantity):
    """The CABS batch size of Balles et al. (2017), for plain SGD.

    ``lr * sum_d v_d / L`` with ``v_d = (1/N) sum_i (g_i,d - g_d)^2`` the biased
    variance of coordinate ``d`` of the per-sample gradients and ``L`` the mini-batch
    loss. As ``sum_d v_d = (1/N) sum_i ||g_i||^2 - ||g||^2``, each parameter is
    reduced to two scalars in the backward pass, from BackPACK's ``BatchL2Grad``
    (or ``BatchGrad`` when another quantity needs it); see :class:`NormTest`.

    Reads ``info["loss"]`` and ``info["optimizer"]``. The spread is formed as
    for :class:`NormTest` (centred where the per-sample gradients exist as a
    tensor, else within ``ULPS eps (sum_i ||g_i||^2 / N + ||g||^2)`` of its exact
    value). Missing (see :mod:`cockpit.quantities.defined`) with fewer than 2
    samples, a zero or non-finite loss, or non-finite sums.

    Raises:
        ValueError: When tracked with anything but ``torch.optim.SGD`` with
            momentum, dampening and weight decay 0, no Nesterov and one learning
            rate for all groups; the message names the setting at fault.
    """

    needs = frozenset({Need.BATCH_L2, Need.GRADIENT})
    info_keys = ("loss", "optimizer")
    Accumulator = PerParameter
    shard_local = True

    def get_lr(self, optimizer) -> float:
        """The learning rate shared by all groups (1.0.2's helper).

        Raises:
            ValueError: If the groups have different learning rates.
        """
        rates = {group["lr"] for group in optimizer.param_groups}
        if len(rates) != 1:
            raise ValueError(
                f"{self.key} needs one learning rate, found {sorted(rates)} in the "
                "optimizer's param groups."
            )
        return rates.pop()

    def prepare(self, global_step: int, info) -> None:
        """Fail before the backward pass unless the optimizer is plain SGD."""
        if info is not None and self.should_compute(global_step):
            optimizer = info.require("optimizer", self.key)
            require_plain_sgd(optimizer, self.key, single_lr=True)

    def accumulate(self, global_step: int, view: ParamView) -> None:
        """Reduce the parameter to ``sum_i ||g_i,p||^2`` and ``||g_p||^2``."""
        self.acc.entries[view.index] = squared_norm_entry(view)

    def share(self, global_step: int, ctx: TrackContext, bucket) -> None:
        """Sum the per-sample squared norms over processes."""
        share_squared_norms(self.acc, ctx, bucket, self.rows_of(ctx))

    def _compute(self, global_step: int, ctx: TrackContext) -> Deferred | Missing:
        optimizer = ctx.info.require("optimizer", self.key)
        lr = require_plain_sgd(optimizer, self.key, single_lr=True)
        loss = ctx.info.require("loss", self.key)
        spread, _, n, dtype, conditions = total_spread(self.acc, ctx.gradients())
        undefined = defined.samples(n)
        if undefined is not None:
            return undefined
        loss = defined.wide(loss)
        value = lr * (spread / n) / loss
        return defined.decided(
            value, dtype, *defined.nonfinite(loss), (loss == 0, ZERO_LOSS), *conditions
        )
