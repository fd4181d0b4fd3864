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

Where each part lives: :mod:`~cockpit.diagnosis.findings` (records, thresholds),
:mod:`~cockpit.diagnosis.signals`, :mod:`~cockpit.diagnosis.detectors` (settled),
:mod:`~cockpit.diagnosis.whole_run` (whole-run checks, :func:`diagnose`) and
:mod:`~cockpit.diagnosis.live`. This module re-exports them.

The thresholds (:class:`Thresholds`) were chosen on one set of runs and validated
on another (``python -m benchmarks.diagnosis_validation``; ``docs/diagnosis.md``).
"""

from cockpit.diagnosis.detectors import DETECTORS
from cockpit.diagnosis.findings import (
    CHECK_IDS,
    NOT_CHECKED,
    SEVERITIES,
    Finding,
    Thresholds,
)
from cockpit.diagnosis.live import LiveDiagnosis
from cockpit.diagnosis.signals import Signals, step_signals
from cockpit.diagnosis.whole_run import (
    collect,
    diagnose,
    load_history,
    run_checks,
    settled,
    worst,
)

__all__ = [
    "CHECK_IDS",
    "DETECTORS",
    "Finding",
    "LiveDiagnosis",
    "NOT_CHECKED",
    "SEVERITIES",
    "Signals",
    "Thresholds",
    "collect",
    "diagnose",
    "load_history",
    "run_checks",
    "settled",
    "step_signals",
    "worst",
]
