"""Parameters no engine reached: unused ones read as exact zeros, others fail."""

from __future__ import annotations

from cockpit.engines.base import zero_results
from cockpit.step.features.base import StepFeature, register_feature


@register_feature
class Unreached(StepFeature):
    """Show unused parameters with zero results; name unextended modules."""

    order = 40

    def before_backward(self) -> None:
        """Work before the user's backward pass (see the module)."""
        params = self.state.params
        self._before = [
            (p.grad, p.grad._version if p.grad is not None else None) for p in params
        ]

    def after_backward(self, produced) -> None:
        """Work after it, before tracking (see the module)."""
        state = self.state
        unused = state.checks.unreached(state.plan, state.dispatcher, self._before)
        batch_size = state.dispatcher.batch_size
        if batch_size is None and state.info.has("batch_size"):
            batch_size = int(state.info.get("batch_size"))
        for index in unused:
            results = zero_results(state.engines, index, batch_size)
            state.dispatcher.show(index, state.params[index], results)
