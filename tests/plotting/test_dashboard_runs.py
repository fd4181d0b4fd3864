"""Dashboards of real-looking comparisons: a diverged run, equal file names.

Four runs (two ``log.json`` in folders named after their learning rates, one more
log, one run that diverges to 1e19 and then NaN) drawn as a PNG; the checks read
the figure back (labels, y-limits, markers, legend extents from matplotlib's
renderer, the Gradient Tests caption) instead of looking at pixels. Also: run
labels for any paths, one diagnosis for one log whatever draws it, advice that
reads the evidence, and number formats.
"""

from __future__ import annotations

import math
import re

import matplotlib.image
import matplotlib.text
import numpy as np
import pytest

from cockpit.diagnosis import diagnose
from cockpit.history import History
from cockpit.log.files import open_log
from cockpit.log.keys import NONFINITE_KEY
from cockpit.plotting import CockpitPlotter, instruments
from cockpit.plotting.data import read_log, trend
from cockpit.plotting.drawers import diagnosis_findings, extra_axes
from cockpit.plotting.drawers.common import CLIPPED_GID
from cockpit.plotting.drawers.findings import FittedText
from cockpit.plotting.runs import RUN_COLORS, default_labels
from cockpit.plotting.style import format_number
from tests.plotting.test_plotting import synthetic_history

LAYERS = 3


def _diverged(steps: int = 30, start: int = 12, dead: int = 25) -> History:
    """A run whose loss and gradients grow tenfold a step from ``start``, then NaN.

    From ``dead`` on the values are NaN, the cockpit's ``nonfinite`` records say
    so, and the gradient histogram counts nothing (NaN falls into no bin).
    """
    base = synthetic_history(steps, LAYERS, seed=3)
    out = History()
    for t in base.steps:
        grow = 10.0 ** max(t - start, 0)
        for key, value in base.view(t).items():
            if key == "Loss":
                value = value * grow if t < dead else math.nan
            elif key in ("GradNorm", "Distance", "UpdateSize"):
                value = [v * grow if t < dead else math.nan for v in value]
            elif key == "GradHist1d" and t >= dead:
                value = {"hist": np.zeros_like(value["hist"]), "edges": value["edges"]}
            out.add(t, key, value)
        if t >= dead:
            out.add(t, NONFINITE_KEY, ["loss", "gradients"])
    return out


@pytest.fixture(scope="module")
def four_logs(tmp_path_factory):
    """Paths of the four runs: lr_0.1/log, lr_1.0/log, baseline, lr_8/log."""
    root = tmp_path_factory.mktemp("runs")
    made = [("lr_0.1/log.json", synthetic_history(30, LAYERS, seed=0)),
            ("lr_1.0/log.json", synthetic_history(30, LAYERS, seed=1)),
            ("baseline.json", synthetic_history(30, LAYERS, seed=2)),
            ("lr_8/log.json", _diverged())]  # fmt: skip
    paths = []
    for name, history in made:
        path = root / name
        path.parent.mkdir(exist_ok=True)
        history.write_json(path)
        paths.append(str(path))
    return paths


@pytest.fixture(scope="module")
def four_runs(four_logs, tmp_path_factory):
    """The four runs drawn and saved as a PNG; ``(plotter, png path)``."""
    plotter = CockpitPlotter()
    out = tmp_path_factory.mktemp("png") / "four.png"
    plotter.plot(four_logs, show_plot=False)
    plotter.save(out)
    return plotter, out


def _axes_of(plotter, gauge):
    (ax,) = [ax for function, ax in plotter._gauge_axes if function is gauge]
    return ax


def _legend_texts(ax) -> list[str]:
    texts = []
    for axes in [ax, *extra_axes(ax)]:
        legend = axes.get_legend()
        if legend is not None:
            texts += [t.get_text() for t in legend.get_texts()]
    return texts


def test_labels_are_distinct_and_short_for_any_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    runs = ["runs/lr_0.1/log.json", "runs/lr_1.0/log.json"]
    assert default_labels(runs) == ["lr_0.1", "lr_1.0"]
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")  # three log.json, one of them right here
    assert default_labels(["a/log.json", "b/log.json", "log.json"]) == [
        "a", "b", "here"
    ]  # fmt: skip
    assert default_labels(["x/a/log.json", "y/a/log.json", "x/b/log.json"]) == [
        "x/a", "y/a", "x/b"
    ]  # fmt: skip
    same = default_labels(["a/log.json", "a/log.json", "other.json", object()])
    assert same == ["log (1)", "log (2)", "other", "run 4"]


def test_four_runs_png_names_clips_and_keeps_legends_inside(four_runs):
    plotter, png = four_runs
    assert matplotlib.image.imread(png).shape[:2] == (900, 1600)
    fig = plotter.fig
    renderer = fig.canvas.get_renderer()
    assert plotter.title == "Cockpit: 4 runs"
    assert [run.label for run in plotter.runs] == [
        "lr_0.1", "lr_1.0", "baseline", "lr_8"
    ]  # fmt: skip
    # the diverged run (up to 1e19) is clipped, the others keep the axes
    for gauge, most in ((instruments.plot_grad_norm, 10.0),
                        (instruments.plot_performance, 100.0),
                        (instruments.plot_distance, 100.0)):  # fmt: skip
        ax = _axes_of(plotter, gauge)
        assert ax.get_ylim()[1] < most, (gauge.__name__, ax.get_ylim())
        marks = [a for a in ax.get_lines() if a.get_gid() == CLIPPED_GID]
        assert len(marks) == 1 and marks[0].get_color() == RUN_COLORS[3]
        said = [t for t in _legend_texts(ax) if t.startswith("lr_8: above the axes")]
        assert len(said) == 1, (gauge.__name__, said)  # once, on twin axes too
    # numbers: SI or an exponent, never both
    texts = [t.get_text() for t in fig.findobj(matplotlib.text.Text)]
    assert not [t for t in texts if re.search(r"\de[+-]?\d+[kM]\b|\de\+", t)]
    # every legend lies inside its axes
    for _, ax in plotter._gauge_axes:
        for axes in [ax, *extra_axes(ax)]:
            legend = axes.get_legend()
            if legend is None or not legend.get_visible():
                continue
            box, inside = legend.get_window_extent(renderer), axes.bbox
            assert box.x0 >= inside.x0 - 1 and box.x1 <= inside.x1 + 1, axes
            assert box.y0 >= inside.y0 - 1 and box.y1 <= inside.y1 + 1, axes


def test_four_runs_diagnosis_lines_do_not_overlap(four_runs):
    plotter, _ = four_runs
    panel = _axes_of(plotter, instruments.plot_findings)
    renderer = plotter.fig.canvas.get_renderer()
    boxes = []
    for text in panel.texts:
        box = text.get_window_extent(renderer)
        if text.get_text() and box.y0 >= panel.bbox.y0 and box.y1 <= panel.bbox.y1:
            boxes.append(box)
    assert len(boxes) > 8
    shown = [t.get_text() for t in panel.texts]
    assert any(t.startswith("exploding_gradients") for t in shown)  # lr_8's 3rd
    for i, a in enumerate(boxes):
        for b in boxes[i + 1 :]:
            if a.x0 < b.x1 and b.x0 < a.x1:  # side by side on a row is fine
                assert min(a.y1, b.y1) - max(a.y0, b.y0) < 2.0, (a, b)


def test_four_runs_png_histogram_tests_and_alpha(four_runs):
    plotter, _ = four_runs
    hist = _axes_of(plotter, instruments.plot_hist_1d)
    drawn = {a.get_gid() for a in hist.patches}
    assert "cockpit-run-3" not in drawn and "cockpit-run-0" in drawn  # no bars
    assert any("lr_8: no finite value counted at step 29" in t.get_text()
               for t in hist.texts)  # fmt: skip
    tests = _axes_of(plotter, instruments.plot_gradient_tests)
    captions = [t for t in tests.texts if isinstance(t, FittedText)]
    assert captions and not captions[0].get_text().endswith("…")  # not cut
    history = extra_axes(tests)[1]
    zorder = {line.get_linestyle(): line.get_zorder() for line in history.lines
              if line.get_gid() == "cockpit-run-0"}  # fmt: skip
    assert zorder["-"] > zorder[":"]  # the norm test above the orthogonality test
    alpha = _axes_of(plotter, instruments.plot_alpha)
    (parabola,) = [line for line in alpha.lines if len(line.get_xdata()) == 121]
    assert parabola.get_color() not in RUN_COLORS


def test_trend_of_an_exploding_run_follows_its_points(four_logs):
    data = read_log(four_logs[3])
    steps, values, smooth = data.series("Loss").view()
    growing = (steps >= 15) & (steps <= 24)  # tenfold a step
    ratio = smooth[growing] / values[growing]
    assert np.all((ratio > 0.5) & (ratio < 2.0)), ratio  # on the log axis: on them
    straight = trend(steps, values)[growing] / values[growing]
    assert np.any(straight > 2.0)  # a straight-line fit of the values is not


def _misscaled_then_healthy(path) -> str:
    """A log whose first histograms have 5 % of the elements at the edges."""
    history = synthetic_history(12, LAYERS, seed=4)
    for t in history.steps:
        hist = np.asarray(history[t]["GradHist1d"]["hist"], dtype=float)
        if t < 3:
            hist[0] = hist[-1] = 0.025 * hist.sum() / 0.95
        history.add(
            t, "GradHist1d", {"hist": hist, "edges": history[t]["GradHist1d"]["edges"]}
        )
    history.write_json(path)
    return str(path)


def test_one_diagnosis_for_one_log_whatever_draws_it(tmp_path):
    path = _misscaled_then_healthy(tmp_path / "log.json")
    report = [(f.id, f.severity, f.steps) for f in diagnose(path)]
    assert ("inputs_misscaled", "warning", (0, 2)) in report
    for drawn in (read_log(path), open_log(path, latest=True)):  # plot, the CLI
        panel = diagnosis_findings(drawn)
        assert [(f.id, f.severity, f.steps) for f in panel] == report


def _edges(fractions) -> History:
    history = History()
    edges = np.linspace(-2, 2, 21)
    for t, fraction in enumerate(fractions):
        hist = np.zeros(20)
        hist[10] = 1000 * (1 - fraction)
        hist[0] = hist[-1] = 500 * fraction
        history.add(t, "GradHist1d", {"hist": hist, "edges": edges})
        history.add(t, "Loss", 2.0 * 10**t)
    return history


def test_misscaled_inputs_only_where_the_inputs_explain_it():
    ids = {f.id for f in diagnose(_edges([0.03, 0.03, 0.03, 0.0]))}
    assert "inputs_misscaled" in ids  # on the wrong scale from the first step
    # standardised inputs, a step that blows the gradients up: not the inputs
    ids = {f.id for f in diagnose(_edges([2e-5, 1.3e-3, 2.6e-2, 0.3]))}
    assert "inputs_misscaled" not in ids


@pytest.mark.parametrize(
    "x, text",
    [(2.4e19, "2.4e19"), (1.9e13, "1.9e13"), (999.9e6, "1e9"), (2e6, "2M"),
     (15300, "15.3k"), (3e-5, "3e-5"), (-2.5e9, "-2.5e9")],
)  # fmt: skip
def test_numbers_use_si_or_an_exponent_never_both(x, text):
    assert format_number(x) == text
