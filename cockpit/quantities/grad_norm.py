"""GradNorm: the norm of the mini-batch gradient, per parameter tensor."""

from __future__ import annotations

from cockpit.needs import Need
from cockpit.quantities.base import ByproductQuantity, NothingToShare, TrackContext
from cockpit.quantities.utils_params import norms


class GradNorm(NothingToShare, ByproductQuantity):
    """``||g_p||_2`` for every parameter tensor ``p``, read from ``.grad``.

    The total gradient norm is ``sqrt(sum_p ||g_p||^2)``.
    """

    needs = frozenset({Need.GRADIENT})

    def _compute(self, global_step: int, ctx: TrackContext) -> list[float]:
        return norms(ctx.gradients())
