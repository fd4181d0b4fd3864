"""Distance: how far the parameters have moved from where tracking began."""

from __future__ import annotations

from typing import Any

from cockpit.needs import Need
from cockpit.quantities.base import NothingToShare, SingleStepQuantity, TrackContext
from cockpit.quantities.utils_params import norms, snapshot


class Distance(NothingToShare, SingleStepQuantity):
    """``||theta_t,p - theta_0,p||_2`` per parameter tensor.

    ``theta_0`` is the parameters at the first step this quantity sees (whatever the
    schedule; cockpit-for-pytorch required that to be step 0). The snapshot costs one
    copy of the parameters and is kept for the whole run.
    """

    needs = frozenset({Need.PARAMETERS})

    def __init__(self, track_schedule, verbose=False, key=None):
        super().__init__(track_schedule, verbose=verbose, key=key)
        self._initial = None

    def is_active(self, global_step: int) -> bool:
        """Active on scheduled steps and on the very first step (for the snapshot)."""
        return self._initial is None or self.should_compute(global_step)

    def track_step(self, global_step: int, ctx: TrackContext) -> list[tuple[int, Any]]:
        """Snapshot on first sight, then report the distance on scheduled steps."""
        if self._initial is None:
            self._initial = snapshot(ctx.params)
        return super().track_step(global_step, ctx)

    def _compute(self, global_step: int, ctx: TrackContext) -> list[float]:
        return norms(
            [p.detach() - p0 for p, p0 in zip(ctx.params, self._initial, strict=True)]
        )

    def state_dict(self) -> dict[str, Any]:
        """Return the initial snapshot."""
        return {"initial": self._initial}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the initial snapshot."""
        self._initial = state.get("initial")
