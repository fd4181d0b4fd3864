"""Parameters: raw parameter values (large; meant for small models)."""

from __future__ import annotations

from cockpit.needs import Need
from cockpit.quantities.base import ByproductQuantity, NothingToShare, TrackContext


class Parameters(NothingToShare, ByproductQuantity):
    """All parameter values, one nested list per parameter tensor.

    The log grows by the model size at every tracked step; use a sparse schedule.
    """

    needs = frozenset({Need.PARAMETERS})

    def _compute(self, global_step: int, ctx: TrackContext) -> list:
        return [p.detach().cpu().tolist() for p in ctx.params]
