"""UpdateSize: the length of the optimizer's update, per parameter tensor."""

from __future__ import annotations

from typing import Any

from cockpit.distributed.rows import foreign_reason
from cockpit.needs import Need
from cockpit.quantities.base import Missing, TrackContext, TwoStepQuantity
from cockpit.quantities.distance import (
    RowSquares,
    row_distances,
    share_row_distances,
)
from cockpit.quantities.utils_params import norms, snapshot


class UpdateSize(TwoStepQuantity):
    """``||theta_{t+1},p - theta_t,p||_2`` per parameter tensor, stored under ``t``.

    ``theta_t`` is read when the cockpit context of step ``t`` is left (after the
    backward, before ``optimizer.step()``), so the value is the size of the step the
    optimizer took at ``t``. It needs step ``t + 1`` to pass through the cockpit.
    On a ``fully_shard`` model each process keeps its rows of ``theta_t`` and adds
    its rows' squares.
    """

    needs = frozenset({Need.PARAMETERS})
    Accumulator = RowSquares
    shard_local = True
    #: As in 1.0.2: the value computed at step ``t + 1`` is stored under ``t``.
    SAVE_SHIFT = 1

    def share(self, global_step: int, ctx: TrackContext, bucket) -> None:
        """FSDP2: at an end, sum the squares of the rows' change."""
        rows = self.rows_of(ctx)
        if rows is not None and self.finishes(global_step):
            start = self._pending[global_step - 1]
            if isinstance(start, dict):  # rows, with whose they are
                kept, owner = start["rows"], start["owner"]
            elif [p.numel() for p in start] == [
                p.numel() for p in rows.sharding.params
            ]:  # the full parameters (a run without fully_shard): their rows
                kept = [rows.take(i, p).clone() for i, p in enumerate(start)]
                owner = rows.owner
            else:
                kept, owner = None, None
            share_row_distances(rows, kept, owner, self.acc, bucket)

    def _compute_start(self, global_step: int, ctx: TrackContext) -> Any:
        rows = self.rows_of(ctx)
        if rows is not None:
            return {"rows": snapshot(rows.params), "owner": rows.owner}
        return snapshot(ctx.params)

    def _compute_end(self, global_step, ctx, state) -> list[float] | Missing:
        if self.acc is not None and self.acc.squares is not None:
            return row_distances(self.acc, self.key)
        if isinstance(state, dict):  # rows of a fully_shard run
            return Missing(foreign_reason(self.key))
        return norms([p.detach() - p0 for p, p0 in zip(ctx.params, state, strict=True)])
