"""A quantity that failed while reading the backward pass's results.

Errors inside the backward pass are kept (:class:`Guarded`) instead of aborting
the user's ``loss.backward()``; after it, a finite step re-raises the first (a bug),
and a non-finite step records the quantity as missing with the reason.
"""

from __future__ import annotations

from cockpit.quantities.base import Quantity
from cockpit.step.features.base import StepFeature, register_feature
from cockpit.step.features.nonfinite import failed_reason


class Guarded:
    """Runs a quantity's ``accumulate`` and keeps its first error for later."""

    __slots__ = ("quantity", "error")

    def __init__(self, quantity: Quantity):
        self.quantity = quantity
        self.error: Exception | None = None

    def accumulate(self, global_step: int, view) -> None:
        """Read one parameter's results; keep the first error."""
        if self.error is not None:
            return
        try:
            self.quantity.accumulate(global_step, view)
        except Exception as error:  # re-raised after the backward
            self.error = error


@register_feature
class Failures(StepFeature):
    """Raise the first failure of a finite step; leave out those of others."""

    order = 50

    def after_backward(self) -> None:
        """Work after it, before tracking (see the module)."""
        run = self.run
        failed = [
            g
            for g in run.guards
            if g.error is not None and not run.ledger.out(g.quantity)
        ]
        if failed and not run.tolerant:
            raise failed[0].error
        for guard in failed:
            run.ledger.leave_out(
                guard.quantity,
                failed_reason(run.step, guard.error),
                once=("dropped", guard.quantity.key),
            )
