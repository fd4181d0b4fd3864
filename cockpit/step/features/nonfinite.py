"""Non-finite loss or gradients: recorded under ``nonfinite``, training goes on.

On such a step a quantity that fails is recorded as missing (with the reason)
instead of stopping the training loop.
"""

from __future__ import annotations

from cockpit.log.keys import NONFINITE_KEY
from cockpit.step.features.base import StepFeature, register_feature


@register_feature
class NonFinite(StepFeature):
    """Check the loss and gradients once; make the step tolerant if not finite."""

    order = 20

    def after_backward(self) -> None:
        """Work after it, before tracking (see the module)."""
        run = self.run
        found = run.diagnostics.nonfinite(run.info)
        if found:
            run.recorder.record(run.step, NONFINITE_KEY, found)
            run.tolerant = True


def failed_reason(step: int, error: Exception) -> str:
    """Why a quantity that failed on the non-finite ``step`` has no value."""
    return (
        f"it failed on the non-finite step {step} ({type(error).__name__}: "
        f"{error}); training goes on. Fix: see the warning about non-finite values"
    )
