"""The Diagnosis panel: the findings of the run, fitted to their gauge."""

from __future__ import annotations

import warnings
import weakref
from bisect import bisect_left, bisect_right
from typing import Any, Sequence

import matplotlib
from matplotlib.axes import Axes
from matplotlib.text import Text as MplText
from matplotlib.transforms import ScaledTranslation

from cockpit import diagnosis
from cockpit.log.files import open_log
from cockpit.plotting.data import DashboardData, as_data
from cockpit.plotting.drawers.common import Drawn, _several
from cockpit.plotting.runs import Run
from cockpit.plotting.style import (
    COLORS,
)

# --- the findings panel --------------------------------------------------------------
#: Colour of each severity's badge (``"ok"``: the badge of a healthy run).
SEVERITY_COLORS = {"error": COLORS["red"], "warning": COLORS["orange"],
                   "info": COLORS["gray"], "ok": COLORS["green"]}  # fmt: skip

# Per-step diagnosis signals of each DashboardData, so a live dashboard reads only
# the new steps: {"signals": {step: {signal: value}}, "first_seen": {key: step},
# "read": last step read, "result": ((read, upto, thresholds), findings)}.
_DIAGNOSIS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def diagnosis_findings(
    data: Any, upto: int | None = None, thresholds: Any = None
) -> list[diagnosis.Finding] | None:
    """:func:`cockpit.diagnosis.diagnose` of the run up to a step, read incrementally.

    Args:
        data: The run (see :mod:`cockpit.plotting.instruments`).
        upto: Diagnose only the steps up to this one.
        thresholds: :class:`cockpit.diagnosis.Thresholds` (default: its defaults).

    Returns:
        The findings (as ``diagnose`` orders them), or ``None`` without steps.
    """
    data = as_data(data)
    if data.last_step is None:
        return None
    cache = _DIAGNOSIS.setdefault(
        data, {"signals": {}, "first_seen": {}, "read": None, "result": None}
    )
    history = _whole_history(data, cache)
    steps = history.steps
    start = 0 if cache["read"] is None else bisect_left(steps, cache["read"])
    for step in steps[start : bisect_right(steps, data.last_step)]:
        values = history.view(step)
        cache["signals"][step] = diagnosis.step_signals(values)
        for key in values:
            cache["first_seen"].setdefault(key, step)
        cache["read"] = step
    token = (cache["read"], upto, thresholds)
    if cache["result"] is not None and cache["result"][0] == token:
        return cache["result"][1]
    signals = diagnosis.Signals()
    signals.keys.update(k for k, first in cache["first_seen"].items()
                        if upto is None or first <= upto)  # fmt: skip
    for step in sorted(cache["signals"]):
        if upto is not None and step > upto:
            break
        for signal, value in cache["signals"][step].items():
            signals.steps.setdefault(signal, []).append(step)
            signals.values.setdefault(signal, []).append(value)
    if upto is not None and not any(signals.steps.values()) and not signals.keys:
        return None
    findings = diagnosis.run_checks(signals, thresholds)
    cache["result"] = (token, findings)
    return findings


def _whole_history(data: DashboardData, cache: dict) -> Any:
    """The history the diagnosis reads: every step's values, as ``cockpit report``.

    Data read for drawing (:func:`~cockpit.plotting.data.read_log`, or a history
    of ``open_log(path, latest=True)`` as ``cockpit plot`` reads it) keep of each
    histogram only the latest, so the checks of the first steps (inputs on the
    wrong scale) would find nothing to read; their log is opened as
    :func:`cockpit.diagnosis.diagnose` opens it (histograms read back from the file
    step by step), so that the panel and the report say the same.
    """
    path = data.log
    if path is None and getattr(data.history, "mappings", None) == "latest":
        path = getattr(data.history, "path", None)  # open_log(..., latest=True)'s
    if path is None:
        return data.history
    if "whole" not in cache:
        with warnings.catch_warnings():  # a torn last line: warned about once,
            warnings.simplefilter("ignore")  # when the log was read for drawing
            cache["whole"] = open_log(path)
    return cache["whole"]


class FittedText(MplText):
    """A line of text fitted to its axes' width when drawn.

    The line shows the longest start of :attr:`full_text` that ends inside the
    axes. With a :attr:`follower` (the next line, drawn after this one) it breaks
    at a space and hands the rest over; the last line of a paragraph ends in "…"
    when cut. A line that would reach below the axes is not drawn.
    """

    def __init__(
        self,
        *args: Any,
        follower: FittedText | None = None,
        area: Any = None,
        **kwargs: Any,
    ):
        super().__init__(*args, **kwargs)
        self.full_text = self.get_text()
        self.follower = follower
        #: What the line must fit into (anything with a ``bbox``; default: its axes).
        self.area = area
        self.set_in_layout(False)  # the layout must not make room for long text

    def _fits(self, text: str, renderer, left: float, right: float) -> bool:
        self.set_text(text)
        extent = self.get_window_extent(renderer)
        return extent.x1 <= right and extent.x0 >= left

    def draw(self, renderer) -> None:  # noqa: D102 - an Artist's draw
        if not self.get_visible() or self.axes is None:
            return
        box = self.axes.bbox
        margin = renderer.points_to_pixels(4.0)
        width = (self.area or self.axes).bbox
        left, right = width.x0 + margin / 2, width.x1 - margin
        text, rest = self.full_text, ""
        if not self._fits(text, renderer, left, right):
            if self.follower is not None:  # break at the last space that fits
                cuts = [i for i, c in enumerate(text) if c == " "]
                fitting = [
                    i for i in cuts if self._fits(text[:i], renderer, left, right)
                ]
                cut = fitting[-1] if fitting else len(text)
                text, rest = text[:cut], text[cut:].strip()
            if rest == "" and not self._fits(text, renderer, left, right):
                keep, top = 0, len(text)
                while keep < top:  # the longest start that fits with "…"
                    middle = (keep + top + 1) // 2
                    if self._fits(text[:middle].rstrip() + "…", renderer, left, right):
                        keep = middle
                    else:
                        top = middle - 1
                text = text[:keep].rstrip() + "…"
        self.set_text(text)
        if self.follower is not None:
            self.follower.full_text = rest
        if not text or self.get_window_extent(renderer).y0 < box.y0 + margin / 2:
            return
        super().draw(renderer)


def _paragraph(
    ax: Axes, text: str, x: float, y: float, lines: int, step: float, **kwargs: Any
) -> float:
    """Up to ``lines`` fitted lines of ``text``, ``step`` points apart.

    The first line starts ``(x, y)`` points from the top left of ``ax``; returns
    the ``y`` below the last one.
    """
    made: list[FittedText] = []
    for index in range(lines):
        offset = ScaledTranslation(x / 72.0, (y - index * step) / 72.0,
                                   ax.figure.dpi_scale_trans)  # fmt: skip
        line = FittedText(0.0, 1.0, text if index == 0 else "", va="top",
                          ha="left", transform=ax.transAxes + offset,
                          **kwargs)  # fmt: skip
        if made:
            made[-1].follower = line
        ax.add_artist(line)
        made.append(line)
    return y - lines * step


def _step_range(steps: tuple[int, int]) -> str:
    first, last = steps
    return f"step {first}" if first == last else f"steps {first}–{last}"


#: Lines of text the findings panel plans for (the dashboard's bottom row); more
#: findings get fewer lines each.
PANEL_LINES = 11


def _finding_rows(run: Run, findings, options) -> tuple[list, dict]:
    """``[(badge, headline, detail)]`` of one run, and the checks it could not run."""
    found = [f for f in findings if f.id != diagnosis.NOT_CHECKED]
    skipped = [f for f in findings if f.id == diagnosis.NOT_CHECKED]
    checks = dict(skipped[0].evidence.get("checks", {})) if skipped else {}
    rows: list[tuple[str, str, str]] = []
    if not any(f.severity != "info" for f in found):
        data = run.data
        steps = [s for s in data.history.steps if s <= data.last_step
                 and (options["upto"] is None or s <= options["upto"])]  # fmt: skip
        ran = [c for c in diagnosis.CHECK_IDS if c not in checks]
        span = _step_range((steps[0], steps[-1]))
        detail = f"{len(ran)} of {len(diagnosis.CHECK_IDS)} checks ran on {span}: "
        detail += ", ".join(ran)
        rows.append(("ok", "no problems found", detail))
    for finding in found:
        headline = f"{finding.id}  ·  {_step_range(finding.steps)}"
        rows.append((finding.severity, headline, finding.message))
    return rows, checks


def draw_findings(ax, runs: Sequence[Run], gauge, keys, options) -> Drawn:
    """The diagnosis' findings, most severe first: a badge, a headline, the message.

    Several runs: a header per run (its name in its colour), then its findings.
    """
    several = _several(runs)
    found = []
    for run in runs:
        findings = diagnosis_findings(run.data, options["upto"], options["thresholds"])
        if findings is not None:
            found.append((run, *_finding_rows(run, findings, options)))
    if not found:
        return set()
    ax.set(xlim=(0, 1), ylim=(0, 1), xticks=[], yticks=[])
    ax.grid(False)
    count = sum(len(rows) for _, rows, _ in found)
    checks_lines = sum(1 for _, _, checks in found if checks)
    headers = len(found) if several else 0
    if PANEL_LINES - checks_lines - count - headers < 0:  # findings first
        found = [(run, rows, {}) for run, rows, _ in found]
        checks_lines = 0
    budget = PANEL_LINES - checks_lines - count - headers
    detail_lines = max(0, min(3, budget // max(count, 1)))  # none if short of room
    y = -5.0
    for run, rows, checks in found:
        if several:
            _paragraph(ax, run.label, 6, y, 1, 0, fontsize=7.5, fontweight="bold",
                       color=run.color)  # fmt: skip
            ax.texts[-1].set_gid(run.gid)
            y -= 11.5
        for badge, headline, detail in rows:
            label = {"warning": "WARN"}.get(badge, badge.upper())
            _paragraph(ax, label, 6, y - 1, 1, 0, fontsize=6, fontweight="bold",
                       color="white", bbox={"boxstyle": "round,pad=0.25", "lw": 0,
                                            "fc": SEVERITY_COLORS[badge]})  # fmt: skip
            text = headline if detail_lines else f"{headline}:  {detail}"
            y = _paragraph(ax, text, 42, y, 1, 11.5, fontsize=7.5, fontweight="bold",
                           color=COLORS["dark"])  # fmt: skip
            if detail_lines:
                y = _paragraph(ax, detail, 42, y, detail_lines, 10, fontsize=7,
                               color=COLORS["dark"]) - 3.5  # fmt: skip
        if checks:
            needs = "; ".join(f"{c} (needs {need})" for c, need in checks.items())
            y = _paragraph(ax, f"not checked: {needs}", 6, y - 2, 1, 11, fontsize=6.8,
                           color=COLORS["gray"], style="italic")  # fmt: skip
        y -= 3
    return {run.index for run, _, _ in found}


def fitted_caption(ax: Axes, title: str, caption: str) -> None:
    """The title with a small gray line under it that says how to read the gauge.

    The line may use the width of the gauge's panel (its subfigure) and is cut
    with "…" where that is narrower (it never runs into its neighbours' titles).
    """
    size = 6.5
    ax.set_title(title, pad=matplotlib.rcParams["axes.titlepad"] + 1.35 * size + 1)
    offset = ScaledTranslation(0, 2.5 / 72.0, ax.figure.dpi_scale_trans)
    text = FittedText(0.5, 1.0, caption, ha="center", va="bottom", fontsize=size,
                      color=COLORS["dark"], style="italic",
                      transform=ax.transAxes + offset, clip_on=False,
                      area=ax.get_figure(root=False))  # fmt: skip
    ax.add_artist(text)
