"""The diagnosis' records: severities, check ids, findings and thresholds."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

import numpy as np

#: Severities, mildest first.
SEVERITIES = ("info", "warning", "error")

#: Ids of the checks, in the order they are reported.
CHECK_IDS = (
    "nonfinite",
    "step_size_too_large",
    "step_size_too_small",
    "inputs_misscaled",
    "vanishing_gradients",
    "exploding_gradients",
    "gradient_noise_dominates",
    "loss_plateau",
)

#: Id of the ``info`` finding that lists checks that could not run.
NOT_CHECKED = "not_checked"


@dataclass(frozen=True)
class Finding:
    """One thing the diagnosis found about a run.

    Attributes:
        id: Stable identifier (one of :data:`CHECK_IDS`, or :data:`NOT_CHECKED`).
        severity: ``"info"``, ``"warning"`` or ``"error"``.
        steps: ``(first, last)`` global step of the evidence.
        message: One or two sentences: what was seen.
        evidence: The values that triggered the finding and the thresholds they
            were compared with (JSON-safe: numbers, strings, lists, dicts).
        advice: What to try, as a practitioner would say it.
    """

    id: str
    severity: str
    steps: tuple[int, int]
    message: str
    evidence: Mapping[str, Any] = field(default_factory=dict)
    advice: str = ""

    def __post_init__(self):
        if self.severity not in SEVERITIES:
            raise ValueError(
                f"severity must be one of {SEVERITIES}, got {self.severity!r}."
            )
        object.__setattr__(self, "steps", (int(self.steps[0]), int(self.steps[1])))
        object.__setattr__(self, "evidence", MappingProxyType(dict(self.evidence)))

    def to_dict(self) -> dict[str, Any]:
        """Return the finding as plain JSON-safe data (``steps`` as a list)."""
        return {
            "id": self.id,
            "severity": self.severity,
            "steps": list(self.steps),
            "message": self.message,
            "evidence": _json_safe(dict(self.evidence)),
            "advice": self.advice,
        }


@dataclass(frozen=True)
class Thresholds:
    """The thresholds of the checks (chosen on the tuning runs of the benchmark).

    Attributes:
        alpha_large: Median Alpha at or above this, over the whole run or over
            its first ``start_steps`` tracked values: steps overshoot the minimum
            along the step direction (0 lands in it, 1 at the mirror point, where
            the loss is as high as before the step; runs that train best have a
            median between about 0 and 0.3).
        start_steps: How many of the first tracked values describe the start of
            a run (Alpha, the relative loss decrease per step).
        alpha_stretch: Median Alpha over ``stretch_steps`` consecutive tracked
            values at or above this, while the loss did not go down over them: a
            stretch of overshooting steps without progress.
        stretch_steps: See ``alpha_stretch``.
        loss_rise: The median of 5 consecutive tracked losses at or above this
            multiple of the median of the first 3: steps too large (error).
        progress_small: Median of ``UpdateSize * GradNorm / |Loss|`` (a first-order
            bound on the relative loss decrease per step), over the run or over its
            first ``start_steps`` (while the learning rate did not rise), below
            this: steps too small to make progress.
        edge_fraction: Fraction of individual gradient elements in the two edge
            bins of GradHist1d (beyond its range) in the first tracked steps, at or
            above this: inputs (or weights) on the wrong scale.
        edge_steps: How many of the first tracked histograms are looked at.
        layer_ratio_small: Median over the first ``layer_steps`` tracked steps of
            the ratio of the largest gradient norm among the first quarter of the
            parameter tensors (input side) to the largest among the last quarter
            (output side) below this: vanishing gradients.
        layer_steps: See ``layer_ratio_small``.
        growth: Rise of the gradient norm (the median of 5 consecutive tracked
            values over the median of the first 5) at or above this: exploding
            gradients.
        noise_fraction: Smallest running median (over a tenth of the run, at
            least 5 steps) of NormTest squared (about the share of sampling noise
            in the squared mini-batch gradient norm) at or above this: gradient
            noise dominates for the whole run.
        plateau_improvement: Relative loss improvement over the second half of the
            run below this: the loss has plateaued.
        plateau_total: The plateau is a warning if the loss also improved by less
            than this share over the whole run (else ``info``: it may have
            converged).
        plateau_rise: A loss that rose by more than this share over the second
            half is diverging, not on a plateau (see ``step_size_too_large``).
        min_steps: Fewest tracked values a whole-run check needs; a run that
            turned non-finite needs only ``min_steps_nonfinite`` finite values
            before (a blow-up leaves few).
        min_steps_nonfinite: See ``min_steps``.
    """

    alpha_large: float = 0.3
    start_steps: int = 30
    alpha_stretch: float = 1.0
    stretch_steps: int = 30
    loss_rise: float = 2.0
    progress_small: float = 1e-3
    edge_fraction: float = 0.01
    edge_steps: int = 3
    layer_ratio_small: float = 1e-3
    layer_steps: int = 10
    growth: float = 100.0
    noise_fraction: float = 0.9
    plateau_improvement: float = 0.05
    plateau_total: float = 0.2
    plateau_rise: float = 0.5
    min_steps: int = 10
    min_steps_nonfinite: int = 3


# --- helpers -------------------------
def _json_safe(value: Any) -> Any:
    """Make evidence JSON-safe: NaN/inf as strings, tuples as lists, numpy scalars."""
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value
