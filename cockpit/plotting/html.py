"""The dashboard as one interactive HTML file: zoom, pan, hover, runs on and off.

:meth:`CockpitPlotter.write_html <cockpit.plotting.CockpitPlotter.write_html>`
(``cockpit plot LOG... --html out.html``) writes the gauges of the PNG
dashboard, laid out as there (only what was tracked), for one run or several
side by side, into a single file that needs no server and no network: the data
(:func:`payload`, JSON), the plotting library uPlot (MIT, inlined from
``cockpit/plotting/vendor``) and the page's own script
(``cockpit/plotting/web/dashboard.js``) are all inside.

In the page: drag across a gauge to zoom into those steps (every gauge drawn
against the iteration follows), the mouse wheel zooms around the pointer,
shift + wheel (or a horizontal wheel) pans, a double click shows all steps again;
hovering shows the values of the nearest step of every run; the run boxes at the
top switch runs on and off; the diagnosis panel shows each finding with its
evidence and advice. Non-finite steps are shaded red as on the PNG.

Series are sent at full resolution up to :data:`MAX_HTML_POINTS` points each
(longer ones keep each stretch's extremes, as the PNG does), with six significant
digits; histograms as the latest of each (as the PNG draws them).
"""

from __future__ import annotations

import html as html_text
import json
import math
import os
import re
from importlib import resources
from typing import Any, Mapping, Sequence

import numpy as np

from cockpit.log.format import decode
from cockpit.plotting import instruments
from cockpit.plotting.data import extremes_index
from cockpit.plotting.drawers import diagnosis_findings, element_series, nonfinite_spans
from cockpit.plotting.runs import Run

#: Most points a series keeps in the HTML file (longer series are thinned to the
#: extremes of equal stretches, so spikes stay).
MAX_HTML_POINTS = 20_000

#: Significant digits of the values written.
DIGITS = 6

#: Histogram steps the file holds per key (spread over the run; the slider's
#: steps).
HIST_STEPS = 120

#: ``id`` of the ``<script type="application/json">`` element holding the data.
DATA_ID = "cockpit-data"


def _rounded(values: np.ndarray) -> list:
    """Floats with :data:`DIGITS` significant digits (``None`` for non-finite)."""
    return [float(f"{v:.{DIGITS}g}") if math.isfinite(v) else None for v in values]


def _series(run: Run, key: str, reduce: str, upto: int | None) -> dict | None:
    series = run.data.series(key, reduce)
    if not len(series):
        return None
    steps, values, _, errors = series.view_errors(upto, max_points=None)
    if not len(steps):
        return {"steps": [], "values": []}
    index = extremes_index(values, MAX_HTML_POINTS)
    found = {"steps": steps[index].tolist(), "values": _rounded(values[index])}
    if np.isfinite(errors).any():
        found["errors"] = _rounded(errors[index])
    return found


def _histogram(entry: Any, step: int, axes: int = 1) -> dict:
    """A histogram's counts and edges (``axes`` edge arrays for a 2-D one)."""
    edges = entry["edges"]
    if axes == 1:
        edges = np.asarray(edges, dtype=float).tolist()
    else:
        edges = [np.asarray(e, dtype=float).tolist() for e in edges]
    return {
        "step": int(step),
        "hist": np.asarray(entry["hist"], dtype=float).tolist(),
        "edges": edges,
    }


def gauge_series(name: str) -> list[tuple[str, str]]:
    """``(key, reduction)`` of every series a gauge draws against the iteration."""
    gauge = instruments.GAUGES[name]
    keys = {role: key for role, key, _ in gauge.keys}
    if gauge.kind == "tests":
        return [(key, "scalar") for key in keys.values()]
    if gauge.kind == "performance":
        return [(k, "scalar") for k in instruments.gauge_reads(gauge, keys)]
    if gauge.kind == "learning_rates":
        return [(keys["key"], "scalar")]
    return [(keys[line.role], line.reduce) for line in gauge.lines]


def _run_payload(run: Run, layout: tuple, upto: int | None) -> dict:
    """What the page draws of one run."""
    primary, bottom, aux, layers = layout
    names = [n for _, gauges in primary for n in gauges] + list(bottom) + list(aux)
    series: dict[str, dict] = {}
    for name in names:
        for key, reduce in gauge_series(name):
            found = _series(run, key, reduce, upto)
            if found is not None:
                series[f"{key}|{reduce}"] = found
    for k, element in enumerate(element_series(run.data, "learning_rates")):
        steps, values, _ = element.view(upto, max_points=MAX_HTML_POINTS)
        series[f"learning_rates#{k}"] = {"steps": steps.tolist(),
                                         "values": _rounded(values)}  # fmt: skip
    alpha = run.data.series("Alpha")
    if len(alpha):
        steps, values, _ = alpha.view(upto, max_points=None)
        series["Alpha|sample"] = {"steps": steps.tolist(), "values": _rounded(values)}
    latest = {}
    for key in ("GradHist1d", "GradHist2d"):
        found = run.data.latest(key, upto)
        if found is None:
            continue
        step, value = found
        if key == "GradHist1d":
            latest[key] = _histogram(value, step)
        else:
            latest[key] = {"all": _histogram(value, step, 2)}
            for name, entry in value.items():
                if name.startswith("param_") and isinstance(entry, Mapping):
                    latest[key][name] = _histogram(entry, step, 2)
    findings = diagnosis_findings(run.data, upto) or []
    steps = [s for s in run.data.history.steps if upto is None or s <= upto]
    return {
        "label": run.label,
        "color": run.color or "#2f6db3",
        "first_step": int(steps[0]) if steps else None,
        "last_step": int(steps[-1]) if steps else None,
        "steps": len(steps),
        "status": "finished",
        "series": series,
        "hists": _snapshots(run.data.history, steps),
        "latest": latest,
        "nonfinite": [list(span) for span in nonfinite_spans(run.data, upto)],
        "findings": [f.to_dict() for f in findings],
        "diagnosis": "report",
        "config": run_config(run.label, run.data.history.keys, _first_rates(run)),
    }


def _first_rates(run: Run) -> list[float] | None:
    for step in run.data.history.steps:
        rates = run.data.history.view(step).get("learning_rates")
        if rates is not None:
            try:
                return [float(x) for x in np.asarray(rates, dtype=float).ravel()]
            except (TypeError, ValueError):
                return None
    return None


def _snapshots(history: Any, steps: Sequence[int]) -> dict:
    """Histograms at up to :data:`HIST_STEPS` steps spread over the run (and the last).

    ``{key: {"from": 0, "items": [{"step", "hist", "edges"}, ...]}}``; a 2-D
    histogram by its whole-network part.
    """
    found = {}
    for key in ("GradHist1d", "GradHist2d"):
        have = [s for s in steps if key in history.view(s)]
        if not have:
            continue
        pick = sorted(set(np.linspace(0, len(have) - 1, min(len(have), HIST_STEPS))
                          .round().astype(int).tolist()))  # fmt: skip
        items = []
        for index in pick:
            entry = histogram_entry(have[index], history.view(have[index])[key])
            if entry is not None:
                items.append(entry)
        found[key] = {"from": 0, "items": items}
    return found


def _hist_entry(entry: Any) -> dict | None:
    """``{"hist", "edges"}`` of a decoded histogram entry (``None``: not one)."""
    if not isinstance(entry, Mapping) or "hist" not in entry or "edges" not in entry:
        return None
    try:
        hist = np.asarray(entry["hist"], dtype=float)
        edges = entry["edges"]
        if hist.ndim == 1:
            edges = np.asarray(edges, dtype=float).tolist()
        else:
            edges = [np.asarray(e, dtype=float).tolist() for e in edges]
    except (TypeError, ValueError):
        return None
    hist = np.where(np.isfinite(hist), hist, 0.0)
    return {"hist": hist.tolist(), "edges": edges}


def histogram_entry(step: int, value: Any) -> dict | None:
    """A histogram value (decoded or as stored) as the page draws it.

    A 2-D one keeps its whole-network histogram (``"all"``); the per-parameter
    ones are sent for the latest step only.
    """
    value = decode(value) if isinstance(value, Mapping) else value
    found = _hist_entry(value)
    if found is None:
        return None
    found["step"] = int(step)
    return found


def run_config(label: str, keys: Sequence[str], rates: Sequence[float] | None) -> dict:
    """What a log tells of a run's set-up, shown side by side on the page.

    ``name=value`` parts of the run's name (``runs/lr=0.1,bs=32/log``: how runs
    are commonly named), the first learning rate(s) the log holds, and the
    quantities it tracked.
    """
    found: dict[str, Any] = {}
    for part in label.replace("\\", "/").split("/"):
        for token in re.split(r"[,_ ]", part):
            name, sep, value = token.partition("=")
            if sep and name:
                found[name] = _parsed(value)
    if rates:
        found.setdefault("learning rate", rates[0] if len(rates) == 1 else list(rates))
    found["quantities"] = sorted(
        k for k in keys
        if k not in ("nonfinite", "learning_rates", "missing")
        and not k.endswith("_estimate")
    )  # fmt: skip
    return found


def _parsed(text: str) -> Any:
    try:
        number = float(text)
    except ValueError:
        return text
    if not math.isfinite(number):
        return text
    return int(number) if number.is_integer() and "." not in text else number


def _gauge_payload(name: str) -> dict:
    gauge = instruments.GAUGES[name]
    title = gauge.title
    if callable(title):
        title = title({"param": None, "key": ""})
    keys = {role: key for role, key, _ in gauge.keys}
    lines = [
        {"key": keys[line.role], "reduce": line.reduce, "label": line.label,
         "twin": line.twin, "log": line.log, "steps": line.steps,
         "color": line.color}
        for line in gauge.lines
    ]  # fmt: skip
    return {
        "name": name,
        "title": title,
        "kind": gauge.kind,
        "caption": gauge.caption,
        "keys": keys,
        "lines": lines,
        "ylabel": gauge.ylabel,
        "twin_ylabel": gauge.twin_ylabel,
        "reference": gauge.reference,
        "options": {
            k: v
            for k, v in gauge.options.items()
            if isinstance(v, (int, float, str, list, tuple))
        },  # fmt: skip
    }


def payload(
    runs: Sequence[Run],
    layout: tuple,
    title: str,
    upto: int | None = None,
    left_out: Sequence[tuple[str, str]] = (),
) -> dict:
    """The data of the HTML dashboard (JSON-safe).

    Args:
        runs: The runs (one without a colour, or several with one each).
        layout: :meth:`CockpitPlotter.layout
            <cockpit.plotting.CockpitPlotter.layout>` of the runs.
        title: The page's title.
        upto: Ignore steps after this one.
        left_out: ``(title, what to track)`` of the gauges left out.

    Returns:
        ``{"title", "layout", "gauges", "runs", "left_out", "checks"}``.
    """
    several = len(runs) > 1 or runs[0].color is not None
    found = frame(layout, title, several, left_out)
    found["runs"] = [_run_payload(run, layout, upto) for run in runs]
    return found


def frame(layout: tuple, title: str, several: bool, left_out: Sequence = ()) -> dict:
    """Everything of :func:`payload` but the runs: the gauges and their layout."""
    from cockpit import diagnosis

    primary, bottom, aux, layers = layout
    names = [n for _, gauges in primary for n in gauges] + list(bottom) + list(aux)
    if layers:
        names.append("hist_2d")
    return {
        "title": title,
        "several": several,
        "layout": {
            "primary": [[panel, list(gauges)] for panel, gauges in primary],
            "bottom": list(bottom),
            "aux": list(aux),
            "layers": bool(layers),
        },
        "gauges": {name: _gauge_payload(name) for name in dict.fromkeys(names)},
        "runs": [],
        "left_out": [list(item) for item in left_out],
        "checks": list(diagnosis.CHECK_IDS),
    }


def _asset(folder: str, name: str) -> str:
    return (resources.files("cockpit.plotting") / folder / name).read_text("utf-8")


def render(data: dict) -> str:
    """The HTML page of :func:`payload`'s data: one file, no outside resources."""
    text = json.dumps(data, separators=(",", ":"), allow_nan=False)
    text = text.replace("</", "<\\/")  # never closes the script element early
    title = html_text.escape(data["title"])
    return "\n".join(
        [
            "<!DOCTYPE html>",
            '<html lang="en"><head><meta charset="utf-8">',
            '<meta name="viewport" content="width=device-width, initial-scale=1">',
            f"<title>{title}</title>",
            "<style>",
            _asset("vendor", "uPlot.min.css"),
            _asset("web", "dashboard.css"),
            "</style>",
            "<!-- uPlot 1.6.32, https://github.com/leeoniya/uPlot, MIT licence: -->",
            "<!-- " + _asset("vendor", "uPlot.LICENSE").replace("--", "- -") + " -->",
            "<script>",
            _asset("vendor", "uPlot.iife.min.js"),
            "</script>",
            "</head><body>",
            f'<script type="application/json" id="{DATA_ID}">{text}</script>',
            "<script>",
            _asset("web", "dashboard.js"),
            "</script>",
            "</body></html>",
            "",
        ]
    )


def save_page(text: str, path: str | os.PathLike) -> str:
    """Write the page to ``path`` (parents created) and return the path."""
    path = os.fspath(path)
    parent = os.path.dirname(path)
    if parent:
        os.makedirs(parent, exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(text)
    return path
