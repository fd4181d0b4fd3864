"""Distance: how far the parameters have moved from where tracking began."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from cockpit.distributed.rows import foreign_reason, is_foreign, squared_norms
from cockpit.needs import Need
from cockpit.quantities.base import Missing, SingleStepQuantity, TrackContext
from cockpit.quantities.utils_params import norms, snapshot


@dataclass
class RowSquares:
    """``||theta_p - theta_0,p||^2`` per parameter over every process's rows.

    And whether a process's kept rows were another's (FSDP2).
    """

    squares: Tensor | None = None
    foreign: bool = False


def share_row_distances(rows, start, owner, acc, bucket) -> None:
    """FSDP2: sum the squares of ``rows.params - start`` over the processes.

    ``start`` is a process's rows kept with ``owner``; where it is another
    process's (:func:`~cockpit.distributed.rows.is_foreign`) the process adds
    zeros and says so, so that every process records the value missing alike.
    """
    foreign = is_foreign(owner, rows)
    count, device = len(rows.params), rows.device
    if foreign:
        squares = torch.zeros(count, dtype=torch.float64, device=device)
    else:
        squares = squared_norms(
            [p - p0 for p, p0 in zip(rows.params, start, strict=True)]
        )
    flags = torch.tensor([float(foreign)], dtype=torch.float64, device=device)

    def then(total):
        acc.squares, acc.foreign = total[:count], bool(total[count] > 0)

    bucket.sum(torch.cat([squares.to(device), flags]), then)


def row_distances(acc: RowSquares, key: str) -> Tensor | list | Missing:
    """The distances of :func:`share_row_distances` (or missing, with the fix)."""
    if acc.foreign:
        return Missing(foreign_reason(key))
    return acc.squares.sqrt() if len(acc.squares) else []


class Distance(SingleStepQuantity):
    """``||theta_t,p - theta_0,p||_2`` per parameter tensor.

    ``theta_0`` is the parameters at the first step this quantity sees (whatever the
    schedule; cockpit-for-pytorch required that to be step 0). The snapshot costs one
    copy of the parameters and is kept for the whole run; on a ``fully_shard``
    model each process keeps its rows and adds its rows' squares.
    """

    needs = frozenset({Need.PARAMETERS})
    Accumulator = RowSquares
    shard_local = True

    def __init__(self, track_schedule, verbose=False, key=None):
        super().__init__(track_schedule, verbose=verbose, key=key)
        self._initial = None
        #: Whose rows the snapshot is (FSDP2; ``None``: the full parameters).
        self._owner = None

    def is_active(self, global_step: int) -> bool:
        """Active on scheduled steps and on the very first step (for the snapshot)."""
        return self._initial is None or self.should_compute(global_step)

    def share(self, global_step: int, ctx: TrackContext, bucket) -> None:
        """FSDP2: snapshot this process's rows on first sight; sum the squares."""
        rows = self.rows_of(ctx)
        if rows is None:
            return
        if self._initial is None:
            self._initial, self._owner = snapshot(rows.params), rows.owner
        elif self._owner is None and [p.numel() for p in self._initial] == [
            p.numel() for p in rows.sharding.params
        ]:  # a snapshot of the full parameters (one process, DDP): its rows
            self._initial = [
                rows.take(i, p0).clone() for i, p0 in enumerate(self._initial)
            ]
            self._owner = rows.owner
        if self.should_compute(global_step):
            share_row_distances(rows, self._initial, self._owner, self.acc, bucket)

    def track_step(self, global_step: int, ctx: TrackContext) -> list[tuple[int, Any]]:
        """Snapshot on first sight, then report the distance on scheduled steps."""
        if self._initial is None:
            self._initial = snapshot(ctx.params)
        return super().track_step(global_step, ctx)

    def _compute(self, global_step: int, ctx: TrackContext) -> list[float] | Missing:
        if self.acc is not None and self.acc.squares is not None:
            return row_distances(self.acc, self.key)
        if self._owner is not None:  # rows of a fully_shard run
            return Missing(foreign_reason(self.key))
        return norms(
            [p.detach() - p0 for p, p0 in zip(ctx.params, self._initial, strict=True)]
        )

    def state_dict(self) -> dict[str, Any]:
        """Return the initial snapshot (and, on FSDP2, whose rows it is)."""
        if self._owner is None:
            return {"initial": self._initial}
        return {"initial": self._initial, "owner": self._owner}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the initial snapshot."""
        self._initial = state.get("initial")
        self._owner = state.get("owner")
