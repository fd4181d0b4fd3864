"""Diagnosis: what is wrong with a run, read off the quantities cockpit tracked.

Each check reads a few per-step signals (loss, Alpha, gradient norms, the gradient
element histogram, the norm test, update sizes) and turns what it sees into a
:class:`Finding`: a stable id, a severity, the step range, the values that triggered
it together with the threshold, and the advice a practitioner would give. Text,
Markdown and JSON (:mod:`cockpit.diagnosis.report`) are renderings of the same records.

Checks and the signals they read (all part of the ``economy`` configuration, plus
the ``nonfinite`` records of the Cockpit and the learning rates it records, used as
evidence and to see a warm-up):

============================  =====================================================
id                            reads
============================  =====================================================
``nonfinite``                 ``nonfinite`` records, Loss
``step_size_too_large``       Alpha, Loss
``step_size_too_small``       UpdateSize, GradNorm, Loss (Alpha as a cross-check)
``inputs_misscaled``          GradHist1d (first tracked steps)
``vanishing_gradients``       GradNorm (per parameter; at least 4 tensors)
``exploding_gradients``       GradNorm
``gradient_noise_dominates``  NormTest
``loss_plateau``              Loss
============================  =====================================================

Two kinds of evidence, so that the live diagnosis never says what the report of the
whole run takes back:

* **settled** evidence is a closed stretch of steps that later steps cannot undo: a
  non-finite value, the loss at twice its starting level, the gradient norm grown
  a hundredfold, the first tracked steps (inputs on the wrong scale, vanishing
  gradients, steps far too large or too small from the start), a stretch of
  overshooting steps without progress. Streaming detectors with bounded memory
  find it; the live diagnosis (:class:`LiveDiagnosis`) warns about these only.
* **whole-run** evidence holds only once the run is over: medians over the run,
  "noise dominates throughout", "the loss has stopped improving". Only the report
  of a finished run (:func:`diagnose`, ``cockpit report``) reads it.

The report replays the same detectors over the whole history, so every finding
the live diagnosis announced is in the report too; it may hold more.

A check whose signals were not tracked (or hold too few steps) does not guess: the
result then holds one ``info`` finding with id ``not_checked`` that names the
checks and what they miss.

The thresholds (:class:`Thresholds`) were chosen on one set of runs and validated
on another (``python -m benchmarks.diagnosis_validation``; ``docs/diagnosis.md``).
"""

from __future__ import annotations

import math
import os
import sys
import warnings
from collections import deque
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from cockpit.diagnosis.running_median import running_median
from cockpit.errors import CockpitWarning
from cockpit.history import History, to_builtin
from cockpit.log.files import open_log
from cockpit.log.keys import LEARNING_RATES_KEY, NONFINITE_KEY

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


# --- per-step signals -------------------------
def _float(value: Any) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _largest(value: Any) -> float | None:
    """The largest of a list of numbers (the learning rates of the groups)."""
    try:
        array = np.asarray(value, dtype=np.float64).reshape(-1)
    except (TypeError, ValueError):
        return None
    return float(np.max(array)) if array.size else None


def _total_norm(value: Any) -> float | None:
    """Root sum of squares of a per-parameter list (or a scalar)."""
    try:
        array = np.asarray(value, dtype=np.float64).reshape(-1)
    except (TypeError, ValueError):
        return None
    if array.size == 0:
        return None
    with np.errstate(over="ignore", invalid="ignore"):
        return float(np.sqrt(np.sum(array * array)))


def _layer_ratio(value: Any) -> float | None:
    """Largest gradient norm of the first quarter of the tensors over the last's.

    A quarter is at least two tensors (four at least are needed). The largest
    norm of each end, not the first and last tensors alone: a transformer's first
    tensors can be a query and key whose gradients are tiny at initialisation
    (uniform attention) while the value and embedding gradients next to them are
    not; gradients vanish when every tensor near the input has a small one.
    """
    try:
        array = np.asarray(value, dtype=np.float64).reshape(-1)
    except (TypeError, ValueError):
        return None
    if array.size < 4 or not np.all(np.isfinite(array)):
        return None
    quarter = max(2, array.size // 4)
    first, last = float(np.max(array[:quarter])), float(np.max(array[-quarter:]))
    if last <= 0:
        return None
    return first / last


def _edge_fraction(value: Any) -> float | None:
    """Share of histogram counts in the two outer bins."""
    if not isinstance(value, Mapping) or "hist" not in value:
        return None
    try:
        hist = np.asarray(value["hist"], dtype=np.float64).reshape(-1)
    except (TypeError, ValueError):
        return None
    total = float(np.sum(hist))
    if hist.size < 3 or not math.isfinite(total) or total <= 0:
        return None
    return float((hist[0] + hist[-1]) / total)


_EXTRACT: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "loss": ("Loss", _float),
    "alpha": ("Alpha", _float),
    "grad_norm": ("GradNorm", _total_norm),
    "layer_ratio": ("GradNorm", _layer_ratio),
    "update_size": ("UpdateSize", _total_norm),
    "edge_fraction": ("GradHist1d", _edge_fraction),
    "norm_test": ("NormTest", _float),
    "inner_test": ("InnerTest", _float),
    "ortho_test": ("OrthoTest", _float),
    "learning_rate": ("learning_rate", _float),
    "learning_rates": (LEARNING_RATES_KEY, _largest),
    "nonfinite": (NONFINITE_KEY, lambda v: [str(x) for x in (v or [])] or None),
}


def step_signals(values: Mapping[str, Any]) -> dict[str, Any]:
    """Reduce the values recorded for one step to the scalars the checks read.

    Args:
        values: ``{key: value}`` of one step (history entries, plain or numpy).

    Returns:
        ``{signal: value}`` for the signals whose keys are present (floats; a list
        of strings for ``nonfinite``).
    """
    out: dict[str, Any] = {}
    for signal, (key, extract) in _EXTRACT.items():
        if key in values:
            value = values[key]
            if not isinstance(value, (float, int, np.ndarray)):
                try:  # tensors (also on a GPU), lists and dicts of them
                    value = to_builtin(value)
                except TypeError:
                    continue
            result = extract(value)
            if result is not None:
                out[signal] = result
    return out


class Signals:
    """Per-signal ``(steps, values)`` series, built step by step."""

    def __init__(self):
        self.steps: dict[str, list[int]] = {}
        self.values: dict[str, list[Any]] = {}
        self.keys: set[str] = set()

    def add(self, global_step: int, values: Mapping[str, Any]) -> None:
        """Add the signals of one step's recorded values."""
        self.keys.update(values)
        for signal, value in step_signals(values).items():
            self.steps.setdefault(signal, []).append(int(global_step))
            self.values.setdefault(signal, []).append(value)

    def series(self, signal: str) -> tuple[np.ndarray, np.ndarray]:
        """Steps (int) and values (float64) of a numeric signal, in step order."""
        steps = np.asarray(self.steps.get(signal, []), dtype=np.int64)
        values = np.asarray(self.values.get(signal, []), dtype=np.float64)
        order = np.argsort(steps, kind="stable")
        return steps[order], values[order]

    def has(self, signal: str) -> bool:
        """Whether at least one value of ``signal`` was seen."""
        return bool(self.steps.get(signal))


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


# --- settled evidence: streaming detectors -------------------------
class _Detector:
    """Finds one kind of settled evidence in a stream of per-step signals.

    Steps are fed in order (:meth:`add`); a signal's values arrive in step order,
    though a value may come with a later call than the step's other values (Alpha
    and UpdateSize belong to the step before the one that records them). Memory
    is bounded: a few values of the first steps and a window of the latest.
    Once found, the evidence is final: no later step can undo it.
    """

    check_id = ""

    def __init__(self, th: Thresholds):
        self.th = th
        self.finding: Finding | None = None

    def add(self, step: int, signals: Mapping[str, Any]) -> Finding | None:
        """Take one step's signals; return the finding the first time it is made."""
        if self.finding is not None:
            return None
        self.finding = self._add(step, signals)
        return self.finding

    def _add(self, step: int, signals: Mapping[str, Any]) -> Finding | None:
        raise NotImplementedError


class _Start:
    """The first ``n`` finite values of one signal, with their steps."""

    def __init__(self, n: int):
        self.n = n
        self.steps: list[int] = []
        self.values: list[float] = []

    def add(self, step: int, value: float) -> bool:
        """Keep the value if the start is not full yet; return whether it is now."""
        if len(self.values) < self.n and math.isfinite(value):
            self.steps.append(step)
            self.values.append(value)
            return len(self.values) == self.n
        return False

    @property
    def full(self) -> bool:
        return len(self.values) == self.n


class _Recent:
    """The latest values of one signal by step (for lookups by other detectors)."""

    def __init__(self, size: int):
        self.by_step: dict[int, float] = {}
        self.order: deque[int] = deque()
        self.size = size

    def add(self, step: int, value: float) -> None:
        if step not in self.by_step:
            self.order.append(step)
        self.by_step[step] = value
        while len(self.order) > self.size:
            self.by_step.pop(self.order.popleft(), None)

    def at(self, steps: Iterable[int]) -> list[float]:
        return [self.by_step[s] for s in steps if s in self.by_step]


def _loss_went_up(losses: Sequence[float]) -> bool:
    """Whether the last quarter of the losses is higher than the first quarter."""
    finite = [v for v in losses if math.isfinite(v)]
    if len(finite) < 2:
        return False
    k = max(1, len(finite) // 4)
    return float(np.mean(finite[-k:])) > float(np.mean(finite[:k]))


class _NonfiniteDetector(_Detector):
    """A non-finite loss, or the cockpit's ``nonfinite`` record."""

    check_id = "nonfinite"

    def __init__(self, th: Thresholds):
        super().__init__(th)
        self.last_finite_loss: float | None = None
        self.lr: float | None = None

    def _add(self, step, signals):
        for signal in ("learning_rate", "learning_rates"):
            if signal in signals and math.isfinite(signals[signal]):
                self.lr = signals[signal]
        what = list(signals.get("nonfinite") or [])
        loss = signals.get("loss")
        if loss is not None and not math.isfinite(loss) and "loss" not in what:
            what.append("loss")
        if not what:
            if loss is not None:
                self.last_finite_loss = loss
            return None
        evidence: dict[str, Any] = {"first_nonfinite_step": step, "what": sorted(what)}
        if self.last_finite_loss is not None:
            evidence["last_finite_loss"] = _round(self.last_finite_loss)
        lr = _lr_text([] if self.lr is None else [self.lr], evidence)
        message = (
            f"The {' and the '.join(sorted(what))} became NaN or infinite at step "
            f"{step}{f' (learning rate {lr})' if lr else ''}."
        )
        return Finding(
            "nonfinite", "error", (step, step), message, evidence, _ADVICE["nonfinite"]
        )


class _BlowupDetector(_Detector):
    """The loss at a multiple of its start (a median of 5 against the first 3)."""

    check_id = "step_size_too_large"

    def __init__(self, th: Thresholds):
        super().__init__(th)
        self.start = _Start(3)
        self.window: deque[tuple[int, float]] = deque(maxlen=5)

    def _add(self, step, signals):
        loss = signals.get("loss")
        if loss is None or not math.isfinite(loss):
            return None
        self.start.add(step, loss)
        self.window.append((step, loss))
        if not self.start.full or len(self.window) < 5:
            return None
        start = float(np.median(self.start.values))
        now = float(np.median([v for _, v in self.window]))
        if start <= 0 or now < self.th.loss_rise * start:
            return None
        first, last = self.start.steps[0], self.window[-1][0]
        evidence = {
            "loss_start": _round(start),
            "loss_running_median": _round(now),
            "loss_rise": _round(now / start),
            "threshold_loss_rise": self.th.loss_rise,
        }
        message = (
            f"Steps overshoot: by step {last} the loss rose to {now / start:.3g} "
            f"times its starting level ({start:.4g} over the first 3 tracked steps, "
            f"{now:.4g} over the last 5; threshold {self.th.loss_rise:g} times); the "
            "loss went up."
        )
        return Finding(
            self.check_id, "error", (first, last), message, evidence,
            _ADVICE[self.check_id],
        )  # fmt: skip


class _AlphaStartDetector(_Detector):
    """Median Alpha of the first tracked values at or above ``alpha_large``."""

    check_id = "step_size_too_large"

    def __init__(self, th: Thresholds):
        super().__init__(th)
        self.start = _Start(th.start_steps)
        self.losses = _Recent(th.start_steps + 8)

    def _add(self, step, signals):
        if "loss" in signals:
            self.losses.add(step, signals["loss"])
        alpha = signals.get("alpha")
        if alpha is None or not self.start.add(step, alpha):
            return None
        median = float(np.median(self.start.values))
        if median < self.th.alpha_large:
            return None
        steps = self.start.steps
        rising = _loss_went_up(self.losses.at(steps))
        evidence = {
            "median_alpha_first_steps": _round(median),
            "threshold_median": self.th.alpha_large,
            "first_tracked_values": len(steps),
            "share_alpha_above_1": _round(
                float(np.mean(np.array(self.start.values) > 1))
            ),
        }
        message = (
            f"Steps overshoot from the start: over the first {len(steps)} tracked "
            f"steps (steps {steps[0]}-{steps[-1]}) the median Alpha is "
            f"{median:+.2f} (threshold {self.th.alpha_large:+.2f}). {_ALPHA_MEANING}"
            + ("; the loss went up." if rising else ".")
        )
        return Finding(
            self.check_id, "error" if rising else "warning", (steps[0], steps[-1]),
            message, evidence, _ADVICE[self.check_id],
        )  # fmt: skip


class _AlphaStretchDetector(_Detector):
    """A stretch of overshooting steps (median Alpha >= 1) without progress."""

    check_id = "step_size_too_large"

    def __init__(self, th: Thresholds):
        super().__init__(th)
        self.window: deque[tuple[int, float]] = deque(maxlen=th.stretch_steps)
        self.losses = _Recent(th.stretch_steps + 8)

    def _add(self, step, signals):
        if "loss" in signals:
            self.losses.add(step, signals["loss"])
        alpha = signals.get("alpha")
        if alpha is None or not math.isfinite(alpha):
            return None
        self.window.append((step, alpha))
        if len(self.window) < self.th.stretch_steps:
            return None
        median = float(np.median([v for _, v in self.window]))
        steps = [s for s, _ in self.window]
        losses = [v for v in self.losses.at(steps) if math.isfinite(v)]
        if median < self.th.alpha_stretch or len(losses) < len(steps) // 2:
            return None
        third = max(1, len(losses) // 3)
        before = float(np.median(losses[:third]))
        after = float(np.median(losses[-third:]))
        if after < before:  # overshooting steps that still make progress
            return None
        evidence = {
            "median_alpha_in_stretch": _round(median),
            "threshold_stretch": self.th.alpha_stretch,
            "stretch_steps": len(steps),
            "loss_first_last_third": [_round(before), _round(after)],
        }
        message = (
            f"Steps overshoot: over steps {steps[0]}-{steps[-1]} the median Alpha is "
            f"{median:+.2f} (threshold {self.th.alpha_stretch:+.2f}) and the loss did "
            f"not go down ({before:.4g} to {after:.4g}). {_ALPHA_MEANING}."
        )
        return Finding(
            self.check_id, "error" if after > before else "warning",
            (steps[0], steps[-1]), message, evidence, _ADVICE[self.check_id],
        )  # fmt: skip


class _SlowStartDetector(_Detector):
    """Steps far too small from the start, at a learning rate that did not rise.

    The relative loss decrease bound ``UpdateSize * GradNorm / |Loss|`` of the
    first ``start_steps`` steps (UpdateSize of a step arrives with the next one).
    A warm-up (a rising learning rate) says nothing yet; overshooting steps
    (median Alpha at or above ``alpha_large``) are not too small.
    """

    check_id = "step_size_too_small"

    def __init__(self, th: Thresholds):
        super().__init__(th)
        self.parts: dict[int, dict[str, float]] = {}
        self.start = _Start(th.start_steps)
        self.lrs: dict[str, list[float]] = {}  # the groups' (recorded), Cockpit.log's
        self.alphas: list[float] = []
        self.done = False

    def _add(self, step, signals):
        if self.done:
            return None
        for signal in ("learning_rates", "learning_rate"):
            if signal in signals and math.isfinite(signals[signal]):
                self.lrs.setdefault(signal, []).append(signals[signal])
        if "alpha" in signals and len(self.alphas) < self.th.start_steps:
            self.alphas.append(signals["alpha"])
        for signal in ("update_size", "grad_norm", "loss"):
            if signal in signals:
                self.parts.setdefault(step, {})[signal] = signals[signal]
        for at in sorted(self.parts):
            part = self.parts[at]
            if len(part) < 3:
                continue
            del self.parts[at]
            if part["loss"] != 0:
                progress = part["update_size"] * part["grad_norm"] / abs(part["loss"])
                if self.start.add(at, progress):
                    return self._judge()
        while len(self.parts) > 8:  # steps that never got all three
            del self.parts[min(self.parts)]
        return None

    def _judge(self) -> Finding | None:
        self.done = True
        median = float(np.median(self.start.values))
        if median >= self.th.progress_small:
            return None
        lrs = self.lrs.get("learning_rates") or self.lrs.get("learning_rate") or []
        if lrs and max(lrs) > lrs[0] * (1 + 1e-6):
            return None  # a warm-up: the rate of the start is not the run's
        finite = [a for a in self.alphas if math.isfinite(a)]
        if finite and np.median(finite) >= self.th.alpha_large:
            return None
        steps = self.start.steps
        evidence: dict[str, Any] = {
            "median_relative_decrease_bound_first_steps": _round(median),
            "threshold": self.th.progress_small,
            "first_tracked_values": len(steps),
        }
        lr = _lr_text(lrs, evidence)
        return Finding(
            self.check_id, "warning", (steps[0], steps[-1]),
            _small_message(median, lr, self.th, f"over the first {len(steps)} tracked "
                           f"steps (steps {steps[0]}-{steps[-1]})"),
            evidence, _ADVICE[self.check_id],
        )  # fmt: skip


def _small_message(median: float, lr: str, th: Thresholds, where: str) -> str:
    if median <= 0:
        return f"Parameters do not move ({where})."
    return (
        f"Steps are too small to make progress{f' at learning rate {lr}' if lr else ''}"
        f": {where}, update size times gradient norm, a first-order bound on the "
        f"loss decrease per step, is a median {median:.2g} of the loss (threshold "
        f"{th.progress_small:.2g}); at that pace halving the loss takes at least "
        f"{0.5 / median:.3g} steps."
    )


class _EdgeDetector(_Detector):
    """Gradient elements at the histogram's edges in the first tracked histograms."""

    check_id = "inputs_misscaled"

    def __init__(self, th: Thresholds):
        super().__init__(th)
        self.seen: list[tuple[int, float]] = []
        self.first_loss: float | None = None

    def _add(self, step, signals):
        if self.first_loss is None and "loss" in signals:
            self.first_loss = signals["loss"]
        edge = signals.get("edge_fraction")
        if edge is None or len(self.seen) >= self.th.edge_steps:
            return None
        self.seen.append((step, edge))
        if edge < self.th.edge_fraction:
            return None
        evidence: dict[str, Any] = {
            "edge_bin_fraction": [_round(v) for _, v in self.seen],
            "threshold": self.th.edge_fraction,
            "first_tracked_steps": [s for s, _ in self.seen],
        }
        if self.first_loss is not None:
            evidence["first_loss"] = _round(self.first_loss)
        message = (
            f"At the start of the run {edge:.1%} of the individual gradient elements "
            "lie beyond the gradient histogram's range (threshold "
            f"{self.th.edge_fraction:.0%}): per-sample gradients far larger than "
            "usual, the signature of inputs on a raw scale (e.g. pixels in [0, 255]) "
            "or, less often, of too large initial weights."
        )
        return Finding(
            self.check_id, "warning", (self.seen[0][0], step), message, evidence,
            _ADVICE[self.check_id],
        )  # fmt: skip


class _VanishingDetector(_Detector):
    """Input-side gradients far below output-side ones over the first steps."""

    check_id = "vanishing_gradients"

    def __init__(self, th: Thresholds):
        super().__init__(th)
        self.start = _Start(th.layer_steps)

    def _add(self, step, signals):
        ratio = signals.get("layer_ratio")
        if ratio is None or not self.start.add(step, ratio):
            return None
        median = float(np.median(self.start.values))
        if median >= self.th.layer_ratio_small:
            return None
        steps = self.start.steps
        evidence = {
            "median_input_to_output_gradient_ratio": _round(median),
            "threshold": self.th.layer_ratio_small,
            "first_tracked_values": len(steps),
        }
        message = (
            "Gradients vanish on their way to the input: over the first "
            f"{len(steps)} tracked steps the largest gradient norm among the first "
            "quarter of the parameter tensors is a median "
            f"{median:.2g} times the largest among the last quarter (threshold "
            f"{self.th.layer_ratio_small:.0e}); the first layers barely learn."
        )
        return Finding(
            self.check_id, "warning", (steps[0], steps[-1]), message, evidence,
            _ADVICE[self.check_id],
        )  # fmt: skip


class _GrowthDetector(_Detector):
    """The gradient norm grown ``growth``-fold (a running median of 5 values).

    A run that turns non-finite before 10 finite values settles what it has: the
    growth up to the blow-up, with a window of a quarter of those values.
    """

    check_id = "exploding_gradients"

    def __init__(self, th: Thresholds):
        super().__init__(th)
        self.start = _Start(5)
        self.window: deque[tuple[int, float]] = deque(maxlen=5)
        self.seen: list[tuple[int, float]] = []  # the first 10, for a blow-up

    def _add(self, step, signals):
        norm = signals.get("grad_norm")
        loss = signals.get("loss")
        broken = (norm is not None and not math.isfinite(norm)) or (
            loss is not None and not math.isfinite(loss)
        )
        if broken or signals.get("nonfinite"):
            return self._judge_blowup()
        if norm is None:
            return None
        if len(self.seen) < 10:
            self.seen.append((step, norm))
        self.start.add(step, norm)
        self.window.append((step, norm))
        if not self.start.full or len(self.window) < 5:
            return None
        start = float(np.median(self.start.values))
        peak = float(np.median([v for _, v in self.window]))
        return self._judge(start, peak, self.start.steps[0], step)

    def _judge_blowup(self) -> Finding | None:
        if self.start.full and len(self.window) == 5 or len(self.seen) < 2:
            return None  # judged at every step already / nothing to compare
        values = np.array([v for _, v in self.seen])
        width = max(1, len(values) // 4)
        running = _running_median(values, width)
        peak_at = int(np.argmax(running))
        step = self.seen[min(peak_at + width - 1, len(values) - 1)][0]
        return self._judge(
            float(np.median(values[:width])), float(running[peak_at]),
            self.seen[0][0], step,
        )  # fmt: skip

    def _judge(self, start, peak, first, step) -> Finding | None:
        growth = peak / start if start > 0 else math.inf
        if not growth >= self.th.growth:
            return None
        evidence = {
            "initial_grad_norm": _round(start),
            "peak_grad_norm": _round(peak),
            "peak_step": step,
            "growth": _round(growth),
            "threshold": self.th.growth,
        }
        message = (
            f"The gradient norm grew {growth:.3g}-fold, from {start:.3g} at the start "
            f"to a running median of {peak:.3g} at step {step} (threshold "
            f"{self.th.growth:.0f}-fold)."
        )
        return Finding(
            self.check_id, "warning", (first, step), message, evidence,
            _ADVICE[self.check_id],
        )  # fmt: skip


#: The detectors of settled evidence, in the order their findings are reported.
DETECTORS: tuple[type[_Detector], ...] = (
    _NonfiniteDetector,
    _BlowupDetector,
    _AlphaStartDetector,
    _AlphaStretchDetector,
    _SlowStartDetector,
    _EdgeDetector,
    _VanishingDetector,
    _GrowthDetector,
)


# --- whole-run evidence -------------------------
def _check_nonfinite(signals: Signals, th: Thresholds) -> _Outcome:
    if not (signals.has("loss") or signals.has("nonfinite") or "Loss" in signals.keys):
        return _Outcome(missing="Loss or the cockpit's nonfinite records")
    flagged: dict[int, set[str]] = {}
    for step, what in zip(
        signals.steps.get("nonfinite", []), signals.values.get("nonfinite", [])
    ):
        flagged.setdefault(step, set()).update(what)
    steps, loss = signals.series("loss")
    for step, value in zip(steps, loss):
        if not math.isfinite(value):
            flagged.setdefault(int(step), set()).add("loss")
    if not flagged:
        return _Outcome()
    bad = sorted(flagged)
    what = sorted(set().union(*flagged.values()))
    evidence: dict[str, Any] = {
        "nonfinite_steps": len(bad),
        "first_nonfinite_step": bad[0],
        "what": what,
    }
    finite_before = [(s, v) for s, v in zip(steps, loss) if s < bad[0] and v == v]
    if finite_before:
        evidence["last_finite_loss"] = _round(float(finite_before[-1][1]))
    gsteps, gnorm = signals.series("grad_norm")
    before = gnorm[(gsteps < bad[0]) & np.isfinite(gnorm)]
    if before.size >= 2:
        evidence["grad_norm_first_last_finite"] = [
            _round(float(before[0])),
            _round(float(before[-1])),
        ]
    lr = _lr_note(signals, evidence)
    message = (
        f"The {' and the '.join(what)} became NaN or infinite at step {bad[0]}"
        f"{f' (learning rate {lr})' if lr else ''}; {len(bad)} tracked step(s) are "
        "not finite."
    )
    return _Outcome(
        _finding("nonfinite", "error", bad, message, evidence, _ADVICE["nonfinite"])
    )


def _check_step_size_too_large(signals: Signals, th: Thresholds) -> _Outcome:
    """Median Alpha over the whole run (blow-ups and stretches: the detectors)."""
    if not signals.has("alpha"):
        return _Outcome(missing="Alpha")
    steps, alpha = _finite(*signals.series("alpha"))
    fewest = _fewest(signals, th)
    if len(alpha) < fewest:
        return _Outcome(missing=f"at least {fewest} finite Alpha values")
    median = float(np.median(alpha))
    if median < th.alpha_large:
        return _Outcome()
    evidence: dict[str, Any] = {
        "median_alpha": _round(median),
        "threshold_median": th.alpha_large,
        "share_alpha_above_1": _round(float(np.mean(alpha > 1))),
        "tracked_values": len(alpha),
    }
    lsteps, loss = _finite(*signals.series("loss"))
    rising = False
    if len(loss) >= 2:
        k = max(1, len(loss) // 4)
        first, last = float(np.mean(loss[:k])), float(np.mean(loss[-k:]))
        evidence["loss_first_last_quarter"] = [_round(first), _round(last)]
        rising = last > first
    severity = "error" if rising or _went_nonfinite(signals) else "warning"
    lr = _lr_note(signals, evidence)
    at_lr = f" at learning rate {lr}" if lr else ""
    message = (
        f"Steps overshoot: the median Alpha of the run is {median:+.2f}{at_lr} "
        f"(threshold {th.alpha_large:+.2f}). {_ALPHA_MEANING}"
        + ("; the loss went up." if rising else ".")
    )
    return _Outcome(
        _finding("step_size_too_large", severity, steps, message, evidence,
                 _ADVICE["step_size_too_large"])
    )  # fmt: skip


def _progress(signals: Signals) -> tuple[np.ndarray, np.ndarray]:
    """Steps and ``UpdateSize * GradNorm / |Loss|`` where all three are finite."""
    usteps, update = signals.series("update_size")
    gsteps, gnorm = signals.series("grad_norm")
    lsteps, loss = signals.series("loss")
    common, iu, ig = np.intersect1d(usteps, gsteps, return_indices=True)
    common, ic, il = np.intersect1d(common, lsteps, return_indices=True)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        progress = update[iu][ic] * gnorm[ig][ic] / np.abs(loss[il])
    keep = np.isfinite(progress)
    return common[keep], progress[keep]


def _check_step_size_too_small(signals: Signals, th: Thresholds) -> _Outcome:
    needed = [s for s in ("update_size", "grad_norm", "loss") if not signals.has(s)]
    if needed:
        keys = {"update_size": "UpdateSize", "grad_norm": "GradNorm", "loss": "Loss"}
        return _Outcome(missing=", ".join(keys[s] for s in needed))
    steps, progress = _progress(signals)
    if len(progress) < th.min_steps:
        return _Outcome(
            missing=f"at least {th.min_steps} steps with UpdateSize, GradNorm, Loss"
        )
    median = float(np.median(progress))
    if median >= th.progress_small:
        return _Outcome()
    evidence: dict[str, Any] = {
        "median_relative_decrease_bound": _round(median),
        "threshold": th.progress_small,
        "steps_to_halve_loss_at_least": _round(0.5 / median) if median > 0 else None,
        "tracked_values": len(progress),
    }
    if signals.has("alpha"):
        _, alpha = _finite(*signals.series("alpha"))
        if alpha.size:
            evidence["median_alpha"] = _round(float(np.median(alpha)))
            if np.median(alpha) >= th.alpha_large:
                return _Outcome()  # overshooting steps are not too small
    lr = _lr_note(signals, evidence)
    message = _small_message(median, lr, th, "over the run")
    return _Outcome(
        _finding("step_size_too_small", "warning", steps, message, evidence,
                 _ADVICE["step_size_too_small"])
    )  # fmt: skip


def _needs(signal: str, key: str, count: int | None = None):
    """A whole-run check that only says what a detector lacks (``None``: enough)."""

    def check(signals: Signals, th: Thresholds) -> _Outcome:
        if not signals.has(signal):
            return _Outcome(missing=key)
        if count is not None:
            enough = getattr(th, count) if isinstance(count, str) else count
            _, values = _finite(*signals.series(signal))
            if len(values) < enough:
                return _Outcome(missing=f"at least {enough} {key} values")
        return _Outcome()

    return check


def _check_vanishing(signals: Signals, th: Thresholds) -> _Outcome:
    if not signals.has("grad_norm"):
        return _Outcome(missing="GradNorm")
    if not signals.has("layer_ratio"):
        return _Outcome(missing="GradNorm of at least 4 parameter tensors")
    return _needs("layer_ratio", "GradNorm", "layer_steps")(signals, th)


def _check_exploding(signals: Signals, th: Thresholds) -> _Outcome:
    if _went_nonfinite(signals):  # the detector judged what the blow-up left
        return _needs("grad_norm", "GradNorm")(signals, th)
    return _needs("grad_norm", "GradNorm", "min_steps")(signals, th)


def _check_noise(signals: Signals, th: Thresholds) -> _Outcome:
    if not signals.has("norm_test"):
        return _Outcome(missing="NormTest")
    steps, norm_test = _finite(*signals.series("norm_test"))
    if len(norm_test) < th.min_steps:
        return _Outcome(missing=f"at least {th.min_steps} NormTest values")
    w = min(_window(len(norm_test)), len(norm_test))
    medians = _running_median(norm_test**2, w)
    best = int(np.argmin(medians))
    lowest = float(medians[best])
    if lowest < th.noise_fraction:
        return _Outcome()
    evidence: dict[str, Any] = {
        "lowest_running_median_norm_test_squared": _round(lowest),
        "threshold": th.noise_fraction,
        "window_steps": [int(steps[best]), int(steps[best + w - 1])],
        "median_norm_test": _round(float(np.median(norm_test))),
    }
    for signal in ("inner_test", "ortho_test"):
        if signals.has(signal):
            _, values = _finite(*signals.series(signal))
            if values.size:
                evidence[f"median_{signal}"] = _round(float(np.median(values)))
    message = (
        "Gradient noise dominates throughout the run: even in its best stretch "
        f"(steps {steps[best]}-{steps[best + w - 1]}) about {lowest:.0%} of the "
        "squared mini-batch gradient norm is sampling noise (NormTest squared; "
        f"threshold {th.noise_fraction:.0%}), so steps follow the noise more than "
        "the true gradient."
    )
    return _Outcome(
        _finding("gradient_noise_dominates", "warning", steps, message, evidence,
                 _ADVICE["gradient_noise_dominates"])
    )  # fmt: skip


def _check_plateau(signals: Signals, th: Thresholds) -> _Outcome:
    if not signals.has("loss"):
        return _Outcome(missing="Loss")
    steps, loss = signals.series("loss")
    bad = np.flatnonzero(~np.isfinite(loss))
    if bad.size:  # only the stretch before the loss blew up
        steps, loss = steps[: bad[0]], loss[: bad[0]]
    if len(loss) < 2 * th.min_steps:
        return _Outcome(missing=f"at least {2 * th.min_steps} finite Loss values")
    w = _window(len(loss))
    half = len(loss) // 2
    first = float(np.mean(loss[:w]))
    middle = float(np.mean(loss[half : half + w]))
    last = float(np.mean(loss[-w:]))
    scale = max(abs(middle), 1e-12)
    improvement = (middle - last) / scale
    if improvement >= th.plateau_improvement or improvement < -th.plateau_rise:
        return _Outcome()
    total = (first - last) / max(abs(first), 1e-12)
    severity = "warning" if total < th.plateau_total else "info"
    evidence = {
        "loss_start_middle_end": [_round(first), _round(middle), _round(last)],
        "improvement_second_half": _round(improvement),
        "threshold": th.plateau_improvement,
        "improvement_whole_run": _round(total),
        "warning_below_whole_run_improvement": th.plateau_total,
    }
    if severity == "warning":
        message = (
            f"The loss hardly moves: {first:.4g} at the start, {last:.4g} at the end "
            f"({total:.0%} lower), and {improvement:.1%} better over the second half "
            f"(threshold {th.plateau_improvement:.0%})."
        )
        advice = (
            "Look at the other findings for the cause (step size, vanishing "
            "gradients, noise). Without one: raise the learning rate, check that "
            "the labels match the inputs and that the optimizer holds all parameters."
        )
    else:
        message = (
            f"The loss fell from {first:.4g} to {last:.4g} but improved only "
            f"{improvement:.1%} over the second half (threshold "
            f"{th.plateau_improvement:.0%}): it may have converged or stalled."
        )
        advice = (
            "If the validation loss is still falling or the training loss is far "
            "from the level you expect, decay the learning rate or train longer; "
            "otherwise stop here."
        )
    return _Outcome(
        Finding(
            "loss_plateau",
            severity,
            (int(steps[half]), int(steps[-1])),
            message,
            evidence,
            advice,
        )
    )


_CHECKS: dict[str, Callable[[Signals, Thresholds], _Outcome]] = {
    "nonfinite": _check_nonfinite,
    "step_size_too_large": _check_step_size_too_large,
    "step_size_too_small": _check_step_size_too_small,
    "inputs_misscaled": _needs("edge_fraction", "GradHist1d"),
    "vanishing_gradients": _check_vanishing,
    "exploding_gradients": _check_exploding,
    "gradient_noise_dominates": _check_noise,
    "loss_plateau": _check_plateau,
}


def _by_step(signals: Signals) -> list[tuple[int, dict[str, Any]]]:
    """The signals regrouped step by step, in step order."""
    steps: dict[int, dict[str, Any]] = {}
    for signal, at in signals.steps.items():
        for step, value in zip(at, signals.values[signal]):
            steps.setdefault(int(step), {})[signal] = value
    return sorted(steps.items())


def settled(signals: Signals, thresholds: Thresholds | None = None) -> list[Finding]:
    """The settled evidence of a run: what the detectors find, step by step.

    This is what a :class:`LiveDiagnosis` fed the same steps announces (one
    finding per detector that fired, in the order they fired).
    """
    th = thresholds or Thresholds()
    detectors = [d(th) for d in DETECTORS]
    found = []
    for step, values in _by_step(signals):
        for detector in detectors:
            finding = detector.add(step, values)
            if finding is not None:
                found.append(finding)
    return found


def run_checks(signals: Signals, thresholds: Thresholds | None = None) -> list[Finding]:
    """Run every check on collected signals: settled and whole-run evidence.

    Args:
        signals: The per-step signals of a run.
        thresholds: Thresholds to use (default: :class:`Thresholds`).

    Returns:
        The findings, most severe first (ties in :data:`CHECK_IDS` order), one per
        id (the most severe of its settled and whole-run evidence; the whole run's
        at equal severity), and last, if any check could not run, one ``info``
        finding ``not_checked``. Every id the live diagnosis announces for these
        signals is among them.
    """
    th = thresholds or Thresholds()
    rank = {s: i for i, s in enumerate(SEVERITIES)}
    chosen: dict[str, Finding] = {}
    for finding in settled(signals, th):
        known = chosen.get(finding.id)
        if known is None or rank[finding.severity] > rank[known.severity]:
            chosen[finding.id] = finding
    missing: dict[str, str] = {}
    for check_id, check in _CHECKS.items():
        outcome = check(signals, th)
        finding, known = outcome.finding, chosen.get(check_id)
        if finding is not None:
            if known is None or rank[finding.severity] >= rank[known.severity]:
                chosen[check_id] = finding
        elif outcome.missing is not None and known is None:
            missing[check_id] = outcome.missing
    order = {c: i for i, c in enumerate(CHECK_IDS)}
    findings = sorted(chosen.values(), key=lambda f: (-rank[f.severity], order[f.id]))
    if missing:
        steps = sorted({s for values in signals.steps.values() for s in values})
        names = "; ".join(f"{check} (needs {need})" for check, need in missing.items())
        findings.append(
            Finding(
                NOT_CHECKED,
                "info",
                (steps[0], steps[-1]) if steps else (0, 0),
                f"Not checked, for lack of data: {names}.",
                {"checks": dict(missing)},
                "Track the economy configuration "
                "(configuration('economy')) on a schedule with consecutive steps, "
                "e.g. linear(1), and pass the optimizer in info.",
            )
        )
    return findings


# --- entry points -------------------------
#: Read a cockpit log for diagnosis (the name :func:`~cockpit.log.files.open_log`
#: had here before every command shared it).
load_history = open_log


def collect(history) -> Signals:
    """Collect the per-step signals of a :class:`cockpit.history.History`."""
    signals = Signals()
    for step in history.steps:
        signals.add(step, history.view(step))
    return signals


def diagnose(history_or_path, thresholds: Thresholds | None = None) -> list[Finding]:
    """Diagnose a finished run: settled and whole-run evidence.

    Args:
        history_or_path: A :class:`cockpit.history.History`, a ``{step: {key:
            value}}`` mapping, a :class:`cockpit.Cockpit` (its history), or the
            path of a log (read with :func:`~cockpit.log.files.open_log`).
        thresholds: Thresholds to use (default: :class:`Thresholds`).

    Returns:
        The findings, most severe first; a healthy run has none at ``warning`` or
        ``error``. Checks that lacked data are listed in a ``not_checked`` finding.

    Raises:
        LogFileError: For a path that is not a readable cockpit log.
    """
    source = history_or_path
    if isinstance(source, (str, os.PathLike)):
        source = open_log(source)
    elif hasattr(source, "history") and isinstance(source.history, History):
        source = source.history
    elif not isinstance(source, History):
        source = History(source)
    return run_checks(collect(source), thresholds)


def worst(findings: Iterable[Finding]) -> str | None:
    """The highest severity among ``findings`` (``None`` if there are none)."""
    rank = {s: i for i, s in enumerate(SEVERITIES)}
    levels = [f.severity for f in findings]
    return max(levels, key=rank.__getitem__) if levels else None


# --- live use -------------------------
def _user_stacklevel() -> int:
    """The ``stacklevel`` that points a warning at the first frame outside cockpit.

    Counted from the caller of ``warnings.warn``; frames of cockpit and of the
    frameworks that call it (torch, Lightning, transformers, accelerate) are
    skipped, so the warning names the user's ``with cockpit(...)`` line, their
    ``loss.backward()`` or their ``trainer.fit(...)``.
    """
    frame = sys._getframe(2)  # the caller of warnings.warn (stacklevel 1)
    level = 2
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module.split(".")[0] not in _LIBRARIES:
            return level
        frame, level = frame.f_back, level + 1
    return 1


#: Top-level packages whose frames a live warning skips (see _user_stacklevel).
_LIBRARIES = frozenset(
    {"cockpit", "torch", "lightning", "pytorch_lightning", "transformers",
     "accelerate", "contextlib", "backpack"}
)  # fmt: skip


class LiveDiagnosis:
    """Diagnose a run while it trains: settled evidence only, bounded memory.

    The cockpit calls :meth:`on_record` after each tracked step with the values it
    recorded; each detector of settled evidence (a closed stretch of steps that
    later steps cannot undo, see the module docstring) keeps a few values of the
    first steps and a window of the latest. Each finding id is announced once
    with a :class:`~cockpit.errors.CockpitWarning` that points at the user's code;
    :meth:`postfix` gives a short status for a progress bar. The report of the
    finished run (:func:`diagnose`) holds every id announced here.

    Two-step values (Alpha, UpdateSize) belong to the step before the one they are
    recorded with; passing them with either step is fine.

    Args:
        thresholds: Thresholds to use (default: :class:`Thresholds`).
        warn: Emit a :class:`CockpitWarning` for each new finding id.
        silent: Finding ids announced elsewhere: recorded, but not warned about
            (the cockpit warns about non-finite steps itself).
    """

    def __init__(
        self,
        thresholds: Thresholds | None = None,
        warn: bool = True,
        silent: Sequence[str] = (),
    ):
        self.thresholds = thresholds or Thresholds()
        self.warn = warn
        self.silent = frozenset(silent)
        self._detectors = [d(self.thresholds) for d in DETECTORS]
        self._findings: dict[str, Finding] = {}

    def on_record(self, global_step: int, values: Mapping[str, Any]) -> None:
        """Take the values recorded for one tracked step.

        Several calls for the same step (e.g. the quantities, then
        :meth:`cockpit.Cockpit.log`) are fine: each signal is read once.

        Args:
            global_step: The step.
            values: ``{key: value}`` recorded at that step (tensors, arrays or
                plain numbers; only a few scalars are kept).
        """
        signals = step_signals(values)
        if not signals:
            return
        step = int(global_step)
        for detector in self._detectors:
            finding = detector.add(step, signals)
            if finding is not None and finding.id not in self._findings:
                self._findings[finding.id] = finding
                if self.warn and finding.id not in self.silent:
                    warnings.warn(
                        f"cockpit diagnosis [{finding.id}, step {finding.steps[1]}]: "
                        f"{finding.message} Advice: {finding.advice}",
                        CockpitWarning,
                        stacklevel=_user_stacklevel(),
                    )

    def check(self) -> list[Finding]:
        """The findings at ``warning`` or ``error`` announced so far."""
        return [f for f in self._findings.values() if f.severity != "info"]

    @property
    def findings(self) -> list[Finding]:
        """Every finding announced so far (first occurrence of each id)."""
        return list(self._findings.values())

    def postfix(self) -> str:
        """A short status for a progress bar, e.g. ``"ok"`` or ``"nonfinite+1"``."""
        if not self._findings:
            return "ok"
        rank = {s: i for i, s in enumerate(SEVERITIES)}
        ids = sorted(self._findings.values(), key=lambda f: -rank[f.severity])
        extra = len(ids) - 1
        return ids[0].id + (f"+{extra}" if extra else "")


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


__all__ = [
    "CHECK_IDS",
    "Finding",
    "LiveDiagnosis",
    "NOT_CHECKED",
    "SEVERITIES",
    "Thresholds",
    "diagnose",
    "load_history",
    "run_checks",
    "settled",
    "step_signals",
    "worst",
]
