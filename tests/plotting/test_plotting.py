"""The dashboard: every gauge from a real run's log, both screens, global state.

Rendering uses the Agg backend only; checks look at what was drawn (titles, axes
with data, overlapping labels, written PNGs) rather than at pixels.
"""

from __future__ import annotations

import json
import math
import warnings

import matplotlib
import numpy as np
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from cockpit import quantities as Q
from cockpit.errors import CockpitWarning
from cockpit.history import History
from cockpit.plotting import CockpitPlotter, DashboardData, instruments, make_timelapse
from cockpit.plotting.data import MAX_POINTS, thinned_index
from cockpit.plotting.drawers import FittedText
from cockpit.plotting.style import format_number
from cockpit.utils.configuration import configuration
from cockpit.utils.schedules import linear
from tests.utils.harness import run
from tests.utils.problems import make_problem

STEPS = 6
PRIMARY_TITLES = [
    "Alpha Distribution",
    "Distance",
    "Gradient Norm",
    "Gradient Tests",
    "Gradient Element Histogram",
    "Gradient/Parameter Element Histogram (all)",
    "Max Eigenvalue",
    "Trace",
    "TIC",
    "Hyperparameters",
    "Performance Plot",
    "Diagnosis",
]
AUXILIARY_TITLES = ["Mean GSNR", "CABS", "Early stopping"]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


# --- a real run ---
def _all_quantities():
    """The full configuration with per-layer histograms, plus every other gauge's."""
    every = linear(1)
    made = [q for q in configuration("full", every) if q.key != "GradHist2d"]
    made += [
        Q.GradHist2d(every, keep_individual=True),
        Q.TICTrace(every),
        Q.MeanGSNR(every),
        Q.CABS(every),
        Q.EarlyStopping(every),
    ]
    return made


@pytest.fixture(scope="module")
def real_log(tmp_path_factory):
    """Log of a 6-step SGD run that tracked every quantity the dashboard shows."""
    problem = make_problem("mlp", "ce", "sgd")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Full backward hook is firing")
        # the full configuration's TICDiag divides by the Hessian diagonal, which
        # has entries <= 0 on this MLP at step 0: recorded as Missing and warned
        # about, as it should be (test_cockpit_missing checks that mechanism)
        warnings.filterwarnings("ignore", "TICDiag has no value", CockpitWarning)
        result = run(problem, _all_quantities(), steps=STEPS)
    cockpit = result.cockpit
    for step in range(0, STEPS, 2):
        cockpit.log(step, 0, 1.0 / (step + 1), 1.2 / (step + 1), None, 0.1 * step,
                    0.08 * step, None, 0.1)  # fmt: skip
    path = cockpit.write(tmp_path_factory.mktemp("run") / "log")
    return path, cockpit, len(problem.params)


@pytest.fixture(scope="module")
def dashboard(real_log, tmp_path_factory):
    """Both screens drawn from the real log and saved as PNGs."""
    path, _, _ = real_log
    plotter = CockpitPlotter(secondary_screen=True)
    savedir = tmp_path_factory.mktemp("png")
    saved = plotter.plot(path, show_plot=False, save_plot=True, savedir=savedir)
    return plotter, saved


def _gauge_axes(plotter):
    return [ax for _, ax in plotter._gauge_axes]


def _full_text(text) -> str:
    """A text's whole line (the findings panel cuts long lines when it draws)."""
    return getattr(text, "full_text", text.get_text())


def _has_data(ax) -> bool:
    """Whether ``ax`` (or a twin/inset it made) shows data (the findings: text)."""
    if ax.get_title() == "Diagnosis":
        return any(_full_text(t).strip() for t in ax.texts)
    axes = [ax, *instruments.extra_axes(ax)]
    for a in axes:
        if any(len(line.get_xdata()) for line in a.lines):
            return True
        if any(len(c.get_offsets()) or len(c.get_paths()) for c in a.collections):
            return True
        if a.patches or a.images:
            return True
    return False


# --- tests on the real run ---
def test_every_gauge_draws_from_a_real_log(real_log, dashboard):
    _, _, n_params = real_log
    plotter, saved = dashboard

    axes = _gauge_axes(plotter)
    assert [ax.get_title() for ax in axes] == PRIMARY_TITLES
    for ax in axes:
        assert ax.get_gid() == instruments.GAUGE_GID, ax.get_title()
        assert _has_data(ax), ax.get_title()
    aux = [ax for _, ax in plotter._aux_axes]
    assert [ax.get_title() for ax in aux] == AUXILIARY_TITLES
    assert all(ax.get_gid() == instruments.GAUGE_GID and _has_data(ax) for ax in aux)
    layers = [ax for ax in plotter._layer_axes if ax.get_gid() == instruments.GAUGE_GID]
    assert [ax.get_title() for ax in layers] == [
        f"Parameter {k}" for k in range(n_params)
    ]

    assert [p.rsplit("/", 1)[1] for p in saved] == [
        "cockpit__primary.png",
        "cockpit__secondary.png",
    ]
    for file in saved:
        with open(file, "rb") as handle:
            assert handle.read(8) == PNG_SIGNATURE
    image = matplotlib.image.imread(saved[0])
    assert image.shape[:2] == (900, 1600)
    assert plotter.fig._suptitle.get_text() == "Cockpit: log.json"


def test_gauges_show_the_logged_values(real_log, dashboard):
    _, cockpit, _ = real_log
    plotter, _ = dashboard
    by_title = {ax.get_title(): ax for ax in _gauge_axes(plotter)}
    # Gradient norm: the points are the norms of the whole gradient per step.
    points = by_title["Gradient Norm"].collections[0].get_offsets()
    expected = [math.sqrt(sum(v * v for v in cockpit.history[s]["GradNorm"]))
                for s in range(STEPS)]  # fmt: skip
    np.testing.assert_allclose(points[:, 1], expected, rtol=1e-12)
    np.testing.assert_array_equal(points[:, 0], np.arange(STEPS))
    # Trace: the sum over layers.
    points = by_title["Trace"].collections[0].get_offsets()
    expected = [sum(cockpit.history[s]["HessTrace"]) for s in range(STEPS)]
    np.testing.assert_allclose(points[:, 1], expected, rtol=1e-12)
    # Learning rate: the rates the cockpit recorded (one group) at every step.
    steps, rates = cockpit.history.series("learning_rates")
    (line,) = by_title["Hyperparameters"].lines
    np.testing.assert_array_equal(line.get_xdata(), steps)
    np.testing.assert_allclose(line.get_ydata(), [r[0] for r in rates])


def test_live_plot_from_a_cockpit_then_update(real_log):
    _, cockpit, _ = real_log
    plotter = CockpitPlotter()
    plotter.plot(cockpit, show_plot=False)
    assert plotter.fig._suptitle.get_text() == "Cockpit for SGD"
    with pytest.raises(ValueError, match="savedir="):
        plotter.plot(cockpit, show_plot=False, save_plot=True)


def test_no_overlapping_labels_or_titles(dashboard):
    plotter, _ = dashboard
    for fig in plotter.figures:  # laid out and drawn when they were saved
        renderer = fig.canvas.get_renderer()
        problems = _overlaps(fig, renderer)
        assert not problems, problems


def _visible_texts(artist_list):
    return [t for t in artist_list if t.get_visible() and t.get_text().strip()]


def _overlaps(fig: Figure, renderer) -> list[str]:
    """Overlapping tick labels within an axis, and titles touching other text."""
    found = []
    all_axes = []
    for ax in fig.get_axes():
        all_axes += [ax, *ax.child_axes]
    for ax in all_axes:
        for axis in (ax.xaxis, ax.yaxis):
            labels = _visible_texts(axis.get_ticklabels())
            boxes = [t.get_window_extent(renderer) for t in labels]
            for i in range(len(boxes)):
                for j in range(i + 1, len(boxes)):
                    if boxes[i].overlaps(boxes[j]):
                        found.append(
                            f"{ax.get_title()!r}: tick labels {labels[i].get_text()!r}"
                            f" and {labels[j].get_text()!r} overlap"
                        )
    titles = [(ax, ax.title) for ax in all_axes if ax.get_title()]
    for ax, title in titles:
        box = title.get_window_extent(renderer)
        for other in all_axes:
            texts = _visible_texts(
                other.xaxis.get_ticklabels() + other.yaxis.get_ticklabels()
            ) + [other.xaxis.label, other.yaxis.label]
            if other is not ax:
                texts.append(other.title)
            for text in _visible_texts(texts):
                if box.overlaps(text.get_window_extent(renderer)):
                    found.append(
                        f"title {title.get_text()!r} overlaps {text.get_text()!r}"
                    )
    return found


def test_global_matplotlib_state_is_unchanged(real_log, tmp_path):
    import matplotlib.pyplot as plt

    path, _, _ = real_log
    backend = matplotlib.get_backend()
    user_fig = plt.figure()
    before = {k: v for k, v in matplotlib.rcParams.items() if k != "backend"}
    interactive = matplotlib.is_interactive()
    fignums = plt.get_fignums()
    try:
        plotter = CockpitPlotter(secondary_screen=True)
        plotter.plot(path, show_plot=True, save_plot=True, savedir=tmp_path)
        plotter.plot(path, show_plot=True, block=True)  # an update; Agg: no window
        make_timelapse(path, tmp_path / "run.gif", frames=1)
        after = {k: v for k, v in matplotlib.rcParams.items() if k != "backend"}
        changed = [k for k in before if not _same(before[k], after[k])]
        assert not changed
        assert matplotlib.get_backend() == backend
        assert matplotlib.is_interactive() == interactive
        assert plt.get_fignums() == fignums
        assert plt.gcf() is user_fig
    finally:
        plt.close(user_fig)


def _same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a):
        return math.isnan(b)
    return a == b


# --- synthetic histories in the logged formats ---
def synthetic_history(steps=30, layers=3, seed=0, with_alpha=True) -> History:
    """Values in the formats of section 1.5 of the reference (random numbers)."""
    rng = np.random.default_rng(seed)
    h = History()
    xe, ye = np.linspace(-1, 1, 41), np.linspace(-2, 2, 51)
    for t in range(steps):
        h.add(t, "Loss", float(2 * np.exp(-t / 10) + 0.1 * rng.random()))
        h.add(t, "GradNorm", list(rng.random(layers)))
        h.add(t, "Distance", list(0.1 * t * rng.random(layers)))
        h.add(t, "UpdateSize", list(0.01 * rng.random(layers)))
        if with_alpha:
            h.add(t, "Alpha", float(rng.normal(0.5, 0.8)))
        for key in ("NormTest", "InnerTest", "OrthoTest", "TICDiag", "MeanGSNR"):
            h.add(t, key, float(0.5 + rng.random()))
        h.add(t, "HessMaxEV", float(10 ** rng.uniform(0, 3)))
        h.add(t, "HessTrace", list(rng.normal(5, 1, layers)))
        h.add(t, "CABS", float(30 + rng.random()))
        h.add(t, "EarlyStopping", float(rng.normal()))
        edges = np.linspace(-2, 2, 101)
        counts = np.histogram(rng.normal(0, 0.5, 500), edges)[0].astype(float)
        h.add(t, "GradHist1d", {"hist": counts, "edges": edges})
        joint = np.histogram2d(rng.normal(0, 0.2, 500), rng.normal(0, 1, 500), [xe, ye])
        h.add(t, "GradHist2d", {"hist": joint[0].astype(int), "edges": [xe, ye]})
    return h


def test_update_reads_only_new_steps():
    history = synthetic_history(steps=200)
    plotter = CockpitPlotter()
    plotter.plot(history, show_plot=False)
    data = plotter.data
    read = data.entries_read
    per_step = len(history[199])
    history.add(200, "GradNorm", [3.0, 4.0])
    history.add(199, "Alpha", 0.25)  # a two-step quantity fills the last step late
    plotter.plot(history, show_plot=False)
    assert data.entries_read - read == per_step + 1  # steps 199 and 200 only
    steps, values, _ = data.series("GradNorm", "norm").view()
    assert steps[-1] == 200 and values[-1] == 5.0
    _, alphas, _ = data.series("Alpha").view()
    assert alphas[-1] == 0.25 and len(alphas) == 200


def test_long_runs_are_thinned_but_keep_the_last_point():
    history = History({s: {"GradNorm": [float(s)]} for s in range(3 * MAX_POINTS)})
    fig = Figure()
    ax = fig.add_subplot()
    instruments.plot_grad_norm(ax, history)
    offsets = ax.collections[0].get_offsets()
    assert len(offsets) <= MAX_POINTS + 1
    assert offsets[-1, 0] == 3 * MAX_POINTS - 1
    # the same points stay chosen while the run grows (no flicker)
    a = np.asarray(thinned_index(5000, 1000))
    b = np.asarray(thinned_index(5003, 1000))
    assert set(a[:-1]) <= set(b)


def test_discard_hides_later_steps_and_log_iter_axes():
    history = synthetic_history(steps=30)
    plotter = CockpitPlotter()
    plotter.plot(history, show_plot=False, discard=12, show_log_iter=True)
    by_title = {ax.get_title(): ax for ax in _gauge_axes(plotter)}
    ax = by_title["Gradient Norm"]
    assert ax.collections[0].get_offsets()[:, 0].max() == 12
    assert ax.get_xscale() == "symlog"
    hist = by_title["Gradient Element Histogram"]
    assert any(t.get_text() == "step 12" for t in hist.texts)


def test_only_what_was_tracked_is_laid_out_and_the_rest_is_named():
    plotter = CockpitPlotter(secondary_screen=True)
    with pytest.warns(UserWarning, match="is not shown") as record:
        plotter.plot(History({0: {"Loss": 1.0}}), show_plot=False, debug=True)
    axes = _gauge_axes(plotter) + [ax for _, ax in plotter._aux_axes]
    assert [ax.get_title() for ax in axes] == ["Performance Plot", "Diagnosis"]
    assert all(ax.get_gid() == instruments.GAUGE_GID for ax in axes)
    left_out = plotter.left_out() + plotter.left_out("secondary")
    assert len(record) == len(left_out) == 14  # 10 + 3 auxiliary + the layers
    note = " ".join(t.get_text() for t in plotter.fig.texts)
    assert "not tracked, so not shown" in note
    assert all(hint.removeprefix("track ") in note for _, hint in plotter.left_out())
    secondary = " ".join(t.get_text() for t in plotter.fig_secondary.texts)
    assert "nothing to show on the secondary screen" in secondary
    # the economy configuration: no curvature panel, no empty boxes
    curvature = {"HessMaxEV", "HessTrace", "TICDiag", "GradHist2d"}
    full = synthetic_history(steps=8)
    economy = History({step: {k: v for k, v in full[step].items() if k not in curvature}
                       for step in full.steps})  # fmt: skip
    plotter = CockpitPlotter()
    plotter.plot(economy, show_plot=False)
    titles = [ax.get_title() for ax in _gauge_axes(plotter)]
    assert "Max Eigenvalue" not in titles and "Distance" in titles
    assert all(ax.get_gid() == instruments.GAUGE_GID for ax in _gauge_axes(plotter))


def test_redrawing_a_gauge_does_not_pile_up_axes():
    history = synthetic_history(steps=10)
    fig = Figure()
    ax = fig.add_subplot()
    instruments.plot_distance(ax, history)
    count = len(fig.axes)
    for _ in range(3):
        instruments.plot_distance(ax, history)
        instruments.plot_gradient_tests(ax, history)
        instruments.plot_hist_2d(ax, history)
    instruments.plot_distance(ax, history)
    assert len(fig.axes) == count
    assert len(ax.child_axes) == 0


def test_gauges_take_a_history_and_any_axes():
    history = synthetic_history(steps=10)
    fig = Figure(figsize=(12, 8))
    gauges = [g for panel in instruments.PRIMARY_GAUGES.values() for g in panel] + list(
        instruments.AUXILIARY_GAUGES
    )
    for gauge, ax in zip(gauges, fig.subplots(3, 4).flat):
        assert gauge(ax, history) is ax
        assert ax.get_gid() == instruments.GAUGE_GID, ax.get_title()


def test_alpha_gauge_counts_values_outside_the_range():
    history = History({s: {"Alpha": v} for s, v in enumerate([-3.0, 0.1, 0.2, 5, 7])})
    fig = Figure()
    ax = fig.add_subplot()
    instruments.plot_alpha(ax, history)
    texts = {t.get_text() for t in ax.texts}
    assert "◀ 1" in texts and "2 ▶" in texts
    twin = instruments.extra_axes(ax)[0]
    labels = twin.get_legend_handles_labels()[1]
    assert labels[0] == f"all: mean {np.mean([-3.0, 0.1, 0.2, 5, 7]):+.2f}"


def test_reference_log_with_json_tricks_arrays(tmp_path):
    path = tmp_path / "reference_log.json"
    path.write_text(json.dumps(reference_log(), indent=4, sort_keys=True))
    plotter = CockpitPlotter()
    saved = plotter.plot(str(path)[: -len(".json")], show_plot=False, save_plot=True)
    # as 1.0.2: the images of a log go to the folder named after it
    assert saved == [str(tmp_path / "reference_log" / "cockpit__primary.png")]
    by_title = {ax.get_title(): ax for ax in _gauge_axes(plotter)}
    drawn = (
        "Gradient Norm",
        "Gradient Element Histogram",
        "Performance Plot",
        "Gradient/Parameter Element Histogram (all)",
        "Hyperparameters",
    )
    for title in drawn:
        assert by_title[title].get_gid() == instruments.GAUGE_GID, title
    assert "Max Eigenvalue" not in by_title  # not tracked: named, not drawn
    assert ("Max Eigenvalue", "track HessMaxEV") in plotter.left_out()


def _ndarray(values, dtype="float64"):
    array = np.asarray(values, dtype=dtype)
    return {"__ndarray__": array.tolist(), "dtype": dtype, "shape": list(array.shape),
            "Corder": True}  # fmt: skip


def reference_log():
    """A small log as cockpit-for-pytorch 1.0.2 writes it (json_tricks arrays)."""
    log = {}
    for step in range(4):
        entry = {
            "Loss": 2.0 - 0.3 * step,
            "GradNorm": [0.5 + 0.1 * step, 0.25],
            "Alpha": 0.3 * step - 0.5,
            "GradHist1d": {
                "hist": _ndarray([0.0, 3.0, 10.0, 4.0, 1.0], "float32"),
                "edges": _ndarray(np.linspace(-2, 2, 6)),
            },
            "GradHist2d": {
                "hist": _ndarray(np.arange(12).reshape(3, 4), "int64"),
                "edges": [
                    _ndarray(np.linspace(-1, 1, 4)),
                    _ndarray(np.linspace(-2, 2, 5)),
                ],
            },
        }
        if step % 2 == 0:
            entry.update(epoch_count=0, train_loss=1.9, valid_loss=2.0, test_loss=2.1,
                         train_accuracy=0.3, valid_accuracy=0.25, test_accuracy=0.2,
                         learning_rate=0.01)  # fmt: skip
        log[str(step)] = entry
    return log


def test_savename_append_and_format(tmp_path):
    plotter = CockpitPlotter()
    saved = plotter.plot(synthetic_history(5), show_plot=False, save_plot=True,
                         savedir=tmp_path, savename="run", savename_append="epoch_3",
                         savefig_kwargs={"format": "jpg", "dpi": 20})  # fmt: skip
    assert saved == [str(tmp_path / "run__primary__epoch_3.jpg")]
    assert matplotlib.image.imread(saved[0]).shape[:2] == (180, 320)


def test_timelapse_writes_an_animated_gif(tmp_path):
    from PIL import Image

    path = make_timelapse(synthetic_history(12), tmp_path / "sub" / "run.gif", frames=2)
    with Image.open(path) as gif:
        assert gif.format == "GIF"
        assert gif.n_frames == 2
        assert gif.size == (1280, 720)  # text of 11 pixels and more: readable
    with pytest.raises(ValueError, match="no tracked steps"):
        make_timelapse(History(), tmp_path / "empty.gif")


def test_layer_grid_grows_alternately():
    from cockpit.plotting.dashboard import _layer_grid

    assert [_layer_grid(n) for n in (1, 4, 5, 7, 9, 10, 13)] == [
        (2, 2), (2, 2), (2, 3), (3, 3), (3, 3), (3, 4), (4, 4)
    ]  # fmt: skip


def test_number_format_is_short():
    assert [format_number(x) for x in (0, 0.25, 2500, 15300, 2e6, 3e-5, -1.5)] == [
        "0", "0.25", "2500", "15.3k", "2M", "3e-5", "-1.5"
    ]  # fmt: skip


def test_dashboard_data_rejects_unknown_reduction():
    data = DashboardData(History())
    with pytest.raises(ValueError, match="choose one of"):
        data.series("GradNorm", "mean")


def test_window_path_reuses_its_figure_and_keeps_the_current_one(monkeypatch):
    """The GUI code path, exercised on Agg (pyplot figures exist, nothing shows)."""
    import matplotlib.pyplot as plt

    from cockpit.plotting import dashboard

    monkeypatch.setattr(dashboard, "_display_kind", lambda: "gui")
    # a GUI canvas draws when its event loop is idle; Agg's draw_idle draws at once
    # (3 s a dashboard), which this test of the figures' bookkeeping does not need
    monkeypatch.setattr(FigureCanvasAgg, "draw_idle", lambda self, *a, **k: None)
    history = synthetic_history(5)
    user_fig = plt.figure()
    fignums = plt.get_fignums()
    plotter = CockpitPlotter()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "FigureCanvasAgg is non-interactive")
            plotter.plot(history)
            window = plotter.fig
            history.add(5, "Loss", 0.5)
            plotter.plot(history)  # an update draws into the same window
            assert plotter.fig is window
            assert plt.get_fignums() == [*fignums, window.number]
            assert plt.gcf() is user_fig
            plt.close(window)  # the user closes the window: the next call reopens
            plotter.plot(history)
            assert plotter.fig is not window
            assert plt.gcf() is user_fig
    finally:
        plt.close(user_fig)
        if plotter.fig is not None:
            plt.close(plotter.fig)


# --- gauges as data; 1.0.2's gauge functions and plotter module ---
def test_every_gauge_is_declared_once_and_takes_its_keys_by_name():
    import inspect

    for name, gauge in instruments.GAUGES.items():
        function = getattr(instruments, f"plot_{name}")
        params = inspect.signature(function).parameters
        expected = ["ax", "data", "show_log_iter", "upto", "labels"]
        expected += [role for role, _, _ in gauge.keys] + list(gauge.options)
        assert list(params) == expected, name
        for role, _, _ in gauge.keys:
            assert role in function.__doc__, name
    history = History({0: {"MyNorm": [3.0, 4.0]}, 1: {"MyNorm": [0.0, 2.0]}})
    fig = Figure()
    ax = fig.add_subplot()
    instruments.plot_grad_norm(ax, history, key="MyNorm")
    np.testing.assert_allclose(ax.collections[0].get_offsets()[:, 1], [5.0, 2.0])
    instruments.plot_grad_norm(ax, history)  # the default key is missing here
    assert ax.get_gid() == instruments.NO_DATA_GID
    assert any("track GradNorm" in t.get_text() for t in ax.texts)
    instruments.plot_distance(ax, history, update_key="MyNorm")
    assert ax.get_gid() == instruments.GAUGE_GID  # the update size alone is enough
    instruments.plot_distance(ax, history, update_key="Steps")
    assert any("track Distance and/or Steps" in t.get_text() for t in ax.texts)
    with pytest.raises(TypeError, match="distance_key"):
        instruments.plot_distance(ax, history, key="Distance")
    with pytest.raises(ValueError, match="choose one of"):
        instruments.draw_gauge("speedometer", ax, history)


def test_hist_2d_transformation_colours_the_raw_counts(real_log):
    path, cockpit, _ = real_log
    latest = cockpit.history[STEPS - 1]["GradHist2d"]
    counts = np.asarray(latest["hist"], dtype=float)
    fig = Figure()
    ax = fig.add_subplot()
    instruments.plot_hist_2d(ax, path, marginals=False, transformation=lambda c: c)
    mesh = ax.collections[0]
    shown = np.ma.masked_array(mesh.get_array())
    np.testing.assert_array_equal(shown.filled(0).reshape(counts.shape), counts)
    assert np.array_equal(np.ma.getmaskarray(shown).reshape(counts.shape), counts == 0)
    instruments.plot_hist_2d(ax, path, marginals=False)  # default: log10(count + 1)
    default = np.ma.masked_array(ax.collections[0].get_array()).filled(0)
    np.testing.assert_allclose(default.reshape(counts.shape), np.log10(counts + 1))


def test_reference_gauge_functions_draw_from_the_plotter(real_log):
    """Every 1.0.2 gauge, called as gauge(plotter, fig, gridspec) on a real run."""
    import cockpit.instruments as reference

    path, cockpit, n_params = real_log
    plotter = CockpitPlotter()
    with pytest.raises(RuntimeError, match=r"plotter.plot\(source\)"):
        reference.alpha_gauge(plotter, Figure(), Figure().add_gridspec(1, 1)[0, 0])
    plotter.load(path)
    fig = Figure(figsize=(16, 12))
    grid = fig.add_gridspec(4, 4)
    titles = {}
    for index, name in enumerate(reference.__all__):
        spec = grid[index // 4, index % 4]
        ax = getattr(reference, name)(plotter, fig, spec)
        assert ax.figure is fig and ax.get_subplotspec() == spec, name
        assert ax.get_gid() == instruments.GAUGE_GID and _has_data(ax), name
        titles[name] = ax
    assert len(reference.__all__) == 14
    assert titles["trace_gauge"].get_title() == "Trace"
    points = titles["grad_norm_gauge"].collections[0].get_offsets()
    expected = [math.sqrt(sum(v * v for v in cockpit.history[s]["GradNorm"]))
                for s in range(STEPS)]  # fmt: skip
    np.testing.assert_allclose(points[:, 1], expected, rtol=1e-12)

    layer = reference.histogram_2d_gauge(
        plotter, fig, grid[3, 2], marginals=False, idx=n_params - 1
    )
    assert layer.get_title() == f"Parameter {n_params - 1}"
    extra = instruments.extra_axes(layer)  # no marginals, only the colour bar
    assert [hasattr(a, "_colorbar") for a in extra] == [True]

    plotter.load(path, discard=2)  # discard and show_log_iter are honoured
    plotter.show_log_iter = True
    ax = reference.max_ev_gauge(plotter, fig, grid[3, 3])
    assert ax.collections[0].get_offsets()[:, 0].max() == 2
    assert ax.get_xscale() == "symlog"
    frame = plotter.tracking_data
    assert list(frame["iteration"]) == [0, 1, 2]
    assert frame["Loss"].tolist() == [cockpit.history[s]["Loss"] for s in range(3)]


def test_reference_gauge_without_data_says_so_and_warns_in_debug_mode():
    import cockpit.instruments as reference

    plotter = CockpitPlotter()
    plotter.load(History({0: {"Loss": 1.0}}))
    plotter.debug = True
    fig = Figure()
    with pytest.warns(UserWarning, match="track HessTrace"):
        ax = reference.trace_gauge(plotter, fig, fig.add_gridspec(1, 1)[0, 0])
    assert ax.get_gid() == instruments.NO_DATA_GID and ax.get_title() == "Trace"


def test_plotter_module_of_the_reference_package():
    import cockpit
    from cockpit.plotter import CockpitPlotter as FromPlotter

    assert FromPlotter is CockpitPlotter is cockpit.CockpitPlotter


# --- saving, animation, empty sources ---
def test_images_of_a_log_go_to_the_folder_named_after_it(tmp_path):
    log = synthetic_history(4).write_json(tmp_path / "run.json")
    plotter = CockpitPlotter(secondary_screen=True, dpi=20)
    saved = plotter.plot(log, show_plot=False, save_plot=True,
                         savename_append="__epoch__3")  # fmt: skip
    assert saved == [
        str(tmp_path / "run" / "cockpit__primary__epoch__3.png"),
        str(tmp_path / "run" / "cockpit__secondary__epoch__3.png"),
    ]
    assert all(matplotlib.image.imread(p).shape[:2] == (180, 320) for p in saved)
    # without ".json", as 1.0.2 names logs: the same folder
    again = plotter.plot(str(tmp_path / "run"), show_plot=False, save_plot=True,
                         savename="x", savefig_kwargs={"format": "pdf"})  # fmt: skip
    assert again[0] == str(tmp_path / "run" / "x__primary.pdf")
    with open(again[0], "rb") as handle:
        assert handle.read(5) == b"%PDF-"


def _solid_png(path, rgb):
    from PIL import Image

    Image.new("RGB", (8, 6), rgb).save(path)


def test_build_animation_stitches_the_reference_frame_names_in_number_order(tmp_path):
    from PIL import Image

    stem = tmp_path / "log"
    colours = {2: (255, 0, 0), 10: (0, 0, 255), 1: (0, 255, 0)}
    for epoch, rgb in colours.items():
        _solid_png(f"{stem}__primary__epoch__{epoch}.png", rgb)
    _solid_png(f"{stem}__secondary__epoch__1.png", (0, 0, 0))  # not asked for
    written = CockpitPlotter().build_animation(f"{stem}.json", duration=120, loop=2)
    assert written == [f"{stem}__primary.gif"]
    with Image.open(written[0]) as gif:
        assert gif.n_frames == 3
        assert gif.info["loop"] == 2 and gif.info["duration"] == 120
        seen = []
        for index in range(3):
            gif.seek(index)
            seen.append(gif.convert("RGB").getpixel((3, 3)))
    assert seen == [colours[1], colours[2], colours[10]]


def test_build_animation_from_dashboards_saved_during_a_run(tmp_path):
    from PIL import Image

    history = synthetic_history(6)
    log = history.write_json(tmp_path / "run.json")
    plotter = CockpitPlotter(secondary_screen=True, dpi=20)
    for epoch in (0, 1, 2):
        plotter.plot(log, show_plot=False, save_plot=True, discard=2 * epoch,
                     savename_append=f"__epoch__{epoch}")  # fmt: skip
    written = plotter.build_animation(log)
    assert written == [
        str(tmp_path / f"run__{s}.gif") for s in ("primary", "secondary")
    ]
    for path in written:
        with Image.open(path) as gif:
            assert gif.n_frames == 3 and gif.size == (320, 180)
    with pytest.raises(FileNotFoundError, match="savename_append"):
        plotter.build_animation(tmp_path / "other.json")
    for epoch in (0, 1):
        _solid_png(tmp_path / "run" / f"b__primary__epoch__{epoch}.png", (0, 0, 0))
    with pytest.raises(ValueError, match="2 runs"):
        plotter.build_animation(log)


def test_an_empty_source_is_an_error_not_an_empty_dashboard(tmp_path):
    from cockpit.errors import LogFileError

    log = History().write_json(tmp_path / "empty.json")
    plotter = CockpitPlotter()
    for source in (log, str(tmp_path / "empty")):
        with pytest.raises(LogFileError, match="no tracked steps") as caught:
            plotter.plot(source, show_plot=False)
        assert caught.value.path == log
    with pytest.raises(LogFileError, match="no tracked steps"):
        make_timelapse(log, tmp_path / "empty.gif")
    with pytest.raises(ValueError, match="History has no tracked steps") as caught:
        plotter.plot(History(), show_plot=False)
    assert not isinstance(caught.value, LogFileError)
    assert plotter.fig is None  # nothing was drawn


def test_an_untracked_cockpit_is_an_error(real_log):
    import torch

    from cockpit import Cockpit

    cockpit = Cockpit([torch.nn.Parameter(torch.zeros(2))], quantities=None)
    with pytest.raises(ValueError, match="Cockpit has no tracked steps"):
        CockpitPlotter().plot(cockpit, show_plot=False)


# --- diagnosis on the dashboard: non-finite steps, findings, learning rates ---
DIVERGE_AT = 3


@pytest.fixture(scope="module")
def diverged_run():
    """A real 6-step run whose gradients turn infinite at step DIVERGE_AT.

    An infinite gradient makes the SGD step put NaN into the parameters, so every
    later loss and gradient is NaN as well: the run diverges for good.
    """
    problem = make_problem("mlp", "mse", "sgd")
    first = problem.params[0]
    hook = []

    def blow_up(step):
        if step == DIVERGE_AT:
            hook.append(first.register_hook(lambda g: g * math.inf))

    quantities = [Q.Loss(linear(1)), Q.GradNorm(linear(1)), Q.Distance(linear(1)),
                  Q.UpdateSize(linear(1)), Q.Alpha(linear(1)),
                  Q.GradHist1d(linear(1))]  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cockpit = _train(problem, quantities, 6, before=blow_up)
    for h in hook:
        h.remove()
    return cockpit


def _train(problem, quantities, steps, optimizer=None, before=None):
    """Train ``problem`` with a cockpit (optionally a given optimizer and a hook
    ``before(step)`` called before each step); return the cockpit."""
    from cockpit import Cockpit

    optimizer = optimizer or problem.optimizer()
    cockpit = Cockpit(problem.params, quantities=quantities)
    for step in range(steps):
        if before is not None:
            before(step)
        x, y = problem.make_batch(step)
        optimizer.zero_grad()
        outputs = problem.model(x)
        loss = problem.loss_fn(outputs, y)
        losses = problem.individual_loss_fn(outputs, y)
        info = {"batch_size": x.shape[0], "loss": loss, "optimizer": optimizer,
                "individual_losses": losses}  # fmt: skip
        with cockpit(step, info=info):
            loss.backward(create_graph=cockpit.create_graph(step))
        optimizer.step()
    return cockpit


def _red_marks(ax):
    """x of the red vertical lines and x-ranges of the red bands on ``ax``."""
    from matplotlib.colors import to_rgba

    red = to_rgba(instruments.COLORS["red"])
    lines = [line.get_xdata()[0] for line in ax.lines
             if to_rgba(line.get_color())[:3] == red[:3]
             and len(set(line.get_xdata())) == 1]  # fmt: skip
    bands = [(patch.get_x(), patch.get_x() + patch.get_width())
             for patch in ax.patches
             if to_rgba(patch.get_facecolor())[:3] == red[:3]]  # fmt: skip
    return lines, bands


def test_nonfinite_steps_are_marked_where_the_curves_stop(diverged_run):
    history = diverged_run.history
    marked = [s for s in history.steps if "nonfinite" in history.view(s)]
    assert marked and marked[0] == DIVERGE_AT  # the run really diverged there
    assert marked == list(range(marked[0], history.steps[-1] + 1))  # and for good
    assert instruments.nonfinite_spans(history) == [(marked[0], marked[-1])]

    plotter = CockpitPlotter()
    plotter.plot(history, show_plot=False)
    plotter.fig.canvas.draw()
    by_title = {ax.get_title(): ax for ax in _gauge_axes(plotter)}
    for title in ("Gradient Norm", "Performance Plot", "Distance", "Hyperparameters"):
        ax = by_title[title]
        lines, bands = _red_marks(ax)
        assert lines == [marked[0]], title
        assert bands == [(marked[0], marked[-1])], title
        assert ax.get_xlim()[1] >= marked[-1], title  # the axis runs on to the end
        legend = instruments.extra_axes(ax)[-1] if title == "Distance" else ax
        texts = [t.get_text() for t in legend.get_legend().get_texts()]
        expected = f"{len(marked)} steps from {marked[0]}"
        assert any("non-finite" in t and expected in t for t in texts), title
    # the finite values stop where the run diverged
    points = by_title["Gradient Norm"].collections[0].get_offsets()
    assert points[:, 0].max() < marked[0]
    # a histogram of NaN gradients counts nothing, and says so
    last = history.steps[-1]
    assert sum(history[last]["GradHist1d"]["hist"]) == 0
    notes = [t.get_text() for t in by_title["Gradient Element Histogram"].texts]
    assert f"no finite value counted at step {last}" in notes
    # discard before the divergence: nothing to mark
    plotter.plot(history, show_plot=False, discard=marked[0] - 1)
    by_title = {ax.get_title(): ax for ax in _gauge_axes(plotter)}
    assert _red_marks(by_title["Gradient Norm"]) == ([], [])


def test_a_gauge_whose_values_are_all_nonfinite_says_so():
    history = History({s: {"Loss": math.nan, "nonfinite": ["loss"]} for s in (0, 1)})
    fig = Figure()
    ax = fig.add_subplot()
    instruments.plot_performance(ax, history)
    assert ax.get_gid() == instruments.GAUGE_GID
    assert any(t.get_text() == "no finite value" for t in ax.texts)
    assert _red_marks(ax) == ([0], [(0, 1)])


def _panel_texts(ax) -> list[str]:
    return [_full_text(t) for t in ax.texts]


def test_findings_panel_lists_what_diagnose_finds(diverged_run):
    from cockpit.diagnosis import NOT_CHECKED, diagnose

    history = diverged_run.history
    findings = diagnose(history)
    problems = [f for f in findings if f.id != NOT_CHECKED]
    assert any(f.id == "nonfinite" and f.severity == "error" for f in problems)
    plotter = CockpitPlotter()
    plotter.plot(history, show_plot=False)
    plotter.fig.canvas.draw()
    panel = _gauge_axes(plotter)[-1]
    assert panel.get_title() == "Diagnosis" and _has_data(panel)
    texts = _panel_texts(panel)
    badges = [t for t in texts if t in {"ERROR", "WARN", "INFO", "OK"}]
    label = {"error": "ERROR", "warning": "WARN", "info": "INFO"}
    assert badges == [label[f.severity] for f in problems]
    for finding in problems:
        first, last = finding.steps
        span = f"step {first}" if first == last else f"steps {first}–{last}"
        assert f"{finding.id}  ·  {span}" in texts
        assert finding.message in texts  # drawn on as many lines as fit
    assert "no problems found" not in texts
    # every visible line ends inside the panel
    renderer = plotter.fig.canvas.get_renderer()
    right = panel.get_window_extent(renderer).x1
    for text in panel.texts:
        if text.get_text():
            assert text.get_window_extent(renderer).x1 <= right + 0.5


def test_findings_panel_of_a_healthy_run_and_the_checks_that_could_not_run(real_log):
    from cockpit.diagnosis import NOT_CHECKED, diagnose

    path, cockpit, _ = real_log
    findings = diagnose(cockpit.history)
    fig = Figure(figsize=(6, 2.5))
    ax = fig.add_subplot()
    instruments.plot_findings(ax, path)
    texts = _panel_texts(ax)
    healthy = not any(f.severity != "info" for f in findings)
    assert ("no problems found" in texts) == healthy
    assert ("OK" in texts) == healthy
    skipped = [f for f in findings if f.id == NOT_CHECKED]
    lines = [t for t in texts if t.startswith("not checked: ")]
    if skipped:
        (line,) = lines
        for check in skipped[0].evidence["checks"]:
            assert check in line
    else:
        assert not lines
    # a run without problems says so; what did not run is not a problem
    ok = History({s: {"Loss": 1.0 - 0.1 * s} for s in range(3)})
    instruments.plot_findings(ax, ok)
    texts = _panel_texts(ax)
    assert texts[:2] == ["OK", "no problems found"]
    assert any(t.startswith("not checked: ") for t in texts)


def test_findings_follow_discard_and_new_steps(diverged_run):
    from cockpit.diagnosis import diagnose

    history = diverged_run.history
    live = History()
    plotter = CockpitPlotter()

    def shown():
        panel = _gauge_axes(plotter)[-1]
        return [t for t in _panel_texts(panel) if "  ·  " in t]

    def expected(upto):
        part = History({s: history[s] for s in history.steps if s <= upto})
        return [f.id for f in diagnose(part) if f.id != "not_checked"]

    for step in history.steps:  # a live run: the panel reads the new steps only
        for key, value in history[step].items():
            live.add(step, key, value)
        plotter.plot(live, show_plot=False)
        assert [t.split("  ·  ")[0] for t in shown()] == expected(step), step
    plotter.plot(live, show_plot=False, discard=DIVERGE_AT - 1)
    assert [t.split("  ·  ")[0] for t in shown()] == expected(DIVERGE_AT - 1)


def test_learning_rate_gauge_draws_every_parameter_group():
    import torch

    problem = make_problem("mlp", "ce", "sgd")
    weights, biases = problem.params[0::2], problem.params[1::2]
    optimizer = torch.optim.SGD([{"params": weights, "lr": 0.1},
                                 {"params": biases, "lr": 0.02}])  # fmt: skip

    def decay(step):
        if step == 3:
            optimizer.param_groups[0]["lr"] /= 2

    cockpit = _train(problem, [Q.Loss(linear(1))], 5, optimizer, before=decay)
    history = cockpit.history
    steps, rates = history.series("learning_rates")
    assert len(rates[0]) == 2 and "learning_rate" not in history.keys
    fig = Figure()
    ax = fig.add_subplot()
    instruments.plot_hyperparameters(ax, history)
    assert ax.get_gid() == instruments.GAUGE_GID  # no "no data"
    assert len(ax.lines) == 2
    for group, line in enumerate(ax.lines):
        np.testing.assert_array_equal(line.get_xdata(), steps)
        np.testing.assert_allclose(line.get_ydata(), [r[group] for r in rates])
        assert line.get_drawstyle() == "steps-post"
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels[0].startswith("group 0") and labels[1].startswith("group 1")
    assert ax.get_ylim()[0] == 0.0

    # the 1.0.2 key from Cockpit.log alone is drawn too
    logged = History({s: {"learning_rate": 0.5} for s in (0, 4, 8)})
    instruments.plot_hyperparameters(ax, logged)
    (line,) = ax.lines
    np.testing.assert_array_equal(line.get_xdata(), [0, 4, 8])
    np.testing.assert_allclose(line.get_ydata(), [0.5] * 3)


def test_groups_with_equal_rates_share_a_line_and_the_cache_follows_the_run():
    history = History({s: {"learning_rates": [0.1, 0.1, 0.01]} for s in range(3)})
    data = DashboardData(history)
    data.refresh()
    fig = Figure()
    ax = fig.add_subplot()
    instruments.plot_hyperparameters(ax, data)
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert [label.split(",")[0] for label in labels] == ["groups 0-1", "group 2"]
    history.add(3, "learning_rates", [0.05, 0.1, 0.01, 0.2])  # a group was added
    data.refresh()
    series = instruments.element_series(data, "learning_rates")
    assert [list(s.steps) for s in series] == [[0, 1, 2, 3]] * 3 + [[3]]
    assert [s.values[-1] for s in series] == [0.05, 0.1, 0.01, 0.2]


def test_a_constant_learning_rate_has_a_readable_axis(tmp_path):
    for rate in (3e-4, 0.1, 7.0):
        history = History({s: {"learning_rates": [rate]} for s in range(5)})
        fig = Figure(figsize=(4, 2.5))
        ax = fig.add_subplot()
        instruments.plot_hyperparameters(ax, history)
        fig.savefig(tmp_path / "lr.png")
        low, high = ax.get_ylim()
        labels = [t.get_text() for t in ax.get_yticklabels()
                  if low <= t.get_position()[1] <= high]  # fmt: skip
        assert len(labels) >= 3 and len(set(labels)) == len(labels), labels
        assert "0" in labels
        assert low == 0.0 and rate < high < 1.5 * rate


def test_hist_2d_has_a_colour_bar_in_counts(real_log):
    path, cockpit, _ = real_log
    counts = np.asarray(cockpit.history[STEPS - 1]["GradHist2d"]["hist"], float)
    fig = Figure()
    for marginals in (True, False):
        ax = fig.add_subplot()
        instruments.plot_hist_2d(ax, path, marginals=marginals)
        heat = instruments.extra_axes(ax)[0] if marginals else ax
        bar = heat.collections[0].colorbar
        assert bar is not None and bar.ax in instruments.extra_axes(ax)
        assert bar.vmax == pytest.approx(np.log10(counts.max() + 1))
        long = bar.ax.xaxis if marginals else bar.ax.yaxis
        ticks = [float(t.get_text().replace("k", "e3")) for t in long.get_ticklabels()]
        assert ticks and all(1 <= t <= counts.max() for t in ticks)
        fig.clear()


def test_alpha_and_gradient_tests_explain_their_geometry():
    history = synthetic_history(steps=10)
    fig = Figure()
    ax = fig.add_subplot()
    expected = ((instruments.plot_alpha, ("parabola", "minimum")),
                (instruments.plot_gradient_tests, ("unit circle", "band")))  # fmt: skip
    for gauge, words in expected:
        gauge(ax, history)
        captions = [t.full_text for t in ax.texts if isinstance(t, FittedText)]
        assert len(captions) == 1 and all(w in captions[0] for w in words)


def test_a_quantity_tracked_without_values_keeps_its_gauge_and_says_why():
    """TICDiag recorded only as missing (its curvature could not be formed) is not
    "not tracked": the TIC gauge stays and names the key and the reason's start."""
    reason = "BackPACK cannot compute curvature diagonals for this model. Fix: ..."
    history = History()
    for step, entries in synthetic_history(5).items():
        for key, value in entries.items():
            if key != "TICDiag":
                history.add(step, key, value)
        history.add(step, "missing", {"TICDiag": reason})
    plotter = CockpitPlotter()
    plotter.plot(history, show_plot=False)
    texts = [t.get_text() for t in plotter.fig.findobj(matplotlib.text.Text)]
    assert not [t for t in texts if "not shown" in t and "TICDiag" in t], texts
    (hint,) = [t for t in texts if "TICDiag tracked, no value" in t]
    assert "BackPACK cannot compute curvature diagonals for this model" in hint
