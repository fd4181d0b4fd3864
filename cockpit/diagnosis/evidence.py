"""What the streaming detectors and the whole-run checks share: outcomes, advice."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from cockpit.diagnosis.findings import Finding, Thresholds
from cockpit.diagnosis.running_median import running_median
from cockpit.diagnosis.signals import Signals


# --- shared pieces -------------------------
@dataclass(frozen=True)
class _Outcome:
    """What one whole-run check returned: a finding, or why it could not run."""

    finding: Finding | None = None
    missing: str | None = None


def _span(steps) -> tuple[int, int]:
    return (int(steps[0]), int(steps[-1])) if len(steps) else (0, 0)


def _round(value: float, digits: int = 4) -> float | None:
    if value is None or not math.isfinite(value):
        return None if value is None or math.isnan(value) else value
    if value == 0:
        return 0.0
    return float(f"{value:.{digits}g}")


def _lr_text(lrs: Sequence[float], evidence: dict[str, Any]) -> str:
    """Add learning rates to the evidence; return them as text ("" if none)."""
    finite = [float(v) for v in lrs if math.isfinite(v)]
    if finite:
        lo, hi = min(finite), max(finite)
        evidence["learning_rate"] = _round(hi) if lo == hi else [_round(lo), _round(hi)]
        return f"{lo:.3g}" if lo == hi else f"{lo:.3g} to {hi:.3g}"
    evidence["learning_rate"] = "not logged (pass the optimizer in info)"
    return ""


def _lr_note(signals: Signals, evidence: dict[str, Any]) -> str:
    """The run's learning rate (``Cockpit.log``'s, else the groups' largest)."""
    for signal in ("learning_rate", "learning_rates"):
        _, lrs = signals.series(signal)
        if lrs.size:
            return _lr_text(lrs, evidence)
    return _lr_text([], evidence)


def _window(n: int) -> int:
    return max(5, n // 10)


def _went_nonfinite(signals: Signals) -> bool:
    if signals.has("nonfinite"):
        return True
    _, loss = signals.series("loss")
    return bool(np.any(~np.isfinite(loss)))


def _fewest(signals: Signals, th: Thresholds) -> int:
    """Fewest values a check needs (fewer if the run blew up)."""
    return th.min_steps_nonfinite if _went_nonfinite(signals) else th.min_steps


def _finite(steps: np.ndarray, values: np.ndarray):
    keep = np.isfinite(values)
    return steps[keep], values[keep]


def _running_median(values: np.ndarray, width: int) -> np.ndarray:
    # linear in the run's length (numpy's median of every window copies them all)
    return running_median(values, width)


def _finding(check_id: str, severity: str, steps, message: str, evidence, advice):
    return Finding(check_id, severity, _span(steps), message, evidence, advice)


_ADVICE = {
    "nonfinite": (
        "Lower the learning rate (a factor of 10 is a good first try), clip the "
        "gradient norm (torch.nn.utils.clip_grad_norm_), and check the data and the "
        "loss for NaN, log(0) or division by zero. If the gradient norm grew before "
        "the first non-finite step, see exploding_gradients."
    ),
    "step_size_too_large": (
        "Lower the learning rate, by a factor of 3 to 10 to start with, or add a "
        "warm-up; runs with a median Alpha slightly above 0 (about 0 to 0.3) "
        "train best (Cockpit paper, Fig. 5)."
    ),
    "step_size_too_small": (
        "Raise the learning rate (try 10x, then bisect; Alpha slightly above 0 is a "
        "good target), check that a scheduler has not decayed it to nearly 0 and that "
        "the optimizer holds all parameters."
    ),
    "inputs_misscaled": (
        "Standardise the inputs (subtract the mean, divide by the standard deviation "
        "of the training set; for images e.g. divide by 255 and normalise per "
        "channel). If they are standardised, check the weight initialisation."
    ),
    "vanishing_gradients": (
        "Use non-saturating activations (ReLU, GELU) instead of sigmoid or tanh in "
        "deep stacks, an initialisation matched to the activation (He/Kaiming for "
        "ReLU), normalisation layers or residual connections; check for dead ReLUs "
        "(a first layer with exactly zero gradient)."
    ),
    "exploding_gradients": (
        "Clip the gradient norm (torch.nn.utils.clip_grad_norm_), lower the learning "
        "rate, and for deep or recurrent networks use an initialisation that keeps "
        "the scale across layers, normalisation layers or residual connections."
    ),
    "gradient_noise_dominates": (
        "Increase the batch size (or accumulate gradients over several batches), "
        "lower the learning rate or decay it; if the batch is already large, check "
        "the labels for noise (shuffled or wrong targets)."
    ),
}

_ALPHA_MEANING = (
    "Alpha 0 lands in the minimum along the step, +1 at the point of equal height "
    "on the other side"
)
