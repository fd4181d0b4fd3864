"""The gauges: each declared once as data, drawn by one routine per kind of gauge.

:data:`GAUGES` holds one :class:`Gauge` per instrument: its title, the history keys
it reads, its axis labels, the hint it shows without data and the kind of drawing.
:func:`draw_gauge` does what every gauge shares (clear the axes, resolve the keys,
say what to track when there is nothing to draw, set the title) and hands the
picture to the routine of the gauge's kind (``"series"``, ``"alpha"``, ``"tests"``,
``"hist_1d"``, ``"hist_2d"``, ``"performance"``, ``"learning_rates"``,
``"findings"``). Gauges drawn against the iteration shade the steps with a
``nonfinite`` record red (:func:`nonfinite_spans`), so a diverged run's curves do
not just stop; a gauge with a ``caption`` says under its title how to read it.

Every gauge is also a public function ``plot_<name>(ax, data, *, show_log_iter,
upto, <keys>, <options>) -> Axes``:

* ``ax``: a matplotlib ``Axes``; the gauge clears it (and the twin or inset axes it
  added on an earlier call), so calling it again redraws.
* ``data``: a :class:`~cockpit.plotting.data.DashboardData` (what the plotter passes,
  read incrementally), or anything :func:`~cockpit.plotting.data.as_history`
  accepts: a ``History``, a ``Cockpit``, a ``{step: {key: value}}`` dict, a log path.
* ``show_log_iter``: symmetric-log iteration axis; ``upto``: ignore later steps.
* keyword arguments named after the keys (``key``, ``distance_key``, ...) rename the
  history keys read (defaults: the class names, as cockpit writes them).

A gauge without data keeps its title and says what to track instead of disappearing
(its ``Axes`` gets the gid :data:`NO_DATA_GID`, one with data :data:`GAUGE_GID`).
A series gauge whose values were estimated (``HessTrace`` by Hutchinson's method
where BackPACK has no exact curvature) says ``(estimated)`` in its title and legend
and draws a band of :data:`ESTIMATE_SPAN` standard errors around them (gid
:data:`ESTIMATE_BAND_GID`); runs without estimates look as before.
Gauges never touch global matplotlib state; wrap calls in
:func:`~cockpit.plotting.style.dashboard_style` for the dashboard's look.
"""

from __future__ import annotations

import inspect
import math
import warnings
import weakref
from bisect import bisect_left, bisect_right
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Union

import matplotlib
import numpy as np
from matplotlib.axes import Axes
from matplotlib.colors import Normalize
from matplotlib.patches import Circle, Patch
from matplotlib.text import Text as MplText
from matplotlib.ticker import LogLocator, MaxNLocator, NullFormatter, NullLocator
from matplotlib.transforms import ScaledTranslation

from cockpit import diagnosis
from cockpit.errors import CockpitWarning
from cockpit.log_keys import NONFINITE_KEY
from cockpit.plotting.data import DashboardData, Series, as_data
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

#: ``get_gid()`` of the band around estimated values.
ESTIMATE_BAND_GID = "cockpit-estimate-band"

#: The band around estimated values spans this many standard errors either side
#: (about a 95 % interval for the mean of 16 probes).
ESTIMATE_SPAN = 2

#: A title or hint: a ``str.format`` template over the gauge's keys and options, or a
#: function of them.
Text = Union[str, Callable[[Mapping[str, Any]], str]]


@dataclass(frozen=True)
class Line:
    """One series of a ``"series"`` gauge, drawn against the iteration.

    Attributes:
        role: The gauge's key argument this series reads (e.g. ``"distance_key"``).
        label: Legend label.
        reduce: How a step's value becomes one number (see
            :data:`~cockpit.plotting.data.REDUCERS`).
        color: Colour of the points; ``None`` colours them by iteration.
        ema_color: Colour of the moving average (default: dark gray).
        twin: Draw on a second y-axis on the right.
        log: Log y-axis (``None``: when positive data spans over two decades).
        steps: Draw a step line of the values instead of points and moving average.
    """

    role: str
    label: str
    reduce: str = "scalar"
    color: str | None = None
    ema_color: str | None = None
    twin: bool = False
    log: bool | None = None
    steps: bool = False


@dataclass(frozen=True)
class Gauge:
    """An instrument as data; :func:`draw_gauge` draws it.

    Attributes:
        name: Short name; the public function is ``plot_<name>``.
        title: Title (a :data:`Text`).
        kind: The drawing routine (a key of :data:`DRAWERS`).
        doc: What the gauge shows and how to read it.
        keys: ``(argument, default history key, description)`` of each key read.
        lines: The series of a ``"series"`` gauge.
        ylabel: Label of the (left) value axis.
        twin_ylabel: Label of the right value axis, if a line has ``twin=True``.
        hint: Shown without data (a :data:`Text`; default: ``"track <keys>"``).
        options: Further keyword arguments of the kind's routine with defaults.
        option_docs: Description of each option.
        reference: Draw a dashed horizontal line at this value.
        legend_loc: Legend position.
        caption: One line under the title that says how to read the picture (for
            gauges whose geometry is not obvious).
    """

    name: str
    title: Text
    kind: str
    doc: str
    keys: tuple[tuple[str, str, str], ...]
    lines: tuple[Line, ...] = ()
    ylabel: str = ""
    twin_ylabel: str = ""
    hint: Text = ""
    options: Mapping[str, Any] = field(default_factory=dict)
    option_docs: Mapping[str, str] = field(default_factory=dict)
    reference: float | None = None
    legend_loc: str = "best"
    caption: str = ""


# --- axes a gauge adds (twins, insets), removed when it redraws --------------------
_EXTRA_AXES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def extra_axes(ax: Axes) -> list[Axes]:
    """Return the twin and inset axes the last gauge drawn on ``ax`` added to it."""
    return list(_EXTRA_AXES.get(ax, []))


def clear_gauge(ax: Axes) -> Axes:
    """Undo an earlier gauge call on ``ax``: remove its twins and insets, clear it.

    Args:
        ax: The axes.

    Returns:
        ``ax``, empty, with its axis on and no gid.
    """
    for extra in _EXTRA_AXES.pop(ax, []):
        try:
            extra.remove()
        except (KeyError, ValueError, AttributeError):  # already gone with a clear
            pass
    ax.clear()
    ax.set_axis_on()
    ax.set_gid(None)
    return ax


def _extra(ax: Axes, new: Axes) -> Axes:
    _EXTRA_AXES.setdefault(ax, []).append(new)
    return new


def _twinx(ax: Axes) -> Axes:
    twin = _extra(ax, ax.twinx())
    twin.grid(False)
    return twin


# --- shared pieces -----------------------------------------------------------------
def _value_axis(ax: Axes, values: np.ndarray, log: bool | None = None) -> None:
    """Log scale if asked, or (``log=None``) for positive data over two decades."""
    if log is None:
        finite = values[np.isfinite(values)]
        log = bool(
            finite.size >= 2
            and np.all(finite > 0)
            and finite.max() / finite.min() > 100.0
        )
    if log:
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(numticks=5))
        ax.yaxis.set_minor_formatter(NullFormatter())
    else:
        style_value_axis(ax)


def _scatter_with_ema(
    ax: Axes, view: tuple, label: str, color: str | None, ema_color: str | None
) -> None:
    """Points (coloured by iteration unless ``color`` is given) plus their EMA."""
    steps, values, ema = view
    kwargs: dict[str, Any] = {"s": 7, "linewidths": 0, "alpha": 0.6, "zorder": 2}
    if color is None:
        norm = Normalize(vmin=float(steps[0]), vmax=float(max(steps[-1], 1)))
        kwargs.update(c=steps, cmap=ITERATION_CMAP, norm=norm)
    else:
        kwargs.update(color=color)
    ax.scatter(steps, values, **kwargs)
    last, smooth = format_number(float(values[-1])), format_number(float(ema[-1]))
    ax.plot(steps, ema, color=ema_color or COLORS["dark"], linewidth=1.3, zorder=3,
            label=f"{label}: last {last}, EMA {smooth}")  # fmt: skip


def _log_counts(ax: Axes, axis: str = "y") -> None:
    """Log scale with few major ticks and no minor labels (histogram counts)."""
    getattr(ax, f"set_{axis}scale")("log")
    target = ax.yaxis if axis == "y" else ax.xaxis
    target.set_major_locator(LogLocator(numticks=5))
    target.set_minor_formatter(NullFormatter())


def _corner_text(ax: Axes, text: str, size: float, x: float, y: float) -> None:
    ax.text(x, y, text, ha="right", va="top", fontsize=size,
            transform=ax.transAxes, color=COLORS["dark"])  # fmt: skip


def nonfinite_spans(data: Any, upto: int | None = None) -> list[tuple[int, int]]:
    """Runs of consecutive tracked steps whose loss or gradients were not finite.

    Args:
        data: The run (see the module docstring).
        upto: Ignore steps after this one.

    Returns:
        ``(first, last)`` step of each run, in order (steps with a
        :data:`NONFINITE_KEY` record; runs are broken by any tracked step without).
    """
    data = as_data(data)
    marked = data.series(NONFINITE_KEY).steps  # values are words, only steps count
    if upto is not None:
        marked = marked[marked <= upto]
    if not len(marked):
        return []
    index = np.searchsorted(np.asarray(data.history.steps), marked)
    breaks = np.flatnonzero(np.diff(index) != 1) + 1
    return [(int(run[0]), int(run[-1])) for run in np.split(marked, breaks)]


def _nonfinite_what(data: DashboardData, spans: list[tuple[int, int]]) -> str:
    """What was not finite (``"loss, gradients"``), read at the ends of the runs."""
    found: list[str] = []
    for step in {s for span in spans for s in span}:
        entry = data.history.view(step).get(NONFINITE_KEY) or []
        found += [str(w) for w in entry if str(w) not in found]
    return ", ".join(found) or "values"


def _mark_nonfinite(ax: Axes, data: DashboardData, options) -> list:
    """Shade the non-finite steps red on an iteration axis; return a legend handle.

    A lone step gets a red line, a run of steps a red band with a line where it
    begins, so the curves of a diverged run visibly end in red, not silently.
    """
    spans = nonfinite_spans(data, options["upto"])
    if not spans:
        return []
    red = COLORS["red"]
    for first, last in spans:
        if last > first:
            ax.axvspan(first, last, color=red, alpha=0.13, lw=0, zorder=0.5)
        ax.axvline(first, color=red, lw=1.0, alpha=0.8, zorder=0.6)
    count = sum(1 for step in data.series(NONFINITE_KEY).steps
                if options["upto"] is None or step <= options["upto"])  # fmt: skip
    where = f"step {spans[0][0]}" if count == 1 else f"{count} steps from {spans[0][0]}"
    label = f"non-finite {_nonfinite_what(data, spans)}: {where}"
    return [Patch(facecolor=red, alpha=0.35, edgecolor=red, label=label)]


# --- one routine per kind of gauge -------------------------------------------------
# Each takes (ax, data, gauge, keys, options) and returns whether it drew anything;
# ``options`` holds the gauge's options plus ``upto`` and ``show_log_iter``.
def _estimate_band(ax: Axes, view: tuple, color: str | None, bound: bool) -> None:
    """Shade ``value ± ESTIMATE_SPAN * stderr`` where the values were estimated."""
    steps, values, _, errors = view
    span = ESTIMATE_SPAN * errors
    band = ax.fill_between(steps, values - span, values + span,
                           color=color or COLORS["blue"], alpha=0.2, lw=0,
                           zorder=1.5)  # fmt: skip
    band.set_gid(ESTIMATE_BAND_GID)
    band.set_label(
        f"±{ESTIMATE_SPAN} SE of the estimate" + (" (upper bound)" if bound else "")
    )


def _draw_series(ax, data: DashboardData, gauge: Gauge, keys, options) -> bool:
    """Series vs iteration, left axis and optionally a twin right axis.

    Estimated values get a band of their standard errors, ``(estimated)`` in
    their label, and ``options["estimated"]`` is set (the title says so).
    """
    recorded = [(line, data.series(keys[line.role], line.reduce))
                for line in gauge.lines]  # fmt: skip
    recorded = [(line, series) for line, series in recorded if len(series)]
    full = {
        line.role: (series.view_errors(options["upto"]), series.error_bound)
        for line, series in recorded
    }
    views = [(line, full[line.role][0][:3]) for line, _ in recorded]
    views = [(line, view) for line, view in views if len(view[0])]
    if not views:
        return bool(recorded) and _only_nonfinite(ax, data, options)
    style_iteration_axis(ax, options["show_log_iter"])
    has_twin = any(line.twin for line in gauge.lines)
    handles: list = []
    top = ax
    for twin, ylabel in ((False, gauge.ylabel), (True, gauge.twin_ylabel)):
        side = [(line, view) for line, view in views if line.twin == twin]
        if not side:
            if not twin and has_twin:
                ax.set_yticks([])
            continue
        target = top = _twinx(ax) if twin else ax
        for line, view in side:
            with_errors, bound = full[line.role]
            estimated = bool(np.isfinite(with_errors[3]).any())
            label = f"{line.label} (estimated)" if estimated else line.label
            if line.steps:
                last = format_number(view[1][-1])
                target.plot(view[0], view[1], color=line.color, drawstyle="steps-post",
                            label=f"{label}, last {last}")  # fmt: skip
            else:
                _scatter_with_ema(target, view, label, line.color, line.ema_color)
            if estimated:
                _estimate_band(target, with_errors, line.color, bound)
                options["estimated"] = True
        _value_axis(target, np.concatenate([v[1] for _, v in side]), side[0][0].log)
        target.set_ylabel(ylabel, **({"color": side[0][0].color} if has_twin else {}))
        handles += target.get_legend_handles_labels()[0]
    if gauge.reference is not None:
        ax.axhline(gauge.reference, color=COLORS["red"], lw=0.8, linestyle="--")
    handles += _mark_nonfinite(ax, data, options)
    top.legend(handles=handles, loc=gauge.legend_loc)  # above a twin's points
    return True


def _only_nonfinite(ax: Axes, data: DashboardData, options) -> bool:
    """A gauge whose values were all NaN/inf: the red marks and a note, if any."""
    marks = _mark_nonfinite(ax, data, options)
    if not marks:
        return False
    style_iteration_axis(ax, options["show_log_iter"])
    ax.set_yticks([])
    ax.text(0.5, 0.5, "no finite value", ha="center", va="center",
            color=COLORS["red"], transform=ax.transAxes)  # fmt: skip
    ax.legend(handles=marks, loc="upper left")
    return True


def _draw_alpha(ax, data: DashboardData, gauge: Gauge, keys, options) -> bool:
    """The unit parabola with histograms of all and of the recent alpha values."""
    _, values, _ = data.series(keys["key"]).view(options["upto"], max_points=None)
    if len(values) < 2:
        return False
    lo, hi = -1.5, 1.5
    x = np.linspace(lo, hi, 121)
    ax.plot(x, x**2, color=COLORS["orange"], linewidth=1.5, zorder=3)
    for position in (-1.0, 0.0, 1.0):
        ax.axvline(position, color=COLORS["gray"], linestyle=":", linewidth=0.8)
    ax.set(xlim=(lo, hi), ylim=(0, 1.75), yticks=[], xlabel="normalized step length α",
           xticks=[-1.5, -1, -0.5, 0, 0.5, 1, 1.5])  # fmt: skip
    edges = np.linspace(lo, hi, options["bins"] + 1)
    clipped = np.clip(values, lo, np.nextafter(hi, lo))
    recent = options["recent"]
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
        twin.stairs(density, edges, fill=True, color=color, alpha=0.45,
                    label=f"{name}: mean {mean:+.2f}")  # fmt: skip
    twin.set_ylim(0, 1.25 * peak if peak > 0 else 1)
    twin.set_yticks([])
    twin.legend(loc="upper center", ncols=2)
    below, above = int(np.sum(values < lo)), int(np.sum(values > hi))
    for count, text, x, align in ((below, f"◀ {below}", 0.01, "left"),
                                  (above, f"{above} ▶", 0.99, "right")):  # fmt: skip
        if count:
            ax.annotate(text, (x, 0.04), xycoords="axes fraction", ha=align, fontsize=7)
    return True


def _draw_tests(ax, data: DashboardData, gauge: Gauge, keys, options) -> bool:
    """Latest tests as shapes around the origin (left), their history (right)."""
    tests = (("norm_key", "norm", COLORS["blue"]),
             ("inner_key", "inner", COLORS["orange"]),
             ("ortho_key", "ortho", COLORS["green"]))  # fmt: skip
    views = [(data.series(keys[role]).view(options["upto"]), name, color)
             for role, name, color in tests]  # fmt: skip
    if all(len(view[0]) == 0 for view, _, _ in views):
        return False
    ax.set_axis_off()
    shape = _extra(ax, ax.inset_axes([0.0, 0.0, 0.36, 0.95]))
    history = _extra(ax, ax.inset_axes([0.52, 0.0, 0.48, 0.95]))

    latest = {name: float(view[1][-1]) for view, name, _ in views if len(view[0])}
    limit = max(1.5, 1.15 * max(latest.values()))
    shape.set(xlim=(-limit, limit), ylim=(-limit, limit))
    shape.set_aspect("equal", adjustable="box")
    shape.add_patch(
        Circle((0, 0), 1.0, fill=False, linestyle="--", color=COLORS["gray"], lw=0.8)
    )
    if "inner" in latest:
        shape.axhspan(-latest["inner"], latest["inner"], color=COLORS["orange"],
                      alpha=0.3)  # fmt: skip
    if "ortho" in latest:
        shape.axvspan(-latest["ortho"], latest["ortho"], color=COLORS["green"],
                      alpha=0.3)  # fmt: skip
    if "norm" in latest:
        shape.add_patch(Circle((0, 0), latest["norm"], color=COLORS["blue"],
                               alpha=0.3, lw=0))  # fmt: skip
    shape.axhline(0, color=COLORS["dark"], lw=0.6)
    shape.axvline(0, color=COLORS["dark"], lw=0.6)
    shape.xaxis.set_major_formatter(format_number)
    shape.yaxis.set_major_formatter(format_number)
    shape.locator_params(nbins=3)
    shape.set_xlabel("latest, unit circle = 1", fontsize=7)

    for (steps, values, _), name, color in views:
        if len(steps):
            label = f"{name} {format_number(values[-1])}"
            history.plot(steps, values, color=color, marker=".", markersize=2.5,
                         lw=0.9, label=label)  # fmt: skip
    history.axhline(1.0, color=COLORS["gray"], linestyle="--", lw=0.8)
    _value_axis(history, np.concatenate([view[1] for view, _, _ in views]))
    style_iteration_axis(history, options["show_log_iter"])
    _mark_nonfinite(history, data, options)  # no legend entry: the inset is small
    history.legend(loc="best")
    return True


def _draw_hist_1d(ax, data: DashboardData, gauge: Gauge, keys, options) -> bool:
    """The latest 1-D histogram as filled steps on a log count axis."""
    found = data.latest(keys["key"], options["upto"])
    if found is None:
        return False
    step, value = found
    counts = np.asarray(value["hist"], dtype=float)
    edges = np.asarray(value["edges"], dtype=float)
    positive = counts[counts > 0]
    floor = 0.8 * (positive.min() if positive.size else 1.0)
    ax.stairs(np.maximum(counts, floor), edges, baseline=floor, fill=True,
              color=COLORS["orange"], alpha=0.85)  # fmt: skip
    _log_counts(ax)
    ax.set_ylim(bottom=floor)
    ax.set_xlim(edges[0], edges[-1])
    style_value_axis(ax, "x")
    ax.set(xlabel="gradient element value", ylabel="count")
    _corner_text(ax, f"step {step}", 7, 0.99, 0.96)
    if not positive.size:  # NaN gradients fall into no bin
        _empty_note(ax, step)
    return True


def _empty_note(ax: Axes, step: int) -> None:
    """Say (in red) that a histogram counted nothing, e.g. for NaN gradients."""
    ax.text(0.5, 0.5, f"no finite value counted at step {step}", ha="center",
            va="center", color=COLORS["red"], fontsize=7,
            transform=ax.transAxes)  # fmt: skip


def _draw_hist_2d(ax, data: DashboardData, gauge: Gauge, keys, options) -> bool:
    """The latest 2-D histogram as a heat map, with marginal histograms."""
    found = data.latest(keys["key"], options["upto"])
    param = options["param"]
    entry = found[1] if found is not None and param is None else None
    if found is not None and param is not None:
        entry = found[1].get(f"param_{param}")
    if entry is None:
        return False
    counts = np.asarray(entry["hist"], dtype=float)
    grad_edges = np.asarray(entry["edges"][0], dtype=float)
    param_edges = np.asarray(entry["edges"][1], dtype=float)
    transform = options["transformation"] or (lambda c: np.log10(c + 1.0))
    shown = np.ma.masked_where(counts == 0, np.asarray(transform(counts), float))
    heat = ax
    if options["marginals"]:
        ax.set_axis_off()
        heat = _extra(ax, ax.inset_axes([0.0, 0.0, 0.8, 0.76]))
        top = _extra(ax, ax.inset_axes([0.0, 0.79, 0.8, 0.21], sharex=heat))
        right = _extra(ax, ax.inset_axes([0.83, 0.0, 0.17, 0.76], sharey=heat))
        margins = ((top, param_edges, counts.sum(0), True),
                   (right, grad_edges, counts.sum(1), False))  # fmt: skip
        for axes, edges, totals, vertical in margins:
            heights = np.maximum(totals, 0.8) - 0.8
            if vertical:
                axes.bar(edges[:-1], heights, np.diff(edges), bottom=0.8,
                         align="edge", color=COLORS["gray"], lw=0)  # fmt: skip
            else:
                axes.barh(edges[:-1], heights, np.diff(edges), left=0.8,
                          align="edge", color=COLORS["gray"], lw=0)  # fmt: skip
            getattr(axes, "set_yscale" if vertical else "set_xscale")("log")
            axes.tick_params(labelbottom=False, labelleft=False, length=0)
            axes.grid(False)
            axes.minorticks_off()
    heat.grid(False)
    mesh = heat.pcolormesh(param_edges, grad_edges, shown, cmap=HISTOGRAM_CMAP,
                           shading="flat", rasterized=True)  # fmt: skip
    if np.any(counts > 0):
        _colour_bar(ax, heat, mesh, counts, options)
    else:  # NaN gradients or parameters fall into no bin
        _empty_note(heat, found[0])
    heat.axhline(0, color=COLORS["gray"], lw=0.5, linestyle=":")
    heat.axvline(0, color=COLORS["gray"], lw=0.5, linestyle=":")
    heat.set(xlabel="parameter value", ylabel="gradient element")
    style_value_axis(heat, "x", nbins=4)
    style_value_axis(heat, "y", nbins=4)
    _corner_text(heat, f"step {found[0]}", 6.5, 0.98, 0.97)
    return True


# Per-element series of list-valued keys, read incrementally like DashboardData's.
_ELEMENT_SERIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def element_series(data: Any, key: str) -> list[Series]:
    """One series per list element of ``key`` (e.g. per parameter group).

    ``learning_rates`` holds one learning rate per parameter group; series ``k``
    holds element ``k`` at every step where the list has one. Like the series of
    :class:`~cockpit.plotting.data.DashboardData`, later calls read only the steps
    added since (and the last one read before, which may have changed).

    Args:
        data: The run (see the module docstring).
        key: A history key whose values are lists of numbers.

    Returns:
        The series, element 0 first (empty if ``key`` was never recorded).
    """
    data = as_data(data)
    steps = data.series(key).steps  # the steps holding the key; values are lists
    cached = _ELEMENT_SERIES.setdefault(data, {})
    read, series = cached.get(key, (np.empty(0, dtype=np.int64), []))
    keep = len(read) - 1  # re-read the last step read before
    if keep < 0 or len(steps) <= keep or not np.array_equal(steps[:keep], read[:keep]):
        keep, series = 0, []  # nothing read yet, or another history behind ``data``
    for element in series:
        element.truncate(int(steps[keep]))
    for step in steps[keep:]:
        try:
            values = np.asarray(data.history.view(int(step))[key], float).ravel()
        except (KeyError, TypeError, ValueError):  # not a list of numbers
            continue
        while len(series) < len(values):
            series.append(Series())
        for element, value in zip(series, values):
            element.append(int(step), float(value))
    cached[key] = (steps.copy(), series)
    return series


def _rate_axis(ax: Axes, values: np.ndarray) -> None:
    """A learning-rate axis that reads well, also for a constant rate.

    Linear from 0 (a constant rate is one clear level, not an axis zoomed onto
    rounding noise); log scale when positive rates span more than two decades.
    """
    finite = values[np.isfinite(values)]
    if finite.size and np.all(finite > 0) and finite.max() / finite.min() > 100.0:
        _value_axis(ax, finite, log=True)
        return
    style_value_axis(ax)
    top = float(finite.max()) if finite.size else 1.0
    bottom = min(0.0, float(finite.min())) if finite.size else 0.0
    ax.set_ylim(bottom, 1.18 * top if top > 0 else 1.0)


def _group_label(groups: list[int], last: float, single: bool) -> str:
    if single:
        return f"learning rate, last {format_number(last)}"
    if len(groups) == 1:
        name = f"group {groups[0]}"
    elif groups == list(range(groups[0], groups[-1] + 1)):
        name = f"groups {groups[0]}-{groups[-1]}"
    else:
        name = "groups " + ", ".join(map(str, groups))
    return f"{name}, last {format_number(last)}"


def _draw_learning_rates(ax, data: DashboardData, gauge: Gauge, keys, options) -> bool:
    """One step line per parameter group; else the rate handed to Cockpit.log."""
    upto = options["upto"]
    views = [element.view(upto) for element in element_series(data, keys["rates_key"])]
    merged: list[tuple[list[int], tuple]] = []  # groups with equal rates share a line
    for group, view in enumerate(views):
        if not len(view[0]):
            continue
        same = [m for m in merged if np.array_equal(m[1][0], view[0])
                and np.array_equal(m[1][1], view[1])]  # fmt: skip
        if same:
            same[0][0].append(group)
        else:
            merged.append(([group], view))
    if not merged:
        logged = data.series(keys["key"]).view(upto)
        if not len(logged[0]):
            return False
        merged = [([0], logged)]
    style_iteration_axis(ax, options["show_log_iter"])
    palette = [COLORS[c] for c in ("blue", "orange", "green", "purple", "gray")]
    single = len(merged) == 1 and len(views) <= 1
    handles = []
    for index, (groups, (steps, values, _)) in enumerate(merged):
        (line,) = ax.plot(steps, values, drawstyle="steps-post", lw=1.4,
                          color=palette[index % len(palette)],
                          label=_group_label(groups, values[-1], single))  # fmt: skip
        handles.append(line)
    _rate_axis(ax, np.concatenate([view[1] for _, view in merged]))
    ax.set_ylabel(gauge.ylabel)
    if len(handles) > 6:
        extra = Patch(color="none", label=f"+{len(handles) - 5} more lines")
        handles = handles[:5] + [extra]
    handles += _mark_nonfinite(ax, data, options)
    ax.legend(handles=handles, loc=gauge.legend_loc)
    return True


def _colour_bar(ax: Axes, heat: Axes, mesh, counts: np.ndarray, options) -> None:
    """Colour bar of the 2-D histogram's heat map.

    In the free corner above the right marginal, or (without marginals) right of
    the map; with the default colours its ticks are counts.
    """
    if options["marginals"]:
        bar = _extra(ax, ax.inset_axes([0.855, 0.9, 0.145, 0.055]))
        orientation = "horizontal"
    else:
        bar = _extra(heat, heat.inset_axes([1.03, 0.0, 0.035, 1.0]))
        orientation = "vertical"
    colorbar = heat.figure.colorbar(mesh, cax=bar, orientation=orientation)
    colorbar.outline.set_linewidth(0.5)
    long = bar.xaxis if orientation == "horizontal" else bar.yaxis
    bar.tick_params(labelsize=5.5, length=1.5, pad=1)
    if options["transformation"] is None:  # log10(count + 1): label counts
        top = max(float(np.max(counts, initial=1.0)), 1.0)
        decades = 10.0 ** np.arange(0, math.floor(math.log10(top)) + 1)
        if len(decades) == 1:  # counts below 10: 1, 2, 5
            ticks = np.array([1.0, 2.0, 5.0])[: 1 + int(top >= 2) + int(top >= 5)]
        else:
            ticks = decades[:: math.ceil(len(decades) / 3)]
        long.set_ticks(np.log10(ticks + 1.0), labels=[format_number(t) for t in ticks])
        what = "count"
    else:
        long.set_major_locator(MaxNLocator(nbins=3))
        long.set_major_formatter(format_number)
        what = "colour"
    if orientation == "horizontal":
        bar.set_title(what, fontsize=5.5, pad=1.5, fontweight="normal")
    else:
        bar.set_ylabel(what, fontsize=6, labelpad=1)
    long.set_minor_locator(NullLocator())


def _draw_performance(ax, data: DashboardData, gauge: Gauge, keys, options) -> bool:
    """Mini-batch loss (points + EMA), logged losses (lines), accuracies (twin)."""
    upto = options["upto"]
    loss = data.series(keys["loss_key"]).view(upto)
    logged = [(k, data.series(k).view(upto)) for k in options["log_losses"]]
    logged = [(k, view) for k, view in logged if len(view[0])]
    accs = [(k, data.series(k).view(upto)) for k in options["accuracies"]]
    accs = [(k, view) for k, view in accs if len(view[0])]
    if len(loss[0]) == 0 and not logged and not accs:
        recorded = len(data.series(keys["loss_key"])) > 0
        return recorded and _only_nonfinite(ax, data, options)
    style_iteration_axis(ax, options["show_log_iter"])
    if len(loss[0]):
        _scatter_with_ema(ax, loss, "mini-batch loss", None, None)
    for (name, (steps, values, _)), color in zip(
        logged, (COLORS["blue"], COLORS["red"], COLORS["purple"])
    ):
        label = f"{name.replace('_', ' ')}, last {format_number(values[-1])}"
        ax.plot(steps, values, color=color, lw=1.2, label=label)
    ax.set_ylabel("loss")
    _value_axis(ax, np.concatenate([loss[1]] + [view[1] for _, view in logged]))
    handles, labels = ax.get_legend_handles_labels()
    for mark in _mark_nonfinite(ax, data, options):
        handles, labels = handles + [mark], labels + [mark.get_label()]
    top = ax
    if accs:
        twin = top = _twinx(ax)
        for (name, (steps, values, _)), color in zip(
            accs, (COLORS["green"], COLORS["orange"], COLORS["gray"])
        ):
            label = f"{name.replace('_', ' ')}, last {100 * values[-1]:.1f}%"
            twin.plot(steps, values, color=color, lw=1.2, linestyle="--", label=label)
        twin.set_ylim(0, 1.02)
        twin.yaxis.set_major_formatter(lambda y, _pos: f"{100 * y:.0f}%")
        twin.set_ylabel("accuracy")
        more_handles, more_labels = twin.get_legend_handles_labels()
        handles, labels = handles + more_handles, labels + more_labels
    # inside, right of the middle: where falling losses and rising accuracies leave
    # room; on the top axes so no curve is drawn over it
    top.legend(handles, labels, loc="center right")
    return True


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
        data: The run (see the module docstring).
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
    steps = data.history.steps
    start = 0 if cache["read"] is None else bisect_left(steps, cache["read"])
    for step in steps[start : bisect_right(steps, data.last_step)]:
        values = data.history.view(step)
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


class _FittedText(MplText):
    """A line of text fitted to its axes' width when drawn.

    The line shows the longest start of :attr:`full_text` that ends inside the
    axes. With a :attr:`follower` (the next line, drawn after this one) it breaks
    at a space and hands the rest over; the last line of a paragraph ends in "…"
    when cut. A line that would reach below the axes is not drawn.
    """

    def __init__(self, *args: Any, follower: _FittedText | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.full_text = self.get_text()
        self.follower = follower
        self.set_in_layout(False)  # the layout must not make room for long text

    def _fits(self, text: str, renderer, right: float) -> bool:
        self.set_text(text)
        return self.get_window_extent(renderer).x1 <= right

    def draw(self, renderer) -> None:
        if not self.get_visible() or self.axes is None:
            return
        box = self.axes.bbox
        margin = renderer.points_to_pixels(4.0)
        right = box.x1 - margin
        text, rest = self.full_text, ""
        if not self._fits(text, renderer, right):
            if self.follower is not None:  # break at the last space that fits
                cuts = [i for i, c in enumerate(text) if c == " "]
                fitting = [i for i in cuts if self._fits(text[:i], renderer, right)]
                cut = fitting[-1] if fitting else len(text)
                text, rest = text[:cut], text[cut:].strip()
            if rest == "" and not self._fits(text, renderer, right):
                keep, top = 0, len(text)
                while keep < top:  # the longest start that fits with "…"
                    middle = (keep + top + 1) // 2
                    if self._fits(text[:middle].rstrip() + "…", renderer, right):
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
    made: list[_FittedText] = []
    for index in range(lines):
        offset = ScaledTranslation(x / 72.0, (y - index * step) / 72.0,
                                   ax.figure.dpi_scale_trans)  # fmt: skip
        line = _FittedText(0.0, 1.0, text if index == 0 else "", va="top",
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


def _draw_findings(ax, data: DashboardData, gauge: Gauge, keys, options) -> bool:
    """The diagnosis' findings, most severe first: a badge, a headline, the message."""
    findings = diagnosis_findings(data, options["upto"], options["thresholds"])
    if findings is None:
        return False
    ax.set(xlim=(0, 1), ylim=(0, 1), xticks=[], yticks=[])
    ax.grid(False)
    found = [f for f in findings if f.id != diagnosis.NOT_CHECKED]
    skipped = [f for f in findings if f.id == diagnosis.NOT_CHECKED]
    checks = dict(skipped[0].evidence.get("checks", {})) if skipped else {}
    rows: list[tuple[str, str, str]] = []  # (badge, headline, detail)
    if not any(f.severity != "info" for f in found):
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
    budget = PANEL_LINES - (1 if checks else 0) - len(rows)
    detail_lines = min(3, budget // max(len(rows), 1))
    y = -5.0
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
        needs = "; ".join(f"{check} (needs {need})" for check, need in checks.items())
        _paragraph(ax, f"not checked: {needs}", 6, y - 2, 1, 0, fontsize=6.8,
                   color=COLORS["gray"], style="italic")  # fmt: skip
    return True


#: The drawing routine of each kind of gauge.
DRAWERS: dict[str, Callable[..., bool]] = {
    "series": _draw_series,
    "alpha": _draw_alpha,
    "tests": _draw_tests,
    "hist_1d": _draw_hist_1d,
    "hist_2d": _draw_hist_2d,
    "performance": _draw_performance,
    "learning_rates": _draw_learning_rates,
    "findings": _draw_findings,
}


# --- the gauges --------------------------------------------------------------------
def _key(role: str, key: str, what: str) -> tuple[str, str, str]:
    return role, key, f"History key of {what}."


def _series(name, title, key, label, doc, reduce="scalar", **more) -> Gauge:
    """A gauge of one series vs iteration, points coloured by iteration, plus EMA."""
    return Gauge(name, title, "series", doc, (_key("key", key, "the values"),),
                 (Line("key", label, reduce),), ylabel=label, **more)  # fmt: skip


def _hist_2d_title(context: Mapping[str, Any]) -> str:
    if context["param"] is None:
        return "Gradient/Parameter Element Histogram (all)"
    return f"Parameter {context['param']}"


def _hist_2d_hint(context: Mapping[str, Any]) -> str:
    extra = "" if context["param"] is None else " with keep_individual=True"
    return f"track {context['key']}{extra}"


_GAUGE_LIST = (
    Gauge(
        "alpha", "Alpha Distribution", "alpha",
        "where steps land on a local quadratic fit. Draws the unit parabola (the 1-D "
        "quadratic along the step: start at -1, minimum at 0, the point of equal "
        "height at +1) and on a twin axis the histogram of all alpha values (gray) "
        "and of the most recent ones (blue), their means in the legend; values "
        "beyond the x-range are counted at the edges. alpha < 0: steps too short; "
        "near 0: they land in the minimum; > 0: overshoot.",
        (_key("key", "Alpha", "the alpha values"),),
        hint="track {key} (needs 2 values)",
        caption="the loss along a step as a parabola: −1 start, 0 its minimum, "
        "+1 as high as the start",
        options={"bins": 40, "recent": 0.1},
        option_docs={"bins": "Number of histogram bins on [-1.5, 1.5].",
                     "recent": "Fraction of the most recent values shown apart."},
    ),
    Gauge(
        "distance", "Distance", "series",
        "``||θ_t − θ_0||`` (left axis) and the update size ``||θ_{t+1} − θ_t||`` "
        "(right axis), each combined over parameters as the norm of the whole "
        "parameter vector.",
        (_key("distance_key", "Distance", "the distance from the start"),
         _key("update_key", "UpdateSize", "the update size")),
        (Line("distance_key", "distance", "norm", COLORS["blue"], "#173a63", log=False),
         Line("update_key", "update", "norm", COLORS["orange"], "#8a4410", twin=True)),
        ylabel="distance from start", twin_ylabel="update size",
        hint="track {distance_key} and/or {update_key}", legend_loc="upper left",
    ),
    _series("grad_norm", "Gradient Norm", "GradNorm", "‖g‖",
            "``||g||`` of the whole mini-batch gradient (per-parameter norms "
            "combined) vs iteration.", reduce="norm"),
    Gauge(
        "gradient_tests", "Gradient Tests", "tests",
        "the norm, inner-product and orthogonality tests. Left: the latest values "
        "as shapes around the origin (circle: norm test, radius ``T_norm``; "
        "horizontal band: inner-product test ``±T_inner``; vertical band: "
        "orthogonality test ``±T_ortho``) with the dashed unit circle: a test with "
        "tolerance θ passes while its shape stays within radius θ, so shapes far "
        "outside the unit circle mean the batch is too small for the gradient's "
        "noise. Right: the three tests vs iteration.",
        (_key("norm_key", "NormTest", "the norm test"),
         _key("inner_key", "InnerTest", "the inner-product test"),
         _key("ortho_key", "OrthoTest", "the orthogonality test")),
        hint="track {norm_key}, {inner_key}, {ortho_key}",
        caption="disc: norm, horizontal band: inner, vertical band: ortho test; "
        "past the dashed unit circle: batch too small",
    ),
    Gauge(
        "hist_1d", "Gradient Element Histogram", "hist_1d",
        "counts of individual gradient elements (log scale) at the last tracked "
        "step. Values outside the range are clipped into the edge bins, so mass "
        "piling up at the edges means the range (or the data's scale) is off.",
        (_key("key", "GradHist1d", '``{"hist": [bins], "edges": [bins + 1]}``'),),
    ),
    Gauge(
        "hist_2d", _hist_2d_title, "hist_2d",
        "gradient elements vs parameter values at the last tracked step: a heat map "
        "of ``log10(count + 1)`` (parameter value on x, gradient element on y) with "
        "marginal histograms on top (parameters) and on the right (gradients).",
        (_key("key", "GradHist2d",
              '``{"hist": [xbins, ybins], "edges": [xedges, yedges]}`` (x: gradient, '
              "y: parameter, as cockpit writes them)"),),
        hint=_hist_2d_hint,
        options={"param": None, "marginals": True, "transformation": None},
        option_docs={
            "param": "Draw this parameter tensor's histogram (needs "
            "``GradHist2d(..., keep_individual=True)``) instead of all of them.",
            "marginals": "Draw the two marginal histograms.",
            "transformation": "Map applied to the bin counts for the colours "
            "(default ``log10(count + 1)``); empty bins stay blank.",
        },
    ),
    Gauge(
        "max_ev", "Max Eigenvalue", "series",
        "the Hessian eigenvalue of largest magnitude (``HessMaxEV``, as in 1.0.2: "
        "negative where the most negative eigenvalue is the larger in magnitude) "
        "and, where that one is negative, the largest eigenvalue (the sharpness, "
        "``HessMaxEV_largest``) vs iteration (log scale when positive over more "
        "than two decades).",
        (_key("key", "HessMaxEV", "the eigenvalue of largest magnitude"),
         _key("largest_key", "HessMaxEV_largest",
              "the largest eigenvalue, where it differs")),
        (Line("key", "λ of largest |λ|"),
         Line("largest_key", "largest λ", color=COLORS["orange"], ema_color="#8a4410")),
        ylabel="eigenvalue", hint="track {key}",
    ),
    _series("trace", "Trace", "HessTrace", "trace",
            "trace of the (diagonal) curvature, summed over parameters. Values "
            "estimated by Hutchinson's method (models BackPACK has no exact "
            "curvature for) are marked \"(estimated)\" and drawn with a band of ±2 "
            "standard errors of their sum.", "sum"),
    Gauge(
        "tic", "TIC", "series",
        "Takeuchi information criterion estimates vs iteration.",
        (_key("diag_key", "TICDiag", "the diagonal-curvature estimate"),
         _key("trace_key", "TICTrace", "the trace-curvature estimate")),
        (Line("diag_key", "diag", color=COLORS["green"], ema_color="#1d5a27"),
         Line("trace_key", "trace", color=COLORS["purple"], ema_color="#45306b")),
        ylabel="TIC",
    ),
    Gauge(
        "hyperparameters", "Hyperparameters", "learning_rates",
        "the learning rate vs iteration: one step line per parameter group (the "
        "cockpit records ``learning_rates`` on tracked steps when ``info`` holds "
        "the optimizer; groups with equal rates share a line), else the rate "
        "handed to ``Cockpit.log``. The axis starts at 0 (log scale when the "
        "rates span more than two decades).",
        (_key("key", "learning_rate", "the learning rate handed to Cockpit.log"),
         _key("rates_key", "learning_rates",
              "the learning rates, one per parameter group")),
        ylabel="learning rate",
        hint="pass info['optimizer'] or call cockpit.log(..., learning_rate)",
    ),
    Gauge(
        "performance", "Performance Plot", "performance",
        "mini-batch loss (left axis, from the ``Loss`` quantity) and what was handed "
        "to ``Cockpit.log``: losses as lines, accuracies on a 0-100 % right axis.",
        (_key("loss_key", "Loss", "the mini-batch loss"),),
        hint="track {loss_key} or call cockpit.log(...)",
        options={"log_losses": ("train_loss", "valid_loss"),
                 "accuracies": ("train_accuracy", "valid_accuracy")},
        option_docs={"log_losses": "Keys of logged losses drawn as lines.",
                     "accuracies": "Keys of logged accuracies."},
    ),
    Gauge(
        "findings", "Diagnosis", "findings",
        "what :func:`cockpit.diagnosis.diagnose` finds in the run (up to ``upto``): "
        "one badge per finding (ERROR, WARN, INFO), its id and step range, and the "
        "first line of its message, most severe first; \"no problems found\" when "
        "nothing is at warning or error, and the checks that lacked data. Steps "
        "read before are not read again.",
        (), hint="nothing recorded yet",
        caption="evidence and advice for each finding: cockpit report <log>",
        options={"thresholds": None},
        option_docs={"thresholds": "cockpit.diagnosis.Thresholds to diagnose with "
                     "(default: the validated ones)."},
    ),
    _series("mean_gsnr", "Mean GSNR", "MeanGSNR", "GSNR",
            "mean gradient signal-to-noise ratio over all parameters."),
    _series("cabs", "CABS", "CABS", "suggested batch size",
            "the batch size suggested by the coupled adaptive batch size rule."),
    _series("early_stopping", "Early stopping", "EarlyStopping", "criterion",
            "the evidence-based criterion; positive values (above the dashed line) "
            "say stop.", reference=0.0),
)  # fmt: skip

#: Every gauge by name.
GAUGES: dict[str, Gauge] = {gauge.name: gauge for gauge in _GAUGE_LIST}


def _text(text: Text, context: Mapping[str, Any]) -> str:
    return text(context) if callable(text) else text.format(**context)


def draw_gauge(
    name: str,
    ax: Axes,
    data: Any,
    *,
    show_log_iter: bool = False,
    upto: int | None = None,
    **arguments: Any,
) -> Axes:
    """Draw the gauge ``name`` of :data:`GAUGES` onto ``ax``.

    Args:
        name: The gauge (e.g. ``"grad_norm"``).
        ax: Axes to draw on (cleared first, see :func:`clear_gauge`).
        data: The run (see the module docstring).
        show_log_iter: Symmetric-log iteration axis.
        upto: Ignore steps after this one.
        **arguments: History keys (by the gauge's key arguments) and options.

    Returns:
        ``ax``.

    Raises:
        ValueError: For an unknown gauge.
        TypeError: For an argument the gauge does not take.
    """
    if name not in GAUGES:
        raise ValueError(f"Unknown gauge {name!r}; choose one of {sorted(GAUGES)}.")
    gauge = GAUGES[name]
    roles = [role for role, _, _ in gauge.keys]
    unknown = sorted(set(arguments) - set(roles) - set(gauge.options))
    if unknown:
        raise TypeError(
            f"plot_{name}() got unexpected arguments {unknown}; it takes "
            f"{roles + list(gauge.options)} besides show_log_iter and upto."
        )
    keys = {role: arguments.get(role, key) for role, key, _ in gauge.keys}
    options = {
        **gauge.options,
        **{k: v for k, v in arguments.items() if k in gauge.options},
        "show_log_iter": show_log_iter,
        "upto": upto,
    }
    data = as_data(data)
    clear_gauge(ax)
    context = {**keys, **options}
    title = _text(gauge.title, context)
    if not DRAWERS[gauge.kind](ax, data, gauge, keys, options):
        hint = _text(gauge.hint, context) or "track " + " or ".join(keys.values())
        no_data(ax, title, hint)
        ax.set_gid(NO_DATA_GID)
        return ax
    if options.get("estimated"):
        title += " (estimated)"
    if gauge.caption:
        _caption(ax, title, gauge.caption)
    else:
        ax.set_title(title)
    ax.set_gid(GAUGE_GID)
    return ax


def _caption(ax: Axes, title: str, caption: str) -> None:
    """The title with a small gray line under it that says how to read the gauge."""
    size = 6.5
    ax.set_title(title, pad=matplotlib.rcParams["axes.titlepad"] + 1.35 * size + 1)
    ax.annotate(caption, (0.5, 1.0), xycoords="axes fraction", xytext=(0, 2.5),
                textcoords="offset points", ha="center", va="bottom",
                fontsize=size, color=COLORS["dark"], style="italic",
                annotation_clip=False)  # fmt: skip


def _public(name: str) -> Callable[..., Axes]:
    """``plot_<name>(ax, data, *, show_log_iter, upto, <keys>, <options>)``."""
    gauge = GAUGES[name]

    def plot(ax: Axes, data: Any, **arguments: Any) -> Axes:
        return draw_gauge(name, ax, data, **arguments)

    keyword = inspect.Parameter.KEYWORD_ONLY
    positional = inspect.Parameter.POSITIONAL_OR_KEYWORD
    defaults = [("show_log_iter", False), ("upto", None)]
    defaults += [(role, key) for role, key, _ in gauge.keys] + list(
        gauge.options.items()
    )
    plot.__signature__ = inspect.Signature(
        [inspect.Parameter("ax", positional), inspect.Parameter("data", positional)]
        + [inspect.Parameter(n, keyword, default=d) for n, d in defaults],
        return_annotation="Axes",
    )
    args = [
        "ax: Axes to draw on (cleared first, with the twins and insets an earlier "
        "gauge added to it).",
        "data: The run: DashboardData, History, Cockpit, {step: {key: value}} dict "
        "or log path.",
        "show_log_iter: Symmetric-log iteration axis (if the gauge has one).",
        "upto: Ignore steps after this one.",
    ]
    args += [f"{role}: {what}" for role, _, what in gauge.keys]
    args += [f"{option}: {gauge.option_docs[option]}" for option in gauge.options]
    title = _text(gauge.title, {**dict.fromkeys(gauge.options), "key": ""})
    plot.__name__ = plot.__qualname__ = f"plot_{name}"
    plot.__doc__ = (
        f"{title}: {gauge.doc}\n\nArgs:\n"
        + "".join(f"    {line}\n" for line in args)
        + "\nReturns:\n    ``ax``.\n"
    )
    return plot


plot_alpha = _public("alpha")
plot_distance = _public("distance")
plot_grad_norm = _public("grad_norm")
plot_gradient_tests = _public("gradient_tests")
plot_hist_1d = _public("hist_1d")
plot_hist_2d = _public("hist_2d")
plot_max_ev = _public("max_ev")
plot_trace = _public("trace")
plot_tic = _public("tic")
plot_hyperparameters = _public("hyperparameters")
plot_performance = _public("performance")
plot_findings = _public("findings")
plot_mean_gsnr = _public("mean_gsnr")
plot_cabs = _public("cabs")
plot_early_stopping = _public("early_stopping")


def warn_if_empty(ax: Axes, stacklevel: int = 2) -> bool:
    """Warn (``UserWarning``) with the hint of a gauge that had no data.

    Args:
        ax: Axes a gauge drew on.
        stacklevel: Passed to :func:`warnings.warn`.

    Returns:
        Whether the gauge had no data.
    """
    if ax.get_gid() != NO_DATA_GID:
        return False
    hint = " ".join(t.get_text() for t in ax.texts).replace("\n", ": ")
    warnings.warn(
        f"Gauge {ax.get_title()!r} has {hint}.", CockpitWarning, stacklevel=stacklevel
    )
    return True


def layer_count(data: Any, key: str = "GradHist2d", upto: int | None = None) -> int:
    """Number of per-parameter 2-D histograms in the latest ``key`` entry.

    Args:
        data: The run (see the module docstring).
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


#: The gauges of the primary screen, by panel, top to bottom.
PRIMARY_GAUGES = {
    "STEP SIZE": (plot_alpha, plot_distance, plot_grad_norm),
    "GRADIENTS": (plot_gradient_tests, plot_hist_1d, plot_hist_2d),
    "CURVATURE": (plot_max_ev, plot_trace, plot_tic),
}

#: The gauges of the primary screen's bottom row (what practitioners already watch).
BOTTOM_GAUGES = (plot_hyperparameters, plot_performance, plot_findings)

#: The gauges of the secondary screen's top band.
AUXILIARY_GAUGES = (plot_mean_gsnr, plot_cabs, plot_early_stopping)
