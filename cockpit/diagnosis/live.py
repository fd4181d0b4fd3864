"""The live diagnosis: settled evidence announced while the run trains."""

from __future__ import annotations

import sys
import warnings
from typing import Any, Mapping, Sequence

from cockpit.diagnosis.detectors import DETECTORS
from cockpit.diagnosis.findings import SEVERITIES, Finding, Thresholds
from cockpit.diagnosis.signals import step_signals
from cockpit.errors import CockpitWarning


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
