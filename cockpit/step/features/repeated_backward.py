"""Several backward passes inside one tracked step: no values, one warning."""

from __future__ import annotations

from cockpit.step.features.base import STOP, StepFeature, register_feature

REPEATED = (
    "several backward passes ran inside one tracked step, so the per-sample "
    "results and .grad describe different mini-batches"
)
_WARNING = (
    f"A tracked step had no values: {REPEATED}. Fix: call loss.backward() once "
    "inside `with cockpit(step, ...)`; accumulate micro-batches outside tracked "
    "steps, or track one micro-batch per optimizer step. (Recorded under "
    "'missing'; warned once.)"
)


@register_feature
class RepeatedBackward(StepFeature):
    """Per-sample results of one backward pass and ``.grad`` of several: stop."""

    order = 10

    def after_backward(self) -> str | None:
        """Work after it, before tracking (see the module)."""
        run = self.run
        if not run.dispatcher.repeated:
            return None
        run.ledger.leave_out(list(run.plan.active), REPEATED, once=False)
        run.diagnostics.warn_once("repeated-backward", _WARNING)
        return STOP
