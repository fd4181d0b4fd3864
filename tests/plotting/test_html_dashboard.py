"""The HTML dashboard, opened in headless Chromium (Debian's ``chromium`` package).

The page is one file: no request leaves it (the browser runs with networking off
and the page names no outside resource). In the browser: no console error or
uncaught exception, both runs drawn (their colours are in the screenshot, their
series shown on every gauge), hovering a point shows its value, a run switched
off disappears, a drag-zoom on one gauge zooms every gauge drawn against steps.
Skipped, with the reason, where Chromium is not installed (``.ci/run`` installs
it).
"""

from __future__ import annotations

import csv
import io
import json
import math
import re

import matplotlib.image
import numpy as np
import pytest

from cockpit.history import History
from cockpit.plotting import CockpitPlotter
from cockpit.plotting.html import DATA_ID
from tests.utils.browser import Browser, find_chromium

pytestmark = pytest.mark.skipif(
    find_chromium() is None,
    reason="chromium is not installed (Debian: apt-get install -y chromium; "
    ".ci/run installs it)",
)


def _run(seed: int, steps: int, scale: float) -> History:
    rng = np.random.default_rng(seed)
    history = History()
    for t in range(steps):
        history.add(t, "Loss", float(scale * math.exp(-t / 15) + 0.05 * rng.random()))
        history.add(t, "GradNorm", list(scale * rng.random(2) + 0.1))
        history.add(t, "Alpha", float(rng.normal(0.2 * scale, 0.3)))
        history.add(t, "learning_rates", [0.1 * scale])
        history.add(t, "NormTest", float(0.5 + rng.random()))
        edges = np.linspace(-1, 1, 31)
        counts = np.histogram(rng.normal(0, 0.3 * scale, 300), edges)[0]
        history.add(t, "GradHist1d", {"hist": counts.astype(float), "edges": edges})
    if scale > 1:
        for t in range(steps - 5, steps):
            history.add(t, "nonfinite", ["loss"])
    return history


@pytest.fixture(scope="module")
def chromium():
    """One browser for the module."""
    with Browser(width=1600, height=1100) as browser:
        yield browser


@pytest.fixture(scope="module")
def page(tmp_path_factory, chromium):
    """Two runs in one page, opened in Chromium; the browser for the tests."""
    folder = tmp_path_factory.mktemp("html")
    plotter = CockpitPlotter()
    plotter.load([_run(1, 60, 1.0), _run(2, 50, 2.0)], labels=["small", "large"])
    path = plotter.write_html(folder / "runs.html")
    chromium.open(f"file://{path}")
    yield chromium, path, plotter, folder


def _colour_pixels(png: bytes, colour: str) -> int:
    image = matplotlib.image.imread(io.BytesIO(png))[..., :3]
    rgb = np.array([int(colour[i : i + 2], 16) for i in (1, 3, 5)]) / 255.0
    return int(np.sum(np.all(np.abs(image - rgb) < 0.06, axis=-1)))


def test_the_page_is_one_file_that_names_no_outside_resource(page):
    _, path, plotter, _ = page
    text = open(path, encoding="utf-8").read()
    assert not re.search(r"<(script|link|img)[^>]+(src|href)=", text)
    data = json.loads(re.search(rf'id="{DATA_ID}">(.*?)</script>', text, re.S)[1])
    assert [run["label"] for run in data["runs"]] == ["small", "large"]
    assert data["layout"]["primary"] == [
        [panel, list(names)] for panel, names in plotter.layout()[0]
    ]


def test_no_errors_both_runs_visible_and_hover_shows_the_value(page):
    browser, _, plotter, folder = page
    assert browser.evaluate("typeof window.cockpit") == "object"
    png = browser.screenshot(folder / "runs.png")
    assert browser.errors() == []
    colours = [run.color for run in plotter.runs]
    for colour in colours:  # each run's colour covers part of the page
        assert _colour_pixels(png, colour) > 500, colour
    shown = browser.evaluate(
        "cockpit.plots.map(p => p.owners.filter(o => p.u.series[o[0]].show)"
        ".map(o => o[1]))"
    )
    assert sum(1 for runs in shown if {0, 1} <= set(runs)) >= 4  # gauges with both
    # hover a point of the second run: the tip names the run, the step and value
    step = 30
    value = float(plotter.runs[1].data.series("GradNorm", "norm").values[step])
    point = browser.evaluate(f'cockpit.pointAt("grad_norm", 1, {step})')
    assert point["value"] == pytest.approx(value, rel=1e-5)
    browser.move_mouse(point["x"], point["y"])
    tip = browser.evaluate('document.getElementById("cockpit-tip").innerText')
    lines = [line for line in tip.splitlines() if line.startswith("large")]
    assert lines and f"step {step}" in lines[0], tip
    shown_value = float(lines[0].rsplit(" ", 1)[1])
    assert shown_value == pytest.approx(value, rel=1e-5)
    assert browser.errors() == []


def test_runs_switch_off_and_zoom_is_shared(page):
    browser, _, plotter, folder = page
    browser.evaluate('document.querySelector("input[data-run=\\"1\\"]").click()')
    png = browser.screenshot(folder / "one_run.png")
    # the run is gone: its colour is left on its toggle's swatch (56 pixels) only
    assert _colour_pixels(png, plotter.runs[1].color) <= 60
    assert _colour_pixels(png, plotter.runs[0].color) > 500
    browser.evaluate('document.querySelector("input[data-run=\\"1\\"]").click()')
    browser.evaluate('cockpit.stepPlots[0].u.setScale("x", {min: 10, max: 20})')
    ranges = browser.evaluate(
        "cockpit.stepPlots.map(p => [p.u.scales.x.min, p.u.scales.x.max])"
    )
    assert len(ranges) >= 4 and all(r == [10, 20] for r in ranges)
    assert browser.errors() == []


# --- the explorer: what a user comparing runs needs (issue 42) ----------------------
def _diverged(steps: int = 40, blow_up: int = 30) -> History:
    """A run that diverges at ``blow_up``, as ``cockpit demo --lr 3`` records it.

    Its gradient norm grows a hundredfold per step, then the loss and the
    gradients are NaN: the gradient histogram of those steps counts no element
    (every element was NaN; cockpit's histogram keeps finite elements only) and
    the steps carry a ``nonfinite`` record. The distance from the start grows
    over six decades, the update size over four (a log twin axis).
    """
    rng = np.random.default_rng(3)
    history = History()
    edges = np.linspace(-2, 2, 41)
    for t in range(steps):
        bad = t >= blow_up
        norm = 0.5 * (100.0 ** max(0, t - blow_up + 4)) if t < blow_up else math.nan
        history.add(
            t, "Loss", math.nan if bad else float(100 * math.exp(-t / 4) + 0.01)
        )
        history.add(t, "GradNorm", [norm, norm])
        history.add(t, "Distance", [1e-6 * 10 ** (t / 6)] * 2)
        history.add(t, "UpdateSize", [1e-5 * 10 ** (t / 10)] * 2)
        counts = (
            np.zeros(40) if bad else np.histogram(rng.normal(0, 0.3, 500), edges)[0]
        )
        history.add(t, "GradHist1d", {"hist": counts.astype(float), "edges": edges})
        history.add(t, "learning_rates", [3.0])
        if bad:
            history.add(t, "nonfinite", ["loss", "gradients"])
    return history


def _healthy(seed: int, steps: int = 40) -> History:
    rng = np.random.default_rng(seed)
    history = History()
    edges = np.linspace(-2, 2, 41)
    for t in range(steps):
        history.add(t, "Loss", float(math.exp(-t / 10) + 0.05 * rng.random()))
        history.add(t, "GradNorm", list(0.5 + 0.1 * rng.random(2)))
        history.add(t, "Distance", [0.01 * (t + 1)] * 2)
        history.add(t, "UpdateSize", [0.01 + 0.001 * rng.random()] * 2)
        counts = np.histogram(rng.normal(0, 0.1 + 0.01 * t, 500), edges)[0]
        history.add(t, "GradHist1d", {"hist": counts.astype(float), "edges": edges})
        history.add(t, "learning_rates", [0.1])
    return history


@pytest.fixture(scope="module")
def explorer(tmp_path_factory, chromium):
    """A diverged run next to two healthy ones (named as sweeps name runs)."""
    folder = tmp_path_factory.mktemp("explorer")
    plotter = CockpitPlotter()
    plotter.load([_diverged(), _healthy(1), _healthy(2)],
                 labels=["lr=3,bs=32", "lr=0.1,bs=32", "lr=0.1,bs=64"])  # fmt: skip
    path = plotter.write_html(folder / "explorer.html")
    chromium.open(f"file://{path}")
    chromium.evaluate("document.querySelector('#cockpit-filter') !== null")
    yield chromium, plotter, folder
    assert chromium.errors() == []


def _reset(browser) -> None:
    browser.evaluate(
        "(() => { const u = cockpit.ui; u.zoom = null; u.histStep = null;"
        " u.full = null; u.charts = {}; u.smoothing = 'fit'; u.filter = '';"
        " cockpit.runs().forEach((r, i) => { cockpit.shown[i] = true; });"
        " cockpit.render(); return true; })()"
    )


def _single(tmp_path, chromium, history, name="single.html"):
    plotter = CockpitPlotter()
    plotter.load(history)
    path = plotter.write_html(tmp_path / name)
    chromium.open(f"file://{path}")
    return plotter


def test_all_zero_histogram_of_a_diverged_step_is_no_finite_value(tmp_path, chromium):
    _single(tmp_path, chromium, _diverged())
    box = "document.querySelector('[data-gauge=hist_1d]')"
    # the latest histogram counts no element: said, not drawn as a bar
    assert chromium.evaluate(f"{box}.querySelector('canvas') === null")
    text = chromium.evaluate(f"{box}.innerText")
    assert "no finite value at step 39" in text, text
    # the slider goes back to a step before the divergence: drawn, with counts
    steps = chromium.evaluate(
        "(() => { const s = document.querySelector('.slider input');"
        " s.value = 10; s.dispatchEvent(new Event('change'));"
        " return cockpit.ui.histStep; })()"
    )
    assert steps is not None and steps < 30
    drawn = chromium.evaluate("cockpit.gauges.hist_1d.parts[0]")
    assert drawn["step"] == steps and sum(drawn["values"]) == 500
    assert chromium.errors() == []


def _tick_labels(browser, gauge: str, axis: int) -> list:
    return browser.evaluate(f"cockpit.gauges[{gauge!r}].u.axes[{axis}]._values || []")


def test_log_axes_label_their_ticks_and_stay_sparse(tmp_path, chromium):
    _single(tmp_path, chromium, _diverged())
    # the loss falls over four decades: a log axis whose every tick is labelled
    assert chromium.evaluate("cockpit.gauges.performance.u.scales.y.distr") == 3
    labels = _tick_labels(chromium, "performance", 1)
    assert len(labels) >= 3 and all(label not in ("", "–") for label in labels), labels
    # Distance: both axes log; a handful of labelled ticks, not a column of marks
    for axis in (1, 2):
        splits = chromium.evaluate(f"cockpit.gauges.distance.u.axes[{axis}]._splits")
        labels = _tick_labels(chromium, "distance", axis)
        assert 2 <= len(splits) <= 8, splits
        assert all(label not in ("", "–") for label in labels), labels
    # ... and the labels leave room for the axis title: the axis is wider than
    # its widest label plus the title's line
    fits = chromium.evaluate(
        "(() => { const u = cockpit.gauges.distance.u;"
        " const ctx = document.createElement('canvas').getContext('2d');"
        " ctx.font = u.axes[1].font[0];"
        " return [1, 2].map(i => [u.axes[i]._size,"
        "   Math.max(...u.axes[i]._values.map(v => ctx.measureText(v).width))"
        "   + u.axes[i].labelSize]); })()"
    )
    for size, needed in fits:
        assert size >= needed, fits


def test_a_diverged_run_is_clipped_with_a_marker_not_squashing_the_others(explorer):
    browser, plotter, _ = explorer
    _reset(browser)
    healthy = max(
        float(np.max(run.data.series("GradNorm", "norm").values))
        for run in plotter.runs[1:]
    )
    top = browser.evaluate("cockpit.gauges.grad_norm.u.scales.y.max")
    assert top < 20 * healthy, (top, healthy)  # the diverged run reaches 1e8
    assert browser.evaluate("cockpit.gauges.grad_norm.clipped") >= 1
    # "ignore outliers" narrows further; "log" switches the axis
    browser.evaluate("cockpit.ui.charts.grad_norm = {outliers: true}; cockpit.render()")
    assert browser.evaluate("cockpit.gauges.grad_norm.u.scales.y.max") <= top
    distr = browser.evaluate("cockpit.gauges.grad_norm.u.scales.y.distr")
    browser.evaluate(
        "document.querySelector('[data-gauge=grad_norm] .tools button').click()"
    )
    assert browser.evaluate("cockpit.gauges.grad_norm.u.scales.y.distr") != distr


def test_hover_shows_values_in_every_step_panel(explorer):
    browser, plotter, _ = explorer
    _reset(browser)
    point = browser.evaluate('cockpit.pointAt("grad_norm", 1, 20)')
    browser.move_mouse(point["x"], point["y"])
    readouts = browser.evaluate(
        "cockpit.stepPlots.map(p => [p.name, p.readout ? p.readout.innerText : null])"
    )
    assert len(readouts) >= 4
    for name, text in readouts:
        assert text and "step 20" in text, (name, text)
    value = float(plotter.runs[1].data.series("Loss").values[20])
    loss = dict(readouts)["performance"]
    assert f"{value:.6g}"[:5] in loss.replace(" ", ""), loss
    browser.move_mouse(1, 1)


def test_histogram_follows_the_zoom_and_the_slider(explorer):
    browser, _, _ = explorer
    _reset(browser)
    legend = "document.querySelector('[data-gauge=hist_1d] .legend').innerText"
    assert "step 39" in browser.evaluate(legend)
    browser.evaluate('cockpit.stepPlots[0].u.setScale("x", {min: 5, max: 17})')
    browser.evaluate("cockpit.render()")
    shown = browser.evaluate("cockpit.gauges.hist_1d.parts.map(p => p.step)")
    assert shown and all(step <= 17 for step in shown), shown
    assert browser.evaluate("cockpit.steps()") == [5, 17]  # the zoom is kept
    browser.evaluate(
        "(() => { const s = document.querySelector("
        "'[data-gauge=hist_1d] .slider input'); s.value = 2;"
        " s.dispatchEvent(new Event('change')); })()"
    )
    chosen = browser.evaluate("cockpit.ui.histStep")
    assert (
        browser.evaluate("cockpit.gauges.hist_1d.parts.map(p => p.step)")
        == [chosen] * 3
    )


def test_run_table_config_side_by_side_and_filter(explorer):
    browser, _, _ = explorer
    _reset(browser)
    header = browser.evaluate(
        "[...document.querySelectorAll('.runtable th')].map(t => t.innerText)"
    )
    assert {"lr", "bs", "learning rate", "quantities"} <= set(header), header
    rows = browser.evaluate(
        "[...document.querySelectorAll('.runtable tr[data-row]')].map(tr =>"
        " [...tr.children].map(td => td.innerText))"
    )
    lr, bs = header.index("lr"), header.index("bs")
    assert [(r[lr], r[bs]) for r in rows] == [("3", "32"), ("0.1", "32"), ("0.1", "64")]
    visible = browser.evaluate(
        "(() => { const f = document.getElementById('cockpit-filter');"
        " f.value = 'bs=64'; f.dispatchEvent(new Event('input'));"
        " return [...document.querySelectorAll('.runtable tr[data-row]')]"
        ".filter(tr => tr.style.display !== 'none').map(tr => tr.dataset.row); })()"
    )
    assert visible == ["2"]
    browser.evaluate(
        "[...document.querySelectorAll('.runtable button')]"
        ".find(b => b.innerText === 'hide matching').click()"
    )
    assert browser.evaluate("cockpit.shown") == [True, True, False]


def test_smoothing_full_screen_and_downloads(explorer):
    browser, plotter, _ = explorer
    _reset(browser)
    trend = "cockpit.gauges.performance.u.data[4].filter(v => v != null)"  # run 1
    fit = browser.evaluate(trend)
    browser.evaluate(
        "(() => { const s = document.getElementById('cockpit-smoothing');"
        " s.value = 'ema'; s.dispatchEvent(new Event('change')); })()"
    )
    smooth = browser.evaluate(trend)
    loss = plotter.runs[1].data.series("Loss").values
    expected, last = [], 0.0
    for count, value in enumerate(loss[:5], start=1):  # debiased EMA, weight 0.6
        last = 0.6 * last + 0.4 * value
        expected.append(last / (1 - 0.6**count))
    assert smooth[:5] == pytest.approx(expected, rel=1e-5)
    assert smooth != fit
    browser.evaluate(
        "document.querySelector('[data-gauge=grad_norm] .tools button[title^=full]')"
        ".click()"
    )
    box = browser.evaluate(
        "(() => { const b = document.querySelector('[data-gauge=grad_norm]');"
        " return [b.classList.contains('full'), b.getBoundingClientRect().width]; })()"
    )
    assert box[0] and box[1] > 1400
    table = list(
        csv.reader(io.StringIO(browser.evaluate("cockpit.chartCsv('grad_norm')")))
    )
    assert table[0][0] == "step" and len(table[0]) == 4  # a column per run
    assert len(table) == 1 + 40  # a row per step
    row = dict(zip(table[0], table[21]))
    assert row["step"] == "20"
    value = float(plotter.runs[2].data.series("GradNorm", "norm").values[20])
    column = next(name for name in table[0] if name.startswith("lr=0.1,bs=64 · "))
    assert float(row[column]) == pytest.approx(value, 1e-5)
    size = browser.evaluate(
        "new Promise(done => { HTMLAnchorElement.prototype.click = () => {};"
        " URL.createObjectURL = b => { done([b.type, b.size]); return 'blob:x'; };"
        " document.querySelector('[data-gauge=grad_norm] .tools button[title*=PNG]')"
        ".click(); })"
    )
    assert size[0] == "image/png" and size[1] > 2000
