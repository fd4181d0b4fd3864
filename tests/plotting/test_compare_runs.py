"""Runs side by side: the overlay, what a run lacks, mixed log formats, the CLI.

Checks read the figure back: every artist a gauge draws for run ``k`` carries the
gid ``cockpit-run-k``, so "every run on every gauge" is a set comparison, not a
look at pixels. Also the dashboard's own promises: legends never cover data
(at two figure sizes), trend lines do not lag on sparse schedules.
"""

from __future__ import annotations

import json

import matplotlib
import numpy as np
import pytest
from matplotlib.collections import PathCollection

from cockpit.cli import _default_output, main
from cockpit.errors import CockpitWarning
from cockpit.history import History
from cockpit.log.stream import LogStream
from cockpit.plotting import CockpitPlotter, instruments
from cockpit.plotting.data import trend
from cockpit.plotting.drawers import extra_axes
from cockpit.plotting.runs import RUN_GID, default_labels
from tests.plotting.test_plotting import reference_log, synthetic_history

CURVATURE = {"HessMaxEV", "HessTrace", "TICDiag", "GradHist2d"}


def _economy(history: History) -> History:
    """The history without its curvature quantities (an ``economy`` run)."""
    return History(
        {s: {k: v for k, v in history[s].items() if k not in CURVATURE}
         for s in history.steps}
    )  # fmt: skip


def _run_gids(ax) -> set[int]:
    """Indices of the runs something was drawn for on a gauge (and its insets)."""
    found = set()
    for axes in [ax, *extra_axes(ax)]:
        for artist in axes.get_children():
            gid = artist.get_gid() or ""
            if gid.startswith(RUN_GID):
                found.add(int(gid[len(RUN_GID) :]))
    return found


def _gauge_text(ax) -> str:
    texts = []
    for axes in [ax, *extra_axes(ax)]:
        texts += [getattr(t, "full_text", t.get_text()) for t in axes.texts]
        legend = axes.get_legend()
        if legend is not None:
            texts += [t.get_text() for t in legend.get_texts()]
    return " ".join(texts)


@pytest.fixture(scope="module")
def three_runs():
    """Two full runs (different values) and one without curvature quantities."""
    return [
        synthetic_history(steps=12, seed=1),
        synthetic_history(steps=16, seed=2),
        _economy(synthetic_history(steps=10, seed=3)),
    ]


def test_every_run_is_drawn_on_every_gauge_and_a_missing_one_is_named(three_runs):
    plotter = CockpitPlotter(secondary_screen=True)
    plotter.plot(three_runs, show_plot=False, labels=["a", "b", "econ"])
    gauges = plotter._gauge_axes + plotter._aux_axes
    assert len(gauges) == 11 + 3  # all but the learning rates: tracked by some run
    curvature_keys = {"max_ev": "HessMaxEV", "trace": "HessTrace", "tic": "TICDiag",
                      "hist_2d": "GradHist2d"}  # fmt: skip
    for function, ax in gauges:
        name = function.__name__[len("plot_") :]
        title = ax.get_title()
        assert ax.get_gid() == instruments.GAUGE_GID, title
        if name in curvature_keys:
            assert _run_gids(ax) == {0, 1}, title
            assert ax._cockpit_missing_runs == ["econ"], title
            assert f"no {curvature_keys[name]}" in _gauge_text(ax), title
            assert "econ" in _gauge_text(ax), title
        else:
            assert _run_gids(ax) == {0, 1, 2}, title
            assert ax._cockpit_missing_runs == [], title
    # the legends name the runs
    by_title = {ax.get_title(): ax for _, ax in gauges}
    for label in ("a", "b", "econ"):
        assert label in _gauge_text(by_title["Gradient Norm"])
    # each run in its own colour, the same on every gauge
    colours = {}
    for _, ax in gauges:
        for axes in [ax, *extra_axes(ax)]:
            for artist in axes.collections:
                gid = artist.get_gid() or ""
                if gid.startswith(RUN_GID) and isinstance(artist, PathCollection):
                    colour = tuple(np.round(artist.get_facecolor()[0][:3], 3))
                    colours.setdefault(gid, set()).add(colour)
    assert all(len(found) == 1 for found in colours.values()), colours
    assert len({next(iter(c)) for c in colours.values()}) == len(colours)


def test_the_points_of_each_run_are_its_values_aligned_by_step(three_runs):
    fig = matplotlib.figure.Figure()
    ax = fig.add_subplot()
    instruments.plot_grad_norm(ax, three_runs, labels=["a", "b", "c"])
    for index, history in enumerate(three_runs):
        (points,) = [c for c in ax.collections if c.get_gid() == f"{RUN_GID}{index}"]
        steps, norms = history.series("GradNorm")
        expected = [np.sqrt(np.sum(np.square(v))) for v in norms]
        np.testing.assert_array_equal(points.get_offsets()[:, 0], steps)
        np.testing.assert_allclose(points.get_offsets()[:, 1], expected, rtol=1e-12)


def test_logs_of_1_0_2_streamed_jsonl_and_plain_json_mix(tmp_path, capsys):
    old = tmp_path / "old.json"
    old.write_text(json.dumps(reference_log(), indent=4))
    plain = synthetic_history(steps=6, seed=4).write_json(tmp_path / "plain.json")
    streamed = tmp_path / "streamed"
    stream = LogStream(streamed)
    history = synthetic_history(steps=5, seed=5)
    stream.write({s: history[s] for s in history.steps})
    stream.close()
    assert stream.path.endswith(".jsonl")
    logs = [str(old), plain, stream.path]
    assert default_labels(logs) == ["old", "plain", "streamed"]
    fig = matplotlib.figure.Figure()
    norm, curvature = fig.add_subplot(121), fig.add_subplot(122)
    instruments.plot_grad_norm(norm, logs)
    instruments.plot_max_ev(curvature, logs)
    assert _run_gids(norm) == {0, 1, 2}
    assert _run_gids(curvature) == {1, 2}  # 1.0.2's log lacks it: named
    assert curvature._cockpit_missing_runs == ["old"]
    assert "no HessMaxEV/HessMaxEV_largest: old" in _gauge_text(curvature)
    # the command line: the HTML of all three (no PNG without -o), named by --label
    page = tmp_path / "all.html"
    labels = ["--label", "1.0.2", "--label", "json", "--label", "jsonl"]
    code = main(["plot", *logs, "--html", str(page), *labels])
    assert code == 0, capsys.readouterr().err
    assert not list(tmp_path.glob("*.png"))
    text = page.read_text()
    assert '"label":"jsonl"' in text and "<script src" not in text
    assert "http://" not in text.split("<script>", 1)[1].split("uPlot", 1)[0]
    assert str(page) in capsys.readouterr().out


def test_the_cli_names_labels_that_do_not_fit_and_an_empty_secondary(tmp_path, capsys):
    a = synthetic_history(steps=4, seed=1).write_json(tmp_path / "a.json")
    b = _economy(synthetic_history(steps=4, seed=2)).write_json(tmp_path / "b.json")
    assert main(["plot", a, b, "--label", "only-one"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "1 labels for 2 runs" in err[0] and "Fix:" in err[0]
    assert _default_output([a, b], ".png") == str(tmp_path / "a_vs_b_dashboard.png")
    assert _default_output([a, b, a], ".png").endswith("a_and_2_more_dashboard.png")
    full = History({s: {k: v for k, v in synthetic_history(4)[s].items()
                        if k not in {"MeanGSNR", "CABS", "EarlyStopping"}}
                    for s in range(4)}).write_json(tmp_path / "full.json")  # fmt: skip
    secondary = tmp_path / "second.png"
    with pytest.warns(CockpitWarning, match="not written") as said:
        assert main(["plot", full, "--html", str(tmp_path / "x.html"),
                     "--secondary", str(secondary)]) == 0  # fmt: skip
    (warning,) = said
    assert "MeanGSNR" in str(warning.message) and "keep_individual" in str(
        warning.message
    )
    assert not secondary.exists() and (tmp_path / "x.html").exists()


def test_report_compares_runs_in_text_markdown_and_one_json_object(tmp_path, capsys):
    healthy = synthetic_history(steps=20, seed=1)
    diverged = synthetic_history(steps=20, seed=2)
    for step in range(15, 20):
        diverged.add(step, "Loss", float("nan"))
        diverged.add(step, "nonfinite", ["loss"])
    a = healthy.write_json(tmp_path / "healthy.json")
    b = diverged.write_json(tmp_path / "diverged.json")
    assert main(["report", a, b, "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)  # exactly one object
    assert [run["label"] for run in payload["runs"]] == ["healthy", "diverged"]
    row = payload["comparison"]["nonfinite"]
    assert row["healthy"] == "ok" and row["diverged"]["severity"] == "error"
    assert row["diverged"]["steps"] == [15, 19]
    assert main(["report", a, b, "--label", "A", "--label", "B"]) == 0
    text = capsys.readouterr().out
    assert "2 runs compared" in text and "error (15-19)" in text
    assert main(["report", a, b, "--markdown", "--fail-on", "error"]) == 2
    markdown = capsys.readouterr().out
    assert "| `nonfinite` | ok | error (15-19) |" in markdown


def test_legends_never_cover_data_at_any_size(three_runs):
    runs_of_8 = [History({s: h[s] for s in h.steps[:8]}) for h in three_runs]
    for figsize, runs in (((11, 6.5), runs_of_8),):  # a small figure, three runs
        plotter = CockpitPlotter(figsize=figsize)
        plotter.plot(runs, show_plot=False)
        plotter.fig.canvas.draw()
        renderer = plotter.fig.canvas.get_renderer()
        checked = 0
        for _, ax in plotter._gauge_axes:
            for axes in [ax, *extra_axes(ax)]:
                legend = axes.get_legend()
                if legend is None:
                    continue
                box = legend.get_window_extent(renderer)
                for data_axes in {axes, ax, *extra_axes(ax)}:
                    for points in _drawn_points(data_axes):
                        x, y = points[:, 0], points[:, 1]
                        inside = (
                            (x > box.x0) & (x < box.x1) & (y > box.y0) & (y < box.y1)
                        )
                        assert not inside.any(), (ax.get_title(), figsize)
                checked += 1
        assert checked >= 8
    # (the 16 x 9 dashboard of one run: tests/plotting/test_plotting.py draws it)


def _drawn_points(axes):
    """Display coordinates of the data points and line vertices drawn on ``axes``."""
    found = []
    for collection in axes.collections:
        if isinstance(collection, PathCollection) and len(collection.get_offsets()):
            found.append(axes.transData.transform(collection.get_offsets()))
    for line in axes.lines:
        xy = line.get_xydata()
        if len(xy) > 2 and line.get_gid() is not None:
            found.append(axes.transData.transform(xy))
    return found


def test_the_trend_line_does_not_lag_on_sparse_schedules():
    steps = np.arange(0, 400, 20)  # a run tracked every 20th step
    values = 0.01 * steps + 1.0
    np.testing.assert_allclose(trend(steps, values), values, rtol=1e-12)
    # what an exponential moving average over points (alpha 0.2) does instead
    ema = [values[0]]
    for v in values[1:]:
        ema.append(0.2 * v + 0.8 * ema[-1])
    assert values[-1] - ema[-1] > 0.01 * 60  # lags about 4 points = 80 steps
    noisy = values + np.random.default_rng(0).normal(0, 0.05, len(values))
    assert abs(np.mean(trend(steps, noisy) - values)) < 0.03
    at = np.array([0, 7, 19])
    np.testing.assert_allclose(trend(steps, noisy, at=at), trend(steps, noisy)[at])
