"""Loss: the mini-batch loss."""

from __future__ import annotations

from cockpit.quantities.base import ByproductQuantity, NothingToShare, TrackContext


class Loss(NothingToShare, ByproductQuantity):
    """The mean-reduced mini-batch loss ``L`` as a float (reads ``info['loss']``)."""

    info_keys = ("loss",)
    shard_local = True  # (reads no parameter)

    def _compute(self, global_step: int, ctx: TrackContext) -> float:
        loss = ctx.info.require("loss", self.key)
        return loss.detach() if hasattr(loss, "detach") else float(loss)
