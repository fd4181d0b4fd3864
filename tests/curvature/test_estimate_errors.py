"""Estimated values carry their standard errors from the log to the dashboard.

HessTrace on a model BackPACK has no exact curvature for is a Hutchinson estimate.
The log entry ``HessTrace_estimate`` holds per-parameter standard errors and the
standard error of their sum (the parameters share the probes, so their errors are
correlated); the plotting data layer hands out the standard error of the drawn
(summed) value aligned with it, and the Trace gauge draws a ±2 SE band and says
"(estimated)". Exact runs look as before.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import torch

from cockpit import Cockpit
from cockpit import quantities as Q
from cockpit.curvature.hutchinson import hessian_diagonal, sum_error, trace_errors
from cockpit.history import History
from cockpit.plotting import CockpitPlotter, DashboardData, instruments
from cockpit.plotting.data import Series, estimate_error, read_log
from cockpit.utils.schedules import linear
from tests.utils.any_model import make_any_problem
from tests.utils.problems import make_problem

STEPS = 3


def tracked_run(problem, logpath=None, steps=STEPS):
    """Train ``steps`` steps tracking HessTrace and Loss; return the cockpit."""
    optimizer = problem.optimizer()
    cockpit = Cockpit(
        problem.params,
        [Q.HessTrace(linear(1), curvature="hutchinson"), Q.Loss(linear(1))],
        logpath=logpath,
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Full backward hook")
        for step in range(steps):
            x, y = problem.make_batch(step)
            optimizer.zero_grad()
            outputs = problem.model(x)
            loss = problem.loss_fn(outputs, y)
            info = {
                "batch_size": x.shape[0],
                "individual_losses": problem.individual_loss_fn(outputs, y),
                "loss": loss,
            }
            with cockpit(step, info=info):
                loss.backward()
            optimizer.step()
    return cockpit


# --- the engine and the log entry ---------------------------------------------------
def test_logged_errors_are_those_of_the_probes_drawn():
    """The entry's numbers from their definitions: the same probes (the cockpit's
    source is seeded with 0) give the per-probe traces ``t_kp``; ``stderr`` is
    ``std_k t_kp / sqrt(K)`` and ``stderr_sum`` is ``std_k (sum_p t_kp) / sqrt(K)``."""
    problem = make_any_problem("rmsnorm-mlp", batch_size=6)
    x, y = problem.make_batch(0)
    losses = problem.individual_loss_fn(problem.model(x), y)
    drawn = hessian_diagonal(
        losses, problem.params, 16, torch.Generator().manual_seed(0)
    )
    diagonals, table = drawn.diagonals, drawn.traces
    cockpit = tracked_run(make_any_problem("rmsnorm-mlp", batch_size=6), steps=1)
    values = cockpit.history.to_dict()[0]
    entry = values["HessTrace_estimate"]
    assert set(entry) == {"method", "probes", "curvature", "stderr", "stderr_sum"}
    assert entry["curvature"] == "hessian"
    probes = table.shape[0]
    assert probes == entry["probes"] == 16
    np.testing.assert_allclose(values["HessTrace"], [float(d.sum()) for d in diagonals])
    want = [float(t.std() / math.sqrt(probes)) for t in table.T]
    np.testing.assert_allclose(entry["stderr"], want, rtol=1e-12)
    totals = table.sum(dim=1)
    assert math.isclose(
        entry["stderr_sum"], float(totals.std() / math.sqrt(probes)), rel_tol=1e-12
    )


def test_standard_error_of_the_sum_matches_repeated_estimates():
    """Over 400 repeated estimates (8 probes each) the variance of the summed trace
    matches the mean squared ``sum_error`` (their ratio has a relative spread of
    about 0.08 at 400 repeats: band [0.8, 1.25]). Combining the per-parameter
    errors as if independent, ``sqrt(sum_p se_p^2)``, misses about half the
    variance on this model (the shared probes correlate the blocks), so a data
    layer doing that would fail here."""
    problem = make_any_problem("rmsnorm-mlp", batch_size=6)
    x, y = problem.make_batch(0)
    generator = torch.Generator().manual_seed(1)
    totals, squared, independent = [], [], []
    for _ in range(400):
        losses = problem.individual_loss_fn(problem.model(x), y)
        drawn = hessian_diagonal(losses, problem.params, 8, generator)
        table = drawn.traces
        errors = trace_errors(table)
        totals.append(sum(float(d.sum()) for d in drawn.diagonals))
        squared.append(float(sum_error(table)) ** 2)
        independent.append(float((torch.stack(errors) ** 2).sum()))
    variance = float(np.var(totals, ddof=1))
    assert 0.8 < np.mean(squared) / variance < 1.25, np.mean(squared) / variance
    assert np.mean(independent) / variance < 0.7


# --- the data layer -----------------------------------------------------------------
def estimate(stderr, total=None):
    entry = {"method": "hutchinson", "probes": 4, "stderr": stderr}
    if total is not None:
        entry["stderr_sum"] = total
    return entry


def test_data_layer_aligns_standard_errors_with_the_values():
    """Step 0 estimated (a log of this cockpit: ``stderr_sum``), step 1 exact, step
    2 estimated in an older log (no ``stderr_sum``: the per-parameter errors
    added, an upper bound, flagged), step 3 arrives on refresh."""
    key = "HessTrace_estimate"
    history = History(
        {
            0: {"HessTrace": [1.0, 2.0], key: estimate([0.3, 0.4], 0.6)},
            1: {"HessTrace": [1.5, 2.5]},
            2: {"HessTrace": [0.5, 0.25], key: estimate([0.1, 0.2])},
        }
    )
    data = DashboardData(history)
    data.refresh()
    series = data.series("HessTrace", "sum")
    np.testing.assert_array_equal(series.steps, [0, 1, 2])
    np.testing.assert_array_equal(series.values, [3.0, 4.0, 0.75])
    np.testing.assert_allclose(series.errors, [0.6, math.nan, 0.1 + 0.2])
    assert series.error_bound
    history.add(3, "HessTrace", [2.0, 2.0])
    history.add(3, "HessTrace_estimate", estimate([0.5, 0.5], 0.25))
    data.refresh()
    np.testing.assert_allclose(series.errors, [0.6, math.nan, 0.3, 0.25])
    steps, values, _, errors = series.view_errors()
    np.testing.assert_array_equal(steps, [0, 1, 2, 3])
    np.testing.assert_allclose(errors, [0.6, math.nan, 0.3, 0.25])
    # per-parameter values have no error of a norm; a single value its own
    assert math.isnan(estimate_error(estimate([0.3, 0.4], 0.6), "norm")[0])
    assert estimate_error(estimate([0.7]), "scalar") == (0.7, False)
    assert estimate_error(estimate([0.7]), "sum") == (0.7, False)  # one: no bound
    exact = DashboardData(History({0: {"HessTrace": [1.0]}}))
    exact.refresh()
    assert not exact.series("HessTrace", "sum").error_bound


def test_thinned_views_keep_each_error_with_its_value():
    series = Series()
    for step in range(5000):
        value = math.sin(step / 50.0) + 2.0
        series.append(step, value, value / 10 if step % 3 else math.nan)
    steps, values, _, errors = series.view_errors(upto=4000, max_points=100)
    assert len(steps) < 200 and steps[-1] == 4000
    estimated = steps % 3 != 0
    np.testing.assert_allclose(errors[estimated], values[estimated] / 10)
    assert np.isnan(errors[~estimated]).all()


def test_log_readers_keep_every_steps_estimate(tmp_path):
    """The dashboard reads logs keeping only the latest histogram per key; the
    estimates (small mappings) stay at every step, streamed or written."""
    cockpit = tracked_run(
        make_any_problem("rmsnorm-mlp", batch_size=6), logpath=str(tmp_path / "run")
    )
    written = cockpit.write(tmp_path / "written")
    want = [
        cockpit.history[s]["HessTrace_estimate"]["stderr_sum"] for s in range(STEPS)
    ]
    for path in (cockpit.logpath, written):
        series = read_log(path).series("HessTrace", "sum")
        np.testing.assert_allclose(series.errors, want, rtol=1e-12)


# --- the dashboard ------------------------------------------------------------------
def _trace_axes(plotter):
    (ax,) = [ax for gauge, ax in plotter._gauge_axes if gauge is instruments.plot_trace]
    return ax


def test_dashboard_draws_a_two_standard_error_band_around_estimates():
    cockpit = tracked_run(make_any_problem("rmsnorm-mlp", batch_size=6))
    plotter = CockpitPlotter()
    plotter.plot(cockpit, show_plot=False)
    ax = _trace_axes(plotter)
    assert ax.get_title() == "Trace (estimated)"
    gid = instruments.ESTIMATE_BAND_GID
    (band,) = [c for c in ax.collections if c.get_gid() == gid]
    history = cockpit.history
    vertices = band.get_paths()[0].vertices
    for step in range(STEPS):
        value = sum(history[step]["HessTrace"])
        error = history[step]["HessTrace_estimate"]["stderr_sum"]
        at = vertices[vertices[:, 0] == step, 1]
        np.testing.assert_allclose(
            sorted({float(y) for y in at}), [value - 2 * error, value + 2 * error]
        )
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert any(label.startswith("trace (estimated): last") for label in labels)
    assert "±2 SE of the estimate" in labels
    # the points are the values, as for exact runs
    points = [c for c in ax.collections if c.get_gid() != instruments.ESTIMATE_BAND_GID]
    np.testing.assert_allclose(
        points[0].get_offsets()[:, 1],
        [sum(history[s]["HessTrace"]) for s in range(STEPS)],
    )


def test_dashboard_of_an_exact_run_has_no_band():
    problem = make_problem("mlp", "ce")  # BackPACK's exact Hessian diagonal
    cockpit = tracked_run(problem)
    assert "HessTrace_estimate" not in cockpit.history.keys
    plotter = CockpitPlotter()
    plotter.plot(cockpit, show_plot=False)
    ax = _trace_axes(plotter)
    assert ax.get_title() == "Trace"
    assert all(c.get_gid() != instruments.ESTIMATE_BAND_GID for c in ax.collections)
    assert not any("SE" in t.get_text() for t in ax.get_legend().get_texts())
