"""Diagnosis: what is wrong with a run, read off the quantities cockpit tracked.

Each check reads a few per-step signals (loss, Alpha, gradient norms, the gradient
element histogram, the norm test, update sizes) and turns what it sees into a
:class:`Finding`: a stable id, a severity, the step range, the values that triggered
it together with the threshold, and the advice a practitioner would give. Text,
Markdown and JSON (:mod:`cockpit.report`) are renderings of the same records.

Checks and the signals they read (all part of the ``economy`` configuration, plus
the ``nonfinite`` records of the Cockpit and ``learning_rate`` from
:meth:`cockpit.Cockpit.log`, used as evidence only):

============================  =====================================================
id                            reads
============================  =====================================================
``nonfinite``                 ``nonfinite`` records, Loss
``step_size_too_large``       Alpha, Loss (blow-ups and the severity)
``step_size_too_small``       UpdateSize, GradNorm, Loss (Alpha as a cross-check)
``inputs_misscaled``          GradHist1d (first tracked steps)
``vanishing_gradients``       GradNorm (per parameter; at least 4 tensors)
``exploding_gradients``       GradNorm
``gradient_noise_dominates``  NormTest
``loss_plateau``              Loss
============================  =====================================================

A check whose signals were not tracked (or hold too few steps) does not guess: the
result then holds one ``info`` finding with id ``not_checked`` that names the
checks and what they miss.

Use it after a run (:func:`diagnose`, or ``cockpit report LOG``) or while training
(:class:`LiveDiagnosis`, which the cockpit notifies after each tracked step).

The thresholds (:class:`Thresholds`) were chosen on one set of runs and validated
on another (``python -m benchmarks.diagnosis_validation``; ``docs/diagnosis.md``).
"""

from __future__ import annotations

import math
import os
import warnings
from collections import deque
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from cockpit.errors import CockpitWarning
from cockpit.history import History, to_builtin
from cockpit.log_files import open_log
from cockpit.log_keys import NONFINITE_KEY
from cockpit.running_median import running_median

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
        alpha_large: Median Alpha over the run at or above this: steps overshoot
            the minimum along the step direction (0 lands in it, 1 at the mirror
            point, where the loss is as high as before the step).
        alpha_stretch: Running median of Alpha (over a tenth of the run, at
            least 5 steps) at or above this somewhere: a stretch of overshooting
            steps (e.g. an unstable start that later settles).
        loss_rise: A running median of 5 losses at or above this multiple of
            the first tracked losses also counts as steps too large (error).
        progress_small: Median of ``UpdateSize * GradNorm / |Loss|`` (a first-order
            bound on the relative loss decrease per step) below this: steps too
            small to make progress.
        edge_fraction: Fraction of individual gradient elements in the two edge
            bins of GradHist1d (beyond its range) in the first tracked steps, at or
            above this: inputs (or weights) on the wrong scale.
        edge_steps: How many of the first tracked histograms are looked at.
        layer_ratio_small: Median ratio of the gradient norm of the first two
            parameter tensors (input side) to that of the last two (output side)
            below this: vanishing gradients.
        growth: Rise of the gradient norm (peak of a 5-step running median over
            the median of the first 5 tracked steps) at or above this: exploding
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
        min_steps: Fewest tracked values a check needs; a run that turned
            non-finite needs only ``min_steps_nonfinite`` finite values before
            (a blow-up leaves few).
        min_steps_nonfinite: See ``min_steps``.
    """

    alpha_large: float = 0.5
    alpha_stretch: float = 1.0
    loss_rise: float = 2.0
    progress_small: float = 1e-3
    edge_fraction: float = 0.01
    edge_steps: int = 3
    layer_ratio_small: float = 1e-3
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
    """Gradient norm of the first two tensors over that of the last two."""
    try:
        array = np.asarray(value, dtype=np.float64).reshape(-1)
    except (TypeError, ValueError):
        return None
    if array.size < 4 or not np.all(np.isfinite(array)):
        return None
    first, last = np.hypot(*array[:2]), np.hypot(*array[-2:])
    if last <= 0:
        return None
    return float(first / last)


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


# --- checks -------------------------
@dataclass(frozen=True)
class _Outcome:
    """What one check returned: a finding, or why it could not run."""

    finding: Finding | None = None
    missing: str | None = None


def _span(steps: np.ndarray) -> tuple[int, int]:
    return (int(steps[0]), int(steps[-1])) if len(steps) else (0, 0)


def _round(value: float, digits: int = 4) -> float | None:
    if value is None or not math.isfinite(value):
        return None if value is None or math.isnan(value) else value
    if value == 0:
        return 0.0
    return float(f"{value:.{digits}g}")


def _lr_note(signals: Signals, evidence: dict[str, Any]) -> str:
    """Add the logged learning rate to the evidence; return it as text ("" if none)."""
    steps, lrs = signals.series("learning_rate")
    finite = lrs[np.isfinite(lrs)]
    if finite.size:
        lo, hi = float(finite.min()), float(finite.max())
        evidence["learning_rate"] = _round(hi) if lo == hi else [_round(lo), _round(hi)]
        return f"{lo:.3g}" if lo == hi else f"{lo:.3g} to {hi:.3g}"
    evidence["learning_rate"] = "not logged (Cockpit.log)"
    return ""


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
    advice = (
        "Lower the learning rate (a factor of 10 is a good first try), clip the "
        "gradient norm (torch.nn.utils.clip_grad_norm_), and check the data and the "
        "loss for NaN, log(0) or division by zero. If the gradient norm grew before "
        "the first non-finite step, see exploding_gradients."
    )
    finding = Finding(
        "nonfinite", "error", (bad[0], bad[-1]), message, evidence, advice
    )
    return _Outcome(finding)


def _finite(steps: np.ndarray, values: np.ndarray):
    keep = np.isfinite(values)
    return steps[keep], values[keep]


def _check_step_size_too_large(signals: Signals, th: Thresholds) -> _Outcome:
    if not signals.has("alpha"):
        return _Outcome(missing="Alpha")
    steps, alpha = _finite(*signals.series("alpha"))
    fewest = _fewest(signals, th)
    if len(alpha) < fewest:
        return _Outcome(missing=f"at least {fewest} finite Alpha values")
    median = float(np.median(alpha))
    w = min(_window(len(alpha)), len(alpha))
    running = _running_median(alpha, w)
    worst_at = int(np.argmax(running))
    stretch = float(running[worst_at])
    whole_run = median >= th.alpha_large
    blowup = _loss_blowup(signals, th)
    if not (whole_run or stretch >= th.alpha_stretch or blowup):
        return _Outcome()
    if whole_run:
        span = _span(steps)
    elif stretch >= th.alpha_stretch:
        span = (steps[worst_at], steps[worst_at + w - 1])
    else:
        span = blowup["steps"]
    evidence: dict[str, Any] = {
        "median_alpha": _round(median),
        "threshold_median": th.alpha_large,
        "highest_running_median_alpha": _round(stretch),
        "threshold_running_median": th.alpha_stretch,
        "running_median_window": w,
        "share_alpha_above_1": _round(float(np.mean(alpha > 1))),
        "tracked_values": len(alpha),
    }
    if blowup:
        evidence["loss_rise"] = _round(blowup["rise"])
        evidence["threshold_loss_rise"] = th.loss_rise
    lsteps, loss = _finite(*signals.series("loss"))
    inside = (lsteps >= span[0]) & (lsteps <= span[1])
    rising = bool(blowup)
    if inside.sum() >= 2 and not blowup:
        k = max(1, int(inside.sum()) // 4)
        first = float(np.mean(loss[inside][:k]))
        last = float(np.mean(loss[inside][-k:]))
        evidence["loss_first_last_in_steps"] = [_round(first), _round(last)]
        rising = last > first
    severity = "error" if rising or _went_nonfinite(signals) else "warning"
    lr = _lr_note(signals, evidence)
    at_lr = f" at learning rate {lr}" if lr else ""
    if whole_run:
        seen = (
            f"the median Alpha is {median:+.2f}{at_lr} (threshold "
            f"{th.alpha_large:+.2f})"
        )
    elif blowup and stretch < th.alpha_stretch:
        seen = (
            f"over steps {span[0]}-{span[1]} the loss rose to {blowup['rise']:.3g} "
            f"times its starting level{at_lr} (threshold {th.loss_rise:g} times)"
        )
    else:
        seen = (
            f"over steps {span[0]}-{span[1]} the running median of Alpha reaches "
            f"{stretch:+.2f}{at_lr} (threshold {th.alpha_stretch:+.2f})"
        )
    message = (
        f"Steps overshoot: {seen}. Alpha 0 lands in the minimum along the step, +1 "
        "at the point of equal height on the other side"
        + ("; the loss went up." if rising else ".")
    )
    advice = (
        "Lower the learning rate, by a factor of 3 to 10 to start with, or add a "
        "warm-up; runs with a median Alpha slightly above 0 (about 0 to 0.3) "
        "train best (Cockpit paper, Fig. 5)."
    )
    return _Outcome(
        Finding("step_size_too_large", severity, span, message, evidence, advice)
    )


def _loss_blowup(signals: Signals, th: Thresholds) -> dict[str, Any] | None:
    """Where the loss rose far above its starting level (``None`` if it did not).

    The running median of 5 finite losses is compared with the median of the
    first 3 tracked losses.
    """
    steps, loss = _finite(*signals.series("loss"))
    if len(loss) < 8:
        return None
    start = float(np.median(loss[:3]))
    running = _running_median(loss, 5)
    peak = int(np.argmax(running))
    if start <= 0 or not running[peak] >= th.loss_rise * start:
        return None
    return {"rise": float(running[peak]) / start, "steps": (steps[0], steps[peak + 4])}


def _check_step_size_too_small(signals: Signals, th: Thresholds) -> _Outcome:
    needed = [s for s in ("update_size", "grad_norm", "loss") if not signals.has(s)]
    if needed:
        keys = {"update_size": "UpdateSize", "grad_norm": "GradNorm", "loss": "Loss"}
        return _Outcome(missing=", ".join(keys[s] for s in needed))
    usteps, update = signals.series("update_size")
    gsteps, gnorm = signals.series("grad_norm")
    lsteps, loss = signals.series("loss")
    common, iu, ig = np.intersect1d(usteps, gsteps, return_indices=True)
    common, ic, il = np.intersect1d(common, lsteps, return_indices=True)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        progress = update[iu][ic] * gnorm[ig][ic] / np.abs(loss[il])
    keep = np.isfinite(progress)
    steps, progress = common[keep], progress[keep]
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
    message = (
        f"Steps are too small to make progress"
        f"{f' at learning rate {lr}' if lr else ''}: update size times gradient "
        f"norm, a first-order bound on the loss decrease per step, is a median "
        f"{median:.2g} of the loss (threshold {th.progress_small:.2g}); at that pace "
        "halving the loss takes at least "
        f"{0.5 / median:.3g} steps."
        if median > 0
        else "Parameters do not move."
    )
    advice = (
        "Raise the learning rate (try 10x, then bisect; Alpha slightly above 0 is a "
        "good target), check that a scheduler has not decayed it to nearly 0 and that "
        "the optimizer holds all parameters."
    )
    return _Outcome(
        Finding(
            "step_size_too_small", "warning", _span(steps), message, evidence, advice
        )
    )


def _check_inputs_misscaled(signals: Signals, th: Thresholds) -> _Outcome:
    if not signals.has("edge_fraction"):
        return _Outcome(missing="GradHist1d")
    steps, edge = signals.series("edge_fraction")
    steps, edge = steps[: th.edge_steps], edge[: th.edge_steps]
    peak = float(np.max(edge))
    if peak < th.edge_fraction:
        return _Outcome()
    evidence = {
        "edge_bin_fraction": [_round(float(v)) for v in edge],
        "threshold": th.edge_fraction,
        "first_tracked_steps": [int(s) for s in steps],
    }
    lsteps, loss = signals.series("loss")
    if len(loss):
        evidence["first_loss"] = _round(float(loss[0]))
    message = (
        f"At the start of the run {peak:.1%} of the individual gradient elements "
        f"lie beyond the gradient histogram's range (threshold {th.edge_fraction:.0%}"
        "): per-sample gradients far larger than usual, the signature of inputs on "
        "a raw scale (e.g. pixels in [0, 255]) or, less often, of too large initial "
        "weights."
    )
    advice = (
        "Standardise the inputs (subtract the mean, divide by the standard deviation "
        "of the training set; for images e.g. divide by 255 and normalise per "
        "channel). If they are standardised, check the weight initialisation."
    )
    return _Outcome(
        Finding("inputs_misscaled", "warning", _span(steps), message, evidence, advice)
    )


def _check_vanishing(signals: Signals, th: Thresholds) -> _Outcome:
    if not signals.has("grad_norm"):
        return _Outcome(missing="GradNorm")
    if not signals.has("layer_ratio"):
        return _Outcome(missing="GradNorm of at least 4 parameter tensors")
    steps, ratio = signals.series("layer_ratio")
    if len(ratio) < th.min_steps:
        return _Outcome(missing=f"at least {th.min_steps} GradNorm values")
    median = float(np.median(ratio))
    if median >= th.layer_ratio_small:
        return _Outcome()
    evidence = {
        "median_input_to_output_gradient_ratio": _round(median),
        "threshold": th.layer_ratio_small,
        "tracked_values": len(ratio),
    }
    message = (
        "Gradients vanish on their way to the input: the gradient norm of the first "
        f"two parameter tensors is a median {median:.2g} times that of the last two "
        f"(threshold {th.layer_ratio_small:.0e}); the first layers barely learn."
    )
    advice = (
        "Use non-saturating activations (ReLU, GELU) instead of sigmoid or tanh in "
        "deep stacks, an initialisation matched to the activation (He/Kaiming for "
        "ReLU), normalisation layers or residual connections; check for dead ReLUs "
        "(a first layer with exactly zero gradient)."
    )
    return _Outcome(
        Finding(
            "vanishing_gradients", "warning", _span(steps), message, evidence, advice
        )
    )


def _running_median(values: np.ndarray, width: int) -> np.ndarray:
    # linear in the run's length (numpy's median of every window copies them all)
    return running_median(values, width)


def _check_exploding(signals: Signals, th: Thresholds) -> _Outcome:
    if not signals.has("grad_norm"):
        return _Outcome(missing="GradNorm")
    steps, gnorm = signals.series("grad_norm")
    finite = np.isfinite(gnorm)
    fewest = _fewest(signals, th)
    if finite.sum() < fewest:
        return _Outcome(missing=f"at least {fewest} finite GradNorm values")
    steps, gnorm = steps[finite], gnorm[finite]
    width = min(5, max(1, len(gnorm) // 4))
    start = float(np.median(gnorm[:width]))
    running = _running_median(gnorm, width)
    peak_index = int(np.argmax(running))
    peak = float(running[peak_index])
    growth = peak / start if start > 0 else math.inf
    if not growth >= th.growth:
        return _Outcome()
    peak_step = int(steps[min(peak_index + width - 1, len(steps) - 1)])
    evidence = {
        "initial_grad_norm": _round(start),
        "peak_grad_norm": _round(peak),
        "peak_step": peak_step,
        "growth": _round(growth),
        "threshold": th.growth,
    }
    message = (
        f"The gradient norm grew {growth:.3g}-fold, from {start:.3g} at the start to "
        f"a running median of {peak:.3g} at step {peak_step} (threshold "
        f"{th.growth:.0f}-fold)."
    )
    advice = (
        "Clip the gradient norm (torch.nn.utils.clip_grad_norm_), lower the learning "
        "rate, and for deep or recurrent networks use an initialisation that keeps "
        "the scale across layers, normalisation layers or residual connections."
    )
    return _Outcome(
        Finding(
            "exploding_gradients",
            "warning",
            (int(steps[0]), peak_step),
            message,
            evidence,
            advice,
        )
    )


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
    advice = (
        "Increase the batch size (or accumulate gradients over several batches), "
        "lower the learning rate or decay it; if the batch is already large, check "
        "the labels for noise (shuffled or wrong targets)."
    )
    return _Outcome(
        Finding(
            "gradient_noise_dominates",
            "warning",
            _span(steps),
            message,
            evidence,
            advice,
        )
    )


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
    "inputs_misscaled": _check_inputs_misscaled,
    "vanishing_gradients": _check_vanishing,
    "exploding_gradients": _check_exploding,
    "gradient_noise_dominates": _check_noise,
    "loss_plateau": _check_plateau,
}


def run_checks(signals: Signals, thresholds: Thresholds | None = None) -> list[Finding]:
    """Run every check on collected signals.

    Args:
        signals: The per-step signals of a run.
        thresholds: Thresholds to use (default: :class:`Thresholds`).

    Returns:
        The findings, most severe first (ties in :data:`CHECK_IDS` order), and
        last, if any check could not run, one ``info`` finding ``not_checked``.
    """
    th = thresholds or Thresholds()
    findings: list[Finding] = []
    missing: dict[str, str] = {}
    for check_id, check in _CHECKS.items():
        outcome = check(signals, th)
        if outcome.finding is not None:
            findings.append(outcome.finding)
        elif outcome.missing is not None:
            missing[check_id] = outcome.missing
    rank = {s: i for i, s in enumerate(SEVERITIES)}
    order = {c: i for i, c in enumerate(CHECK_IDS)}
    findings.sort(key=lambda f: (-rank[f.severity], order[f.id]))
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
                "e.g. linear(1), and log the learning rate with Cockpit.log.",
            )
        )
    return findings


# --- entry points -------------------------
#: Read a cockpit log for diagnosis (the name :func:`~cockpit.log_files.open_log`
#: had here before every command shared it).
load_history = open_log


def collect(history) -> Signals:
    """Collect the per-step signals of a :class:`cockpit.history.History`."""
    signals = Signals()
    for step in history.steps:
        signals.add(step, history.view(step))
    return signals


def diagnose(history_or_path, thresholds: Thresholds | None = None) -> list[Finding]:
    """Diagnose a run.

    Args:
        history_or_path: A :class:`cockpit.history.History`, a ``{step: {key:
            value}}`` mapping, a :class:`cockpit.Cockpit` (its history), or the
            path of a log (read with :func:`~cockpit.log_files.open_log`).
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
class LiveDiagnosis:
    """Diagnose a run while it trains, with bounded memory and little work per step.

    The cockpit calls :meth:`on_record` after each tracked step with the values it
    recorded. The signals of the first ``head`` steps and of the latest ``window``
    steps are kept (a few floats per step); every ``every`` records the checks run
    on them (non-finite values are reported at once). Each finding id at
    ``warning`` or ``error`` is announced once with a
    :class:`~cockpit.errors.CockpitWarning`; :meth:`postfix` gives a short status
    for a progress bar.

    Two-step values (Alpha, UpdateSize) belong to the step before the one they are
    recorded with; passing them with either step is fine.

    Args:
        thresholds: Thresholds to use (default: :class:`Thresholds`).
        every: Run the checks after every this many records.
        head: Number of first steps kept (the reference for growth and scaling).
        window: Number of latest steps kept.
        warn: Emit a :class:`CockpitWarning` for each new finding id.
        silent: Finding ids announced elsewhere: recorded, but not warned about
            (the cockpit warns about non-finite steps itself).
    """

    def __init__(
        self,
        thresholds: Thresholds | None = None,
        every: int = 25,
        head: int = 20,
        window: int = 200,
        warn: bool = True,
        silent: Sequence[str] = (),
    ):
        if every < 1 or head < 1 or window < 1:
            raise ValueError("every, head and window must be positive.")
        self.thresholds = thresholds or Thresholds()
        self.every = every
        self.warn = warn
        self.silent = frozenset(silent)
        self._head: list[tuple[int, dict[str, Any]]] = []
        self._head_size = head
        self._tail: deque[tuple[int, dict[str, Any]]] = deque(maxlen=window)
        self._keys: set[str] = set()
        self._records = 0
        self._findings: dict[str, Finding] = {}

    def on_record(self, global_step: int, values: Mapping[str, Any]) -> None:
        """Take the values recorded for one tracked step.

        Several calls for the same step (e.g. the quantities, then
        :meth:`cockpit.Cockpit.log`) are merged into one record.

        Args:
            global_step: The step.
            values: ``{key: value}`` recorded at that step (tensors, arrays or
                plain numbers; only a few scalars are kept).
        """
        self._keys.update(values)
        signals = step_signals(values)
        step = int(global_step)
        last = (
            self._tail[-1] if self._tail else (self._head[-1] if self._head else None)
        )
        if last is not None and last[0] == step:
            last[1].update(signals)
        else:
            if len(self._head) < self._head_size:
                self._head.append((step, signals))
            else:
                self._tail.append((step, signals))
            self._records += 1
        urgent = "nonfinite" in signals or not all(
            math.isfinite(signals[s]) for s in ("loss", "grad_norm") if s in signals
        )
        if urgent or self._records % self.every == 0:
            self.check()

    def check(self) -> list[Finding]:
        """Run the checks on the signals kept so far; warn about new finding ids.

        Returns:
            The current findings at ``warning`` or ``error``.
        """
        signals = Signals()
        signals.keys.update(self._keys)
        for step, entry in [*self._head, *self._tail]:
            for signal, value in entry.items():
                signals.steps.setdefault(signal, []).append(step)
                signals.values.setdefault(signal, []).append(value)
        current = [
            f for f in run_checks(signals, self.thresholds) if f.severity != "info"
        ]
        for finding in current:
            new = finding.id not in self._findings
            if new and self.warn and finding.id not in self.silent:
                warnings.warn(
                    f"cockpit diagnosis [{finding.id}, step {finding.steps[1]}]: "
                    f"{finding.message} Advice: {finding.advice}",
                    CockpitWarning,
                    stacklevel=3,
                )
            self._findings.setdefault(finding.id, finding)
        return current

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
    "step_signals",
    "worst",
]
