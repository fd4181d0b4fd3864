"""Settled evidence: streaming detectors with bounded memory, one per kind of finding.

Each keeps a few values of the first steps and a window of the latest; what it
finds no later step can undo, so the live diagnosis may announce it.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from cockpit.diagnosis.evidence import (
    _ADVICE,
    _ALPHA_MEANING,
    _lr_text,
    _round,
    _running_median,
)
from cockpit.diagnosis.findings import Finding, Thresholds


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
    """Gradient elements at the histogram's edges from the first tracked histogram.

    Inputs (or initial weights) on the wrong scale make per-sample gradients too
    large from the first step on, before any update; steps that are too large make
    them grow only with the updates. So the finding needs the fraction at or above
    the threshold in the first histogram, and no more than doubled in the next of
    the first ``edge_steps``: a fraction that starts below it or grows with the
    updates (as in a run whose learning rate blows it up) is the updates' doing,
    which ``step_size_too_large`` and ``exploding_gradients`` read, and rules the
    inputs out. A fraction that shrinks while the optimizer adapts (a ResNet on raw
    pixels: 1.1 %, 0.9 %, 0.5 %) does not. (Chosen on the validation's tuning
    runs; an earlier rule, every one of the first histograms above the threshold,
    missed the shrinking ones.)
    """

    check_id = "inputs_misscaled"

    def __init__(self, th: Thresholds):
        super().__init__(th)
        self.seen: list[tuple[int, float]] = []
        self.first_loss: float | None = None
        self.ruled_out = False

    def _add(self, step, signals):
        if self.first_loss is None and "loss" in signals:
            self.first_loss = signals["loss"]
        edge = signals.get("edge_fraction")
        if edge is None or self.ruled_out or len(self.seen) >= self.th.edge_steps:
            return None
        self.seen.append((step, edge))
        first = self.seen[0][1]
        if first < self.th.edge_fraction or edge > 2 * first:
            self.ruled_out = True  # not the inputs: see the class docstring
            return None
        if len(self.seen) < self.th.edge_steps:
            return None
        evidence: dict[str, Any] = {
            "edge_bin_fraction": [_round(v) for _, v in self.seen],
            "threshold": self.th.edge_fraction,
            "first_tracked_steps": [s for s, _ in self.seen],
        }
        if self.first_loss is not None:
            evidence["first_loss"] = _round(self.first_loss)
        later = ", ".join(f"{v:.1%}" for _, v in self.seen[1:])
        message = (
            f"From the start of the run {self.seen[0][1]:.1%} of the individual "
            "gradient elements lie beyond the gradient histogram's range (threshold "
            f"{self.th.edge_fraction:.0%}; then {later}, not grown by the first "
            "updates): per-sample gradients far larger than usual, the signature of "
            "inputs on a raw scale (e.g. pixels in [0, 255]) or, less often, of too "
            "large initial weights."
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
