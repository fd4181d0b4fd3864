"""Step features: the concerns of a tracked step, each in its own module.

:class:`~cockpit.step.run.StepRun` is a short template (open, backward, close,
track); everything else a step does is a *feature* that it runs at fixed points.
A feature reads the step's :class:`~cockpit.step.state.StepState` (``self.state``,
read-only) and returns what it produces as a :class:`~cockpit.step.state.Produced`
(or ``None``), which the step folds into what it has and hands on:

* :meth:`StepFeature.begin`: when the step opens, before the quantities begin it;
* :meth:`StepFeature.before_backward`: after the quantities began the step and the
  engines that need the forward graph ran, before the user's ``loss.backward()``;
* :meth:`StepFeature.after_backward`: after it, before any quantity is tracked,
  with what the step has so far (return :data:`STOP` to end the step untracked);
* :meth:`StepFeature.close`: always, when the step ends (hooks, buffers).

A new feature is a new file: subclass :class:`StepFeature` and decorate it with
:func:`register_feature`. The built-in ones (:mod:`cockpit.step.features.builtin`)
are registered when the package is imported; yours when your code imports it.
"""

from __future__ import annotations

from typing import ClassVar

from cockpit.step.state import Produced, StepState

#: Returned by :meth:`StepFeature.after_backward` to end the step untracked.
STOP = Produced(stop=True)

_REGISTRY: list[tuple[float, type]] = []


class StepFeature:
    """One concern of a tracked step (see the module's docstring).

    Args:
        state: The step (read-only).
    """

    #: Position among the features (lower runs first, at every point).
    order: ClassVar[float] = 0.0
    #: What must hold for the feature to run, as data: names of attributes of the
    #: :class:`~cockpit.step.state.StepState` (dotted, e.g. ``"plan.estimated"``)
    #: that must be true at the step; then :meth:`applies` is asked, if defined.
    only_if: ClassVar[tuple[str, ...]] = ()
    #: The points the class defines (set when it is registered): the step calls a
    #: feature only where it has work.
    _phases: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, state: StepState):
        self.state = state

    @classmethod
    def applies(cls, state: StepState) -> bool:
        """Whether the feature has work at this step (default: always)."""
        return True

    def begin(self) -> Produced | None:
        """Work when the step opens, before the quantities begin it."""
        return None

    def before_backward(self) -> Produced | None:
        """Work before the user's backward pass."""
        return None

    def after_backward(self, produced: Produced) -> Produced | None:
        """Work after it, before tracking (``STOP``: track nothing).

        Args:
            produced: What the step has so far (the features before this one).
        """
        return None

    def close(self) -> None:  # noqa: B027
        """Clean up, whatever happened."""


#: The points of a step at which a feature can work (its methods of these names).
PHASES = ("applies", "begin", "before_backward", "after_backward", "close")


def register_feature(cls: type[StepFeature]) -> type[StepFeature]:
    """Class decorator: run this feature at every tracked step (by its ``order``)."""
    cls._phases = frozenset(name for name in PHASES if _defines(cls, name))
    _REGISTRY[:] = [entry for entry in _REGISTRY if entry[1] is not cls]
    _REGISTRY.append((cls.order, cls))
    _REGISTRY.sort(key=lambda entry: entry[0])
    return cls


def _defines(cls: type, name: str) -> bool:
    """Whether ``cls`` has its own ``name`` (not :class:`StepFeature`'s)."""
    for klass in cls.__mro__:
        if klass is StepFeature:
            return False
        if name in klass.__dict__:
            return True
    return False


def features_for(state: StepState) -> list[StepFeature]:
    """The registered features with work at this step, made, in order.

    (Plain loops: the step's trace stays short, ``benchmarks/step_trace.py``.)
    """
    made = []
    for _, cls in _REGISTRY:
        runs = True
        for path in cls.only_if:
            value = state
            for name in path.split("."):
                value = getattr(value, name)
            if not value:
                runs = False
                break
        if runs and ("applies" not in cls._phases or cls.applies(state)):
            made.append(cls(state))
    return made


def feature_classes() -> list[type[StepFeature]]:
    """The registered features, in order."""
    return [cls for _, cls in _REGISTRY]
