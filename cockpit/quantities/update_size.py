"""UpdateSize: the length of the optimizer's update, per parameter tensor."""

from __future__ import annotations

from torch import Tensor

from cockpit.needs import Need
from cockpit.quantities.base import NothingToShare, TrackContext, TwoStepQuantity
from cockpit.quantities.utils_params import norms, snapshot


class UpdateSize(NothingToShare, TwoStepQuantity):
    """``||theta_{t+1},p - theta_t,p||_2`` per parameter tensor, stored under ``t``.

    ``theta_t`` is read when the cockpit context of step ``t`` is left (after the
    backward, before ``optimizer.step()``), so the value is the size of the step the
    optimizer took at ``t``. It needs step ``t + 1`` to pass through the cockpit.
    """

    needs = frozenset({Need.PARAMETERS})
    #: As in 1.0.2: the value computed at step ``t + 1`` is stored under ``t``.
    SAVE_SHIFT = 1

    def _compute_start(self, global_step: int, ctx: TrackContext) -> list[Tensor]:
        return snapshot(ctx.params)

    def _compute_end(self, global_step, ctx, state: list[Tensor]) -> list[float]:
        return norms([p.detach() - p0 for p, p0 in zip(ctx.params, state, strict=True)])
