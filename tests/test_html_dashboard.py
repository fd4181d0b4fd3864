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
def page(tmp_path_factory):
    """Two runs in one page, opened in Chromium; the browser for the tests."""
    folder = tmp_path_factory.mktemp("html")
    plotter = CockpitPlotter()
    plotter.load([_run(1, 60, 1.0), _run(2, 50, 2.0)], labels=["small", "large"])
    path = plotter.write_html(folder / "runs.html")
    with Browser(width=1600, height=1100) as browser:
        browser.open(f"file://{path}")
        yield browser, path, plotter, folder


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
