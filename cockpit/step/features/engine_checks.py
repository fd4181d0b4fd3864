"""After the backward pass, each engine that ran checks its own work."""

from __future__ import annotations

from cockpit.step.features.base import StepFeature, register_feature


@register_feature
class EngineChecks(StepFeature):
    """E.g. BackPACK names a layer it skipped although the quantities need it."""

    order = 35

    def after_backward(self, produced) -> None:
        """Work after it, before tracking (see the module)."""
        for engine in self.state.engines:
            engine.after_backward(self.state.engine)
