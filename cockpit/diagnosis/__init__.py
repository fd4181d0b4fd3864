"""Diagnosis: what is wrong with a run, read off the quantities cockpit tracked.

The checks read per-step signals and return :class:`Finding` records (the docstring
of :mod:`~cockpit.diagnosis.checks` lists them and where each part lives);
:mod:`~cockpit.diagnosis.report` renders them as text, Markdown and JSON
(``cockpit report``). The names below are the package's public surface
(``from cockpit.diagnosis import diagnose``).
"""

from cockpit.diagnosis.checks import (
    CHECK_IDS,
    NOT_CHECKED,
    SEVERITIES,
    Finding,
    LiveDiagnosis,
    Signals,
    Thresholds,
    collect,
    diagnose,
    load_history,
    run_checks,
    settled,
    step_signals,
    worst,
)

__all__ = [
    "CHECK_IDS",
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
