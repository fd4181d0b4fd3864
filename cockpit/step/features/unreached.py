"""Parameters no engine reached: unused ones read as exact zeros, others fail."""

from __future__ import annotations

from cockpit.step.features.base import StepFeature, register_feature


@register_feature
class Unreached(StepFeature):
    """Show unused parameters with zero results; name unextended modules."""

    order = 40

    def before_backward(self) -> None:
        """Work before the user's backward pass (see the module)."""
        params = self.run.params
        self._before = [
            (p.grad, p.grad._version if p.grad is not None else None) for p in params
        ]

    def after_backward(self) -> None:
        """Work after it, before tracking (see the module)."""
        run = self.run
        unused = run.diagnostics.unreached(run.plan, run.dispatcher, self._before)
        batch_size = run.dispatcher.batch_size
        if batch_size is None and run.info.has("batch_size"):
            batch_size = int(run.info.get("batch_size"))
        for index in unused:
            results = run.zero_results(index, batch_size)
            run.dispatcher.show(index, run.params[index], results)
