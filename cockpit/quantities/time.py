"""Time: wall-clock time stamps."""

from __future__ import annotations

import time

from cockpit.quantities.base import ByproductQuantity, NothingToShare, TrackContext


class Time(NothingToShare, ByproductQuantity):
    """Wall-clock time (``time.time()``, seconds since the epoch) when tracked."""

    shard_local = True  # (reads no parameter)

    def _compute(self, global_step: int, ctx: TrackContext) -> float:
        return time.time()
