"""Step features: the concerns of a tracked step, each in its own module.

:class:`~cockpit.step.run.StepRun` is a short template (open, backward, close,
track); everything else a step does is a *feature* that it runs at fixed points:

* :meth:`StepFeature.before_backward`: after the quantities began the step and the
  engines that need the forward graph ran, before the user's ``loss.backward()``;
* :meth:`StepFeature.after_backward`: after it, before any quantity is tracked
  (return :data:`STOP` to end the step without tracking);
* :meth:`StepFeature.close`: always, when the step ends (hooks, buffers).

A new feature is a new file: subclass :class:`StepFeature` and decorate it with
:func:`register_feature`. The built-in ones (:mod:`cockpit.step.features.builtin`)
are registered when the package is imported; yours when your code imports it.
"""

from __future__ import annotations

from typing import ClassVar

#: Returned by :meth:`StepFeature.after_backward` to end the step untracked.
STOP = "stop"

_REGISTRY: list[tuple[float, type]] = []


class StepFeature:
    """One concern of a tracked step (see the module's docstring).

    Args:
        run: The step (:class:`~cockpit.step.run.StepRun`).
    """

    #: Position among the features (lower runs first, at every point).
    order: ClassVar[float] = 0.0

    def __init__(self, run):
        self.run = run

    @classmethod
    def applies(cls, run) -> bool:
        """Whether the feature has work at this step (default: always)."""
        return True

    def before_backward(self) -> None:  # noqa: B027
        """Work before the user's backward pass."""

    def after_backward(self) -> str | None:  # noqa: B027
        """Work after it, before tracking (``STOP``: track nothing)."""

    def close(self) -> None:  # noqa: B027
        """Clean up, whatever happened."""


def register_feature(cls: type[StepFeature]) -> type[StepFeature]:
    """Class decorator: run this feature at every tracked step (by its ``order``)."""
    _REGISTRY[:] = [entry for entry in _REGISTRY if entry[1] is not cls]
    _REGISTRY.append((cls.order, cls))
    _REGISTRY.sort(key=lambda entry: entry[0])
    return cls


def feature_classes() -> list[type[StepFeature]]:
    """The registered features, in order."""
    return [cls for _, cls in _REGISTRY]
