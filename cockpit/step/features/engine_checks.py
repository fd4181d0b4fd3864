"""After the backward pass, each engine that ran checks its own work."""

from __future__ import annotations

from cockpit.step.features.base import StepFeature, register_feature


@register_feature
class EngineChecks(StepFeature):
    """E.g. BackPACK names a layer it skipped although the quantities need it."""

    order = 35

    def after_backward(self) -> None:
        """Work after it, before tracking (see the module)."""
        run = self.run
        for engine in run.engines:
            check = getattr(engine, "after_backward", None)
            if check is not None:
                check(run)
