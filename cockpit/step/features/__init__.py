"""Step features: the concerns of a tracked step, each in its own module.

See :mod:`cockpit.step.features.base` for the interface and the registry.
"""

from cockpit.step.features import builtin  # noqa: F401  (registers the built-in ones)
from cockpit.step.features.base import (
    STOP,
    StepFeature,
    feature_classes,
    register_feature,
)

__all__ = ["STOP", "StepFeature", "feature_classes", "register_feature"]
