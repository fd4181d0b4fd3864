"""Ready-made sets of quantities: ``economy``, ``business`` and ``full``.

* ``economy``: Alpha, Distance, GradHist1d, GradNorm, InnerTest, Loss, NormTest,
  OrthoTest, UpdateSize (first-order; per-sample gradients).
* ``business``: economy + TICDiag, HessTrace (adds the Hessian diagonal).
* ``full``: business + HessMaxEV, GradHist2d (adds ``create_graph`` and
  Hessian-vector products).
"""

from __future__ import annotations

from typing import Callable

from cockpit import quantities as q
from cockpit.quantities.base import Quantity
from cockpit.utils.schedules import linear

_ECONOMY = (
    q.Alpha,
    q.Distance,
    q.GradHist1d,
    q.GradNorm,
    q.InnerTest,
    q.Loss,
    q.NormTest,
    q.OrthoTest,
    q.UpdateSize,
)
_BUSINESS = _ECONOMY + (q.TICDiag, q.HessTrace)
_FULL = _BUSINESS + (q.HessMaxEV, q.GradHist2d)

CONFIGURATIONS: dict[str, tuple[type[Quantity], ...]] = {
    "economy": _ECONOMY,
    "business": _BUSINESS,
    "full": _FULL,
}


class UnknownConfigurationError(KeyError, ValueError):
    """An unknown configuration label (a ``KeyError`` as in cockpit-for-pytorch)."""

    def __str__(self) -> str:
        return str(self.args[0])


def quantities_cls_for_configuration(label: str) -> list[type[Quantity]]:
    """Return the quantity classes of a configuration.

    Args:
        label: ``"economy"``, ``"business"`` or ``"full"``.

    Returns:
        The classes, in a fixed order.

    Raises:
        UnknownConfigurationError: For an unknown label (lists the valid ones).
    """
    try:
        return list(CONFIGURATIONS[label])
    except (KeyError, TypeError):
        valid = ", ".join(repr(k) for k in CONFIGURATIONS)
        raise UnknownConfigurationError(
            f"Unknown configuration {label!r}. Choose one of {valid}."
        ) from None


def configuration(
    label: str,
    track_schedule: Callable[[int], bool] | None = None,
    verbose: bool = False,
) -> list[Quantity]:
    """Instantiate every quantity of a configuration with one shared schedule.

    Args:
        label: ``"economy"``, ``"business"`` or ``"full"``.
        track_schedule: When to track; defaults to every step (``linear(1)``).
        verbose: Passed to every quantity.

    Returns:
        Quantity instances, ready for ``Cockpit(params, quantities=...)``.
    """
    classes = quantities_cls_for_configuration(label)
    schedule = linear(1) if track_schedule is None else track_schedule
    return [cls(schedule, verbose=verbose) for cls in classes]
