"""Whole-run evidence and the entry points: :func:`run_checks`, :func:`diagnose`.

The whole-run checks hold only once the run is over (medians over the run, "the
loss has stopped improving"); :func:`run_checks` joins them with the settled
evidence the detectors replay over the whole history.
"""

from __future__ import annotations

import math
import os
from typing import Any, Callable, Iterable

import numpy as np

from cockpit.diagnosis.detectors import DETECTORS, _small_message
from cockpit.diagnosis.evidence import (
    _ADVICE,
    _ALPHA_MEANING,
    _fewest,
    _finding,
    _finite,
    _lr_note,
    _Outcome,
    _round,
    _running_median,
    _went_nonfinite,
    _window,
)
from cockpit.diagnosis.findings import (
    CHECK_IDS,
    NOT_CHECKED,
    SEVERITIES,
    Finding,
    Thresholds,
)
from cockpit.diagnosis.signals import Signals
from cockpit.history import History
from cockpit.log.files import open_log


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
