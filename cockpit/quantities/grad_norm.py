"""GradNorm: the norm of the mini-batch gradient, per parameter tensor."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from cockpit.distributed.rows import squared_norms
from cockpit.needs import Need
from cockpit.quantities.base import ByproductQuantity, TrackContext
from cockpit.quantities.utils_params import norms


@dataclass
class _Squares:
    """``||g_p||^2`` per parameter, summed over the processes' rows (FSDP2)."""

    squares: Tensor | None = None


class GradNorm(ByproductQuantity):
    """``||g_p||_2`` for every parameter tensor ``p``, read from ``.grad``.

    The total gradient norm is ``sqrt(sum_p ||g_p||^2)``. On a ``fully_shard``
    model each process adds the squares of its rows of the joined gradient.
    """

    needs = frozenset({Need.GRADIENT})
    Accumulator = _Squares
    shard_local = True

    def share(self, global_step: int, ctx: TrackContext, bucket) -> None:
        """FSDP2: sum each process's rows' squares (else nothing to add)."""
        rows = self.rows_of(ctx)
        if rows is not None:
            squares = squared_norms(rows.grads)
            bucket.sum(squares, lambda v: setattr(self.acc, "squares", v))

    def _compute(self, global_step: int, ctx: TrackContext) -> list[float]:
        if self.acc is not None and self.acc.squares is not None:
            return self.acc.squares.sqrt() if len(self.acc.squares) else []
        return norms(ctx.gradients())
