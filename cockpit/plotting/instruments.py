"""The gauges: one function per instrument, each drawing onto an ``Axes`` it is given.

Every gauge has the signature ``plot_<thing>(ax, data, *, <keys>, show_log_iter,
upto) -> Axes``:

* ``ax``: a matplotlib ``Axes``; the gauge clears it (and anything it added to it on
  an earlier call, such as a twin axis) before drawing, so calling it again redraws.
* ``data``: a :class:`~cockpit.plotting.data.DashboardData` (what the plotter passes,
  read incrementally), or anything :func:`~cockpit.plotting.data.as_history`
  accepts: a ``History``, a ``Cockpit``, a log path.
* keyword ``key`` arguments: the history keys to read (defaults: the class names, as
  cockpit writes them); ``show_log_iter``: symmetric-log iteration axis; ``upto``:
  ignore steps after this one.

A gauge whose data is missing keeps its title and says what to track instead of
disappearing (its ``Axes`` gets the gid :data:`NO_DATA_GID`). Gauges never touch
global matplotlib state; wrap calls in :func:`~cockpit.plotting.style.dashboard_style`
for the dashboard's look.
"""

from __future__ import annotations

import math
import weakref
from typing import Any, Sequence

import numpy as np
from matplotlib.axes import Axes
from matplotlib.colors import Normalize
from matplotlib.patches import Circle
from matplotlib.ticker import LogLocator, NullFormatter

from cockpit.plotting.data import DashboardData, as_data
from cockpit.plotting.style import (
    COLORS,
    HISTOGRAM_CMAP,
    ITERATION_CMAP,
    format_number,
    no_data,
    style_iteration_axis,
    style_value_axis,
)

#: ``Axes.get_gid()`` of a gauge that had nothing to draw.
NO_DATA_GID = "cockpit-no-data"

#: ``Axes.get_gid()`` of a gauge that drew data.
GAUGE_GID = "cockpit-gauge"

# Axes a gauge added next to the one it was given (twins, insets), removed on redraw.
_EXTRA_AXES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


# --- helpers ---
def _reset(ax: Axes) -> None:
    """Undo an earlier gauge call on ``ax``: remove its twins/insets and clear it."""
    for extra in _EXTRA_AXES.pop(ax, []):
        try:
            extra.remove()
        except (KeyError, ValueError, AttributeError):  # already gone with a clear
            pass
    ax.clear()
    ax.set_axis_on()
    ax.set_gid(None)


def _extra(ax: Axes, new: Axes) -> Axes:
    _EXTRA_AXES.setdefault(ax, []).append(new)
    return new


def _twinx(ax: Axes) -> Axes:
    twin = _extra(ax, ax.twinx())
    twin.grid(False)
    return twin


def _empty(ax: Axes, title: str, hint: str) -> Axes:
    no_data(ax, title, hint)
    ax.set_gid(NO_DATA_GID)
    return ax


def _done(ax: Axes) -> Axes:
    ax.set_gid(GAUGE_GID)
    return ax


def _use_log(values: np.ndarray) -> bool:
    """Log scale for positive data spanning more than two decades."""
    finite = values[np.isfinite(values)]
    if finite.size < 2 or np.any(finite <= 0):
        return False
    return float(finite.max() / finite.min()) > 100.0


def _value_axis(ax: Axes, values: np.ndarray, log: bool | None = None) -> None:
    if log is None:
        log = _use_log(values)
    if log:
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(numticks=5))
        ax.yaxis.set_minor_formatter(NullFormatter())
    else:
        style_value_axis(ax)


def _scatter_with_ema(
    ax: Axes,
    steps: np.ndarray,
    values: np.ndarray,
    ema: np.ndarray,
    label: str,
    color: str | None = None,
    ema_color: str | None = None,
    norm: Normalize | None = None,
) -> None:
    """Points (coloured by iteration unless ``color`` is given) plus their EMA."""
    kwargs: dict[str, Any] = {"s": 7, "linewidths": 0, "alpha": 0.6, "zorder": 2}
    if color is None:
        if norm is None:
            norm = Normalize(vmin=float(steps[0]), vmax=float(max(steps[-1], 1)))
        ax.scatter(steps, values, c=steps, cmap=ITERATION_CMAP, norm=norm, **kwargs)
    else:
        ax.scatter(steps, values, color=color, **kwargs)
    last, smooth = format_number(float(values[-1])), format_number(float(ema[-1]))
    ax.plot(
        steps,
        ema,
        color=ema_color or COLORS["dark"],
        linewidth=1.3,
        zorder=3,
        label=f"{label}: last {last}, EMA {smooth}",
    )


def _series_gauge(
    ax: Axes,
    data: DashboardData,
    title: str,
    key: str,
    reduce: str,
    ylabel: str,
    show_log_iter: bool,
    upto: int | None,
    log: bool | None = None,
    hint: str | None = None,
) -> Axes:
    """One quantity vs iteration: points coloured by iteration plus the EMA."""
    steps, values, ema = data.series(key, reduce).view(upto)
    if len(steps) == 0:
        return _empty(ax, title, hint or f"track {key}")
    _scatter_with_ema(ax, steps, values, ema, ylabel)
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    _value_axis(ax, values, log)
    style_iteration_axis(ax, show_log_iter)
    ax.legend(loc="best")
    return _done(ax)


# --- STEP SIZE ---
def plot_alpha(
    ax: Axes,
    data: Any,
    *,
    key: str = "Alpha",
    show_log_iter: bool = False,
    upto: int | None = None,
    bins: int = 40,
    recent: float = 0.1,
) -> Axes:
    """Alpha Distribution: where steps land on a local quadratic fit.

    Draws the unit parabola (the 1-D quadratic along the step, start at -1, its
    minimum at 0, the point of equal height at +1) and on a twin axis the
    histogram of all alpha values (gray) and of the most recent ones (blue), with
    their means in the legend. Values beyond the x-range are counted at the edges.
    alpha < 0: steps too short; near 0: land in the minimum; > 0: overshoot.

    Args:
        ax: Axes to draw on.
        data: The run (see module docstring).
        key: History key of the alpha values.
        show_log_iter: Unused (no iteration axis); accepted for uniformity.
        upto: Ignore steps after this one.
        bins: Number of histogram bins on [-1.5, 1.5].
        recent: Fraction of the most recent values shown separately.

    Returns:
        ``ax``.
    """
    data = as_data(data)
    _reset(ax)
    title = "Alpha Distribution"
    _, values, _ = data.series(key).view(upto, max_points=None)
    if len(values) < 2:
        return _empty(ax, title, f"track {key} (needs 2 values)")
    lo, hi = -1.5, 1.5
    x = np.linspace(lo, hi, 121)
    ax.plot(x, x**2, color=COLORS["orange"], linewidth=1.5, zorder=3)
    for position in (-1.0, 0.0, 1.0):
        ax.axvline(position, color=COLORS["gray"], linestyle=":", linewidth=0.8)
    ax.set_xlim(lo, hi)
    ax.set_ylim(0, 1.75)
    ax.set_yticks([])
    ax.set_xticks([-1.5, -1, -0.5, 0, 0.5, 1, 1.5])
    ax.set_xlabel("normalized step length α")
    ax.set_title(title)

    edges = np.linspace(lo, hi, bins + 1)
    clipped = np.clip(values, lo, np.nextafter(hi, lo))
    n_recent = max(1, math.ceil(recent * len(values)))
    twin = _twinx(ax)
    peak = 0.0
    for subset, color, name in (
        (clipped, COLORS["gray"], "all"),
        (clipped[-n_recent:], COLORS["blue"], f"last {recent:.0%}"),
    ):
        counts, _ = np.histogram(subset, edges)
        density = counts / (len(subset) * (edges[1] - edges[0]))
        peak = max(peak, float(density.max()))
        mean = float(np.mean(values[-len(subset) :]))
        twin.stairs(
            density,
            edges,
            fill=True,
            color=color,
            alpha=0.45,
            label=f"{name}: mean {mean:+.2f}",
        )
    twin.set_ylim(0, 1.25 * peak if peak > 0 else 1)
    twin.set_yticks([])
    twin.legend(loc="upper center", ncols=2)
    below, above = int(np.sum(values < lo)), int(np.sum(values > hi))
    if below:
        ax.annotate(f"◀ {below}", (0.01, 0.04), xycoords="axes fraction", fontsize=7)
    if above:
        ax.annotate(
            f"{above} ▶", (0.99, 0.04), xycoords="axes fraction", ha="right", fontsize=7
        )
    return _done(ax)


def plot_distance(
    ax: Axes,
    data: Any,
    *,
    distance_key: str = "Distance",
    update_key: str = "UpdateSize",
    show_log_iter: bool = False,
    upto: int | None = None,
) -> Axes:
    """Distance: ``||θ_t − θ_0||`` (left axis) and the update size (right axis).

    Both are combined over parameters as the norm of the whole parameter vector.

    Args:
        ax: Axes to draw on.
        data: The run (see module docstring).
        distance_key: History key of the distance from the start.
        update_key: History key of the update size.
        show_log_iter: Symmetric-log iteration axis.
        upto: Ignore steps after this one.

    Returns:
        ``ax``.
    """
    data = as_data(data)
    _reset(ax)
    title = "Distance"
    distance = data.series(distance_key, "norm").view(upto)
    update = data.series(update_key, "norm").view(upto)
    if len(distance[0]) == 0 and len(update[0]) == 0:
        return _empty(ax, title, f"track {distance_key} and/or {update_key}")
    ax.set_title(title)
    style_iteration_axis(ax, show_log_iter)
    handles = []
    if len(distance[0]):
        _scatter_with_ema(ax, *distance, "distance", COLORS["blue"], "#173a63")
        ax.set_ylabel("distance from start", color=COLORS["blue"])
        _value_axis(ax, distance[1], log=False)
        handles += ax.get_legend_handles_labels()[0]
    else:
        ax.set_yticks([])
    if len(update[0]):
        twin = _twinx(ax)
        _scatter_with_ema(twin, *update, "update", COLORS["orange"], "#8a4410")
        twin.set_ylabel("update size", color=COLORS["orange"])
        _value_axis(twin, update[1])
        handles += twin.get_legend_handles_labels()[0]
    ax.legend(handles=handles, loc="upper left")
    return _done(ax)


def plot_grad_norm(
    ax: Axes,
    data: Any,
    *,
    key: str = "GradNorm",
    show_log_iter: bool = False,
    upto: int | None = None,
) -> Axes:
    """Gradient Norm: ``||g||`` of the whole mini-batch gradient vs iteration.

    Args:
        ax: Axes to draw on.
        data: The run (see module docstring).
        key: History key of the per-parameter gradient norms.
        show_log_iter: Symmetric-log iteration axis.
        upto: Ignore steps after this one.

    Returns:
        ``ax``.
    """
    data = as_data(data)
    _reset(ax)
    return _series_gauge(
        ax, data, "Gradient Norm", key, "norm", "‖g‖", show_log_iter, upto
    )


# --- GRADIENTS ---
def plot_gradient_tests(
    ax: Axes,
    data: Any,
    *,
    norm_key: str = "NormTest",
    inner_key: str = "InnerTest",
    ortho_key: str = "OrthoTest",
    show_log_iter: bool = False,
    upto: int | None = None,
) -> Axes:
    """Gradient Tests: the latest norm, inner-product and orthogonality tests.

    Left: the latest values as shapes around the origin (circle: norm test, radius
    ``T_norm``; horizontal band: inner-product test ``±T_inner``; vertical band:
    orthogonality test ``±T_ortho``) with the dashed unit circle for reference: a
    test with tolerance θ passes while its shape stays within radius θ, so shapes
    far outside the unit circle mean the batch is too small for the gradient's
    noise. Right: the three tests vs iteration (log scale).

    Args:
        ax: Axes to draw on (used as a frame for two panels).
        data: The run (see module docstring).
        norm_key: History key of the norm test.
        inner_key: History key of the inner-product test.
        ortho_key: History key of the orthogonality test.
        show_log_iter: Symmetric-log iteration axis.
        upto: Ignore steps after this one.

    Returns:
        ``ax``.
    """
    data = as_data(data)
    _reset(ax)
    title = "Gradient Tests"
    specs = (
        (norm_key, "norm", COLORS["blue"]),
        (inner_key, "inner", COLORS["orange"]),
        (ortho_key, "ortho", COLORS["green"]),
    )
    views = [(data.series(key).view(upto), name, color) for key, name, color in specs]
    if all(len(view[0]) == 0 for view, _, _ in views):
        return _empty(ax, title, f"track {norm_key}, {inner_key}, {ortho_key}")
    ax.set_title(title)
    ax.set_axis_off()
    shape = _extra(ax, ax.inset_axes([0.0, 0.0, 0.36, 0.95]))
    history = _extra(ax, ax.inset_axes([0.52, 0.0, 0.48, 0.95]))

    latest = {name: float(view[1][-1]) for view, name, _ in views if len(view[0])}
    limit = max(1.5, 1.15 * max(latest.values()))
    shape.set_xlim(-limit, limit)
    shape.set_ylim(-limit, limit)
    shape.set_aspect("equal", adjustable="box")
    shape.add_patch(
        Circle((0, 0), 1.0, fill=False, linestyle="--", color=COLORS["gray"], lw=0.8)
    )
    if "inner" in latest:
        shape.axhspan(
            -latest["inner"], latest["inner"], color=COLORS["orange"], alpha=0.3
        )
    if "ortho" in latest:
        shape.axvspan(
            -latest["ortho"], latest["ortho"], color=COLORS["green"], alpha=0.3
        )
    if "norm" in latest:
        shape.add_patch(
            Circle((0, 0), latest["norm"], color=COLORS["blue"], alpha=0.3, lw=0)
        )
    shape.axhline(0, color=COLORS["dark"], lw=0.6)
    shape.axvline(0, color=COLORS["dark"], lw=0.6)
    shape.xaxis.set_major_formatter(format_number)
    shape.yaxis.set_major_formatter(format_number)
    shape.locator_params(nbins=3)
    shape.set_xlabel("latest, unit circle = 1", fontsize=7)

    for (steps, values, _), name, color in views:
        if len(steps):
            history.plot(
                steps,
                values,
                color=color,
                marker=".",
                markersize=2.5,
                lw=0.9,
                label=f"{name} {format_number(values[-1])}",
            )
    history.axhline(1.0, color=COLORS["gray"], linestyle="--", lw=0.8)
    all_values = np.concatenate([view[1] for view, _, _ in views])
    _value_axis(history, all_values)
    style_iteration_axis(history, show_log_iter)
    history.legend(loc="best")
    return _done(ax)


def plot_hist_1d(
    ax: Axes,
    data: Any,
    *,
    key: str = "GradHist1d",
    show_log_iter: bool = False,
    upto: int | None = None,
) -> Axes:
    """Gradient Element Histogram: counts of individual gradient elements (log).

    Values outside the histogram's range are clipped into the two edge bins, so
    mass piling up at the edges means the range (or the data's scale) is off.

    Args:
        ax: Axes to draw on.
        data: The run (see module docstring).
        key: History key of ``{"hist": [bins], "edges": [bins + 1]}`` entries.
        show_log_iter: Unused (no iteration axis); accepted for uniformity.
        upto: Ignore steps after this one (the last histogram up to it is drawn).

    Returns:
        ``ax``.
    """
    data = as_data(data)
    _reset(ax)
    title = "Gradient Element Histogram"
    found = data.latest(key, upto)
    if found is None:
        return _empty(ax, title, f"track {key}")
    step, value = found
    counts = np.asarray(value["hist"], dtype=float)
    edges = np.asarray(value["edges"], dtype=float)
    positive = counts[counts > 0]
    floor = 0.8 * (positive.min() if positive.size else 1.0)
    ax.stairs(
        np.maximum(counts, floor),
        edges,
        baseline=floor,
        fill=True,
        color=COLORS["orange"],
        alpha=0.85,
    )
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(numticks=5))
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_ylim(bottom=floor)
    ax.set_xlim(edges[0], edges[-1])
    style_value_axis(ax, "x")
    ax.set_xlabel("gradient element value")
    ax.set_ylabel("count")
    ax.set_title(title)
    ax.text(
        0.99, 0.96, f"step {step}", ha="right", va="top", fontsize=7,
        transform=ax.transAxes, color=COLORS["dark"],
    )  # fmt: skip
    return _done(ax)


def _hist_2d_entry(value: Any, param: int | None) -> dict[str, Any] | None:
    if param is None:
        return value
    return value.get(f"param_{param}")


def plot_hist_2d(
    ax: Axes,
    data: Any,
    *,
    key: str = "GradHist2d",
    param: int | None = None,
    show_log_iter: bool = False,
    upto: int | None = None,
    marginals: bool = True,
) -> Axes:
    """Gradient/Parameter Element Histogram: gradient elements vs parameter values.

    A heat map of ``log10(count + 1)`` with the parameter value on the x-axis and
    the individual gradient element on the y-axis, with marginal histograms on top
    (parameters) and on the right (gradients).

    Args:
        ax: Axes to draw on (used as a frame for the heat map and its marginals).
        data: The run (see module docstring).
        key: History key of ``{"hist": [xbins, ybins], "edges": [xedges, yedges]}``
            entries (x: gradient, y: parameter, as cockpit writes them).
        param: Draw the histogram of this parameter tensor (needs
            ``GradHist2d(..., keep_individual=True)``) instead of all of them.
        show_log_iter: Unused (no iteration axis); accepted for uniformity.
        upto: Ignore steps after this one.
        marginals: Draw the two marginal histograms.

    Returns:
        ``ax``.
    """
    data = as_data(data)
    _reset(ax)
    if param is None:
        title = "Gradient/Parameter Element Histogram (all)"
    else:
        title = f"Parameter {param}"
    found = data.latest(key, upto)
    entry = _hist_2d_entry(found[1], param) if found is not None else None
    if entry is None:
        hint = f"track {key}"
        if param is not None:
            hint += " with keep_individual=True"
        return _empty(ax, title, hint)
    counts = np.asarray(entry["hist"], dtype=float)
    grad_edges = np.asarray(entry["edges"][0], dtype=float)
    param_edges = np.asarray(entry["edges"][1], dtype=float)
    ax.set_title(title)
    if marginals:
        ax.set_axis_off()
        heat = _extra(ax, ax.inset_axes([0.0, 0.0, 0.8, 0.76]))
        top = _extra(ax, ax.inset_axes([0.0, 0.79, 0.8, 0.21], sharex=heat))
        right = _extra(ax, ax.inset_axes([0.83, 0.0, 0.17, 0.76], sharey=heat))
    else:
        heat = ax
    heat.grid(False)
    heat.pcolormesh(
        param_edges,
        grad_edges,
        np.ma.masked_equal(np.log10(counts + 1.0), 0.0),
        cmap=HISTOGRAM_CMAP,
        shading="flat",
        rasterized=True,
    )
    heat.axhline(0, color=COLORS["gray"], lw=0.5, linestyle=":")
    heat.axvline(0, color=COLORS["gray"], lw=0.5, linestyle=":")
    heat.set_xlabel("parameter value")
    heat.set_ylabel("gradient element")
    style_value_axis(heat, "x", nbins=4)
    style_value_axis(heat, "y", nbins=4)
    if marginals:
        for axes, centers, widths, totals, vertical in (
            (top, param_edges, np.diff(param_edges), counts.sum(0), True),
            (right, grad_edges, np.diff(grad_edges), counts.sum(1), False),
        ):
            floor = 0.8
            heights = np.maximum(totals, floor)
            if vertical:
                axes.bar(centers[:-1], heights - floor, widths, bottom=floor,
                         align="edge", color=COLORS["gray"], lw=0)  # fmt: skip
                axes.set_yscale("log")
                axes.tick_params(labelbottom=False, labelleft=False)
            else:
                axes.barh(centers[:-1], heights - floor, widths, left=floor,
                          align="edge", color=COLORS["gray"], lw=0)  # fmt: skip
                axes.set_xscale("log")
                axes.tick_params(labelleft=False, labelbottom=False)
            axes.grid(False)
            axes.minorticks_off()
            axes.tick_params(length=0)
    heat.text(
        0.98, 0.97, f"step {found[0]}", ha="right", va="top", fontsize=6.5,
        transform=heat.transAxes, color=COLORS["dark"],
    )  # fmt: skip
    return _done(ax)


def layer_count(data: Any, key: str = "GradHist2d", upto: int | None = None) -> int:
    """Number of per-parameter 2-D histograms in the latest ``key`` entry.

    Args:
        data: The run (see module docstring).
        key: History key of the 2-D histograms.
        upto: Ignore steps after this one.

    Returns:
        The count (0 unless tracked with ``keep_individual=True``).
    """
    found = as_data(data).latest(key, upto)
    if found is None:
        return 0
    value = found[1]
    if "param_groups" in value:
        return int(value["param_groups"])
    return sum(1 for k in value if k.startswith("param_") and k[6:].isdigit())


# --- CURVATURE ---
def plot_max_ev(
    ax: Axes,
    data: Any,
    *,
    key: str = "HessMaxEV",
    show_log_iter: bool = False,
    upto: int | None = None,
) -> Axes:
    """Max Eigenvalue: the largest Hessian eigenvalue vs iteration (log if positive).

    Args:
        ax: Axes to draw on.
        data: The run (see module docstring).
        key: History key of the eigenvalues.
        show_log_iter: Symmetric-log iteration axis.
        upto: Ignore steps after this one.

    Returns:
        ``ax``.
    """
    data = as_data(data)
    _reset(ax)
    return _series_gauge(
        ax, data, "Max Eigenvalue", key, "scalar", "λ_max", show_log_iter, upto
    )


def plot_trace(
    ax: Axes,
    data: Any,
    *,
    key: str = "HessTrace",
    show_log_iter: bool = False,
    upto: int | None = None,
) -> Axes:
    """Trace: trace of the (diagonal) curvature, summed over parameters.

    Args:
        ax: Axes to draw on.
        data: The run (see module docstring).
        key: History key of the per-parameter traces.
        show_log_iter: Symmetric-log iteration axis.
        upto: Ignore steps after this one.

    Returns:
        ``ax``.
    """
    data = as_data(data)
    _reset(ax)
    return _series_gauge(ax, data, "Trace", key, "sum", "trace", show_log_iter, upto)


def plot_tic(
    ax: Axes,
    data: Any,
    *,
    diag_key: str = "TICDiag",
    trace_key: str = "TICTrace",
    show_log_iter: bool = False,
    upto: int | None = None,
) -> Axes:
    """TIC: Takeuchi information criterion estimates vs iteration.

    Args:
        ax: Axes to draw on.
        data: The run (see module docstring).
        diag_key: History key of the diagonal-curvature estimate.
        trace_key: History key of the trace-curvature estimate.
        show_log_iter: Symmetric-log iteration axis.
        upto: Ignore steps after this one.

    Returns:
        ``ax``.
    """
    data = as_data(data)
    _reset(ax)
    title = "TIC"
    diag = data.series(diag_key).view(upto)
    trace = data.series(trace_key).view(upto)
    if len(diag[0]) == 0 and len(trace[0]) == 0:
        return _empty(ax, title, f"track {diag_key} or {trace_key}")
    ax.set_title(title)
    if len(diag[0]):
        _scatter_with_ema(ax, *diag, "diag", COLORS["green"], "#1d5a27")
    if len(trace[0]):
        _scatter_with_ema(ax, *trace, "trace", COLORS["purple"], "#45306b")
    values = np.concatenate([diag[1], trace[1]])
    _value_axis(ax, values)
    ax.set_ylabel("TIC")
    style_iteration_axis(ax, show_log_iter)
    ax.legend(loc="best")
    return _done(ax)


# --- bottom row ---
def plot_hyperparameters(
    ax: Axes,
    data: Any,
    *,
    key: str = "learning_rate",
    show_log_iter: bool = False,
    upto: int | None = None,
) -> Axes:
    """Hyperparameters: the learning rate handed to ``Cockpit.log`` vs iteration.

    Args:
        ax: Axes to draw on.
        data: The run (see module docstring).
        key: History key of the learning rate.
        show_log_iter: Symmetric-log iteration axis.
        upto: Ignore steps after this one.

    Returns:
        ``ax``.
    """
    data = as_data(data)
    _reset(ax)
    title = "Hyperparameters"
    steps, values, _ = data.series(key).view(upto)
    if len(steps) == 0:
        return _empty(ax, title, "call cockpit.log(..., learning_rate)")
    ax.plot(
        steps,
        values,
        color=COLORS["blue"],
        drawstyle="steps-post",
        label=f"learning rate, last {format_number(values[-1])}",
    )
    ax.set_title(title)
    ax.set_ylabel("learning rate")
    _value_axis(ax, values)
    style_iteration_axis(ax, show_log_iter)
    ax.legend(loc="best")
    return _done(ax)


def plot_performance(
    ax: Axes,
    data: Any,
    *,
    loss_key: str = "Loss",
    log_losses: Sequence[str] = ("train_loss", "valid_loss"),
    accuracies: Sequence[str] = ("train_accuracy", "valid_accuracy"),
    show_log_iter: bool = False,
    upto: int | None = None,
) -> Axes:
    """Performance Plot: mini-batch loss (left axis) and accuracies (right axis).

    The mini-batch loss comes from the ``Loss`` quantity; losses and accuracies
    handed to ``Cockpit.log`` are drawn as lines (accuracies on a 0-100 % axis).

    Args:
        ax: Axes to draw on.
        data: The run (see module docstring).
        loss_key: History key of the mini-batch loss.
        log_losses: Keys of logged losses drawn as lines.
        accuracies: Keys of logged accuracies.
        show_log_iter: Symmetric-log iteration axis.
        upto: Ignore steps after this one.

    Returns:
        ``ax``.
    """
    data = as_data(data)
    _reset(ax)
    title = "Performance Plot"
    loss = data.series(loss_key).view(upto)
    logged = [(k, data.series(k).view(upto)) for k in log_losses]
    logged = [(k, v) for k, v in logged if len(v[0])]
    accs = [(k, data.series(k).view(upto)) for k in accuracies]
    accs = [(k, v) for k, v in accs if len(v[0])]
    if len(loss[0]) == 0 and not logged and not accs:
        return _empty(ax, title, f"track {loss_key} or call cockpit.log(...)")
    ax.set_title(title)
    style_iteration_axis(ax, show_log_iter)
    loss_values = [loss[1]] + [v[1] for _, v in logged]
    if len(loss[0]):
        _scatter_with_ema(ax, *loss, "mini-batch loss")
    line_colors = [COLORS["blue"], COLORS["red"], COLORS["purple"]]
    for (name, (steps, values, _)), color in zip(logged, line_colors):
        label = f"{name.replace('_', ' ')}, last {format_number(values[-1])}"
        ax.plot(steps, values, color=color, lw=1.2, label=label)
    ax.set_ylabel("loss")
    _value_axis(ax, np.concatenate(loss_values))
    handles, labels = ax.get_legend_handles_labels()
    if accs:
        twin = _twinx(ax)
        acc_colors = [COLORS["green"], COLORS["orange"], COLORS["gray"]]
        for (name, (steps, values, _)), color in zip(accs, acc_colors):
            label = f"{name.replace('_', ' ')}, last {100 * values[-1]:.1f}%"
            twin.plot(steps, values, color=color, lw=1.2, linestyle="--", label=label)
        twin.set_ylim(0, 1.02)
        twin.yaxis.set_major_formatter(lambda y, _pos: f"{100 * y:.0f}%")
        twin.set_ylabel("accuracy")
        more_handles, more_labels = twin.get_legend_handles_labels()
        handles, labels = handles + more_handles, labels + more_labels
    ax.legend(handles, labels, loc="center left", bbox_to_anchor=(1.07, 0.5))
    return _done(ax)


# --- secondary screen ---
def plot_mean_gsnr(
    ax: Axes,
    data: Any,
    *,
    key: str = "MeanGSNR",
    show_log_iter: bool = False,
    upto: int | None = None,
) -> Axes:
    """Mean GSNR: mean gradient signal-to-noise ratio over all parameters.

    Args:
        ax: Axes to draw on.
        data: The run (see module docstring).
        key: History key.
        show_log_iter: Symmetric-log iteration axis.
        upto: Ignore steps after this one.

    Returns:
        ``ax``.
    """
    data = as_data(data)
    _reset(ax)
    return _series_gauge(
        ax, data, "Mean GSNR", key, "scalar", "GSNR", show_log_iter, upto
    )


def plot_cabs(
    ax: Axes,
    data: Any,
    *,
    key: str = "CABS",
    show_log_iter: bool = False,
    upto: int | None = None,
) -> Axes:
    """CABS: the batch size suggested by the coupled adaptive batch size rule.

    Args:
        ax: Axes to draw on.
        data: The run (see module docstring).
        key: History key.
        show_log_iter: Symmetric-log iteration axis.
        upto: Ignore steps after this one.

    Returns:
        ``ax``.
    """
    data = as_data(data)
    _reset(ax)
    return _series_gauge(
        ax, data, "CABS", key, "scalar", "suggested batch size", show_log_iter, upto
    )


def plot_early_stopping(
    ax: Axes,
    data: Any,
    *,
    key: str = "EarlyStopping",
    show_log_iter: bool = False,
    upto: int | None = None,
) -> Axes:
    """Early stopping: the evidence-based criterion (positive values: stop).

    Args:
        ax: Axes to draw on.
        data: The run (see module docstring).
        key: History key.
        show_log_iter: Symmetric-log iteration axis.
        upto: Ignore steps after this one.

    Returns:
        ``ax``.
    """
    data = as_data(data)
    _reset(ax)
    _series_gauge(
        ax, data, "Early stopping", key, "scalar", "criterion", show_log_iter, upto
    )
    if ax.get_gid() == GAUGE_GID:
        ax.axhline(0.0, color=COLORS["red"], lw=0.8, linestyle="--")
    return ax


#: The gauges of the primary screen, by panel, top to bottom.
PRIMARY_GAUGES = {
    "STEP SIZE": (plot_alpha, plot_distance, plot_grad_norm),
    "GRADIENTS": (plot_gradient_tests, plot_hist_1d, plot_hist_2d),
    "CURVATURE": (plot_max_ev, plot_trace, plot_tic),
}

#: The gauges of the secondary screen's top band.
AUXILIARY_GAUGES = (plot_mean_gsnr, plot_cabs, plot_early_stopping)
