"""The drawing routines of the gauges, one per kind, for one run or several.

Each routine takes ``(ax, runs, gauge, keys, options)`` (see
:data:`cockpit.plotting.instruments.DRAWERS`) and returns the indices of the runs
it drew (empty: nothing to draw). ``runs`` holds one
:class:`~cockpit.plotting.runs.Run` without a colour (the classic look: points
coloured by iteration, a dark trend line) or several with a colour each: then every
artist drawn for run ``k`` has the gid ``cockpit-run-k`` and the legend names the
runs. ``options`` holds the gauge's options plus ``upto`` and ``show_log_iter``.

Legends never cover data: a legend sits at the top of its axes, and
:class:`Headroom` keeps that much of the axes free of data each time the figure is
drawn (the data are squeezed into the rest, whatever the figure's size).
"""

from __future__ import annotations

import math
import weakref
from bisect import bisect_left, bisect_right
from typing import Any, Mapping, Sequence

import matplotlib
import numpy as np
from matplotlib.artist import Artist
from matplotlib.axes import Axes
from matplotlib.colors import Normalize
from matplotlib.lines import Line2D
from matplotlib.patches import Circle, Patch
from matplotlib.text import Text as MplText
from matplotlib.ticker import LogLocator, MaxNLocator, NullFormatter, NullLocator
from matplotlib.transforms import ScaledTranslation

from cockpit import diagnosis
from cockpit.log.keys import NONFINITE_KEY
from cockpit.plotting.data import DashboardData, Series, as_data
from cockpit.plotting.runs import Run
from cockpit.plotting.style import (
    COLORS,
    HISTOGRAM_CMAP,
    ITERATION_CMAP,
    format_number,
    style_iteration_axis,
    style_value_axis,
)

#: ``get_gid()`` of the band around estimated values.
ESTIMATE_BAND_GID = "cockpit-estimate-band"

#: The band around estimated values spans this many standard errors either side
#: (about a 95 % interval for the mean of 16 probes).
ESTIMATE_SPAN = 2

#: At most this fraction of an axes' height is kept free for its legend; a taller
#: legend is cut down to what fits (see :class:`Headroom`).
MAX_HEADROOM = 0.6

Drawn = set  # the indices of the runs a routine drew


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


# --- legends that leave the data alone ----------------------------------------------
class Headroom(Artist):
    """Keeps the top of an axes free for a legend, at every draw.

    Added to the first-drawn axes of a gauge with the lowest z-order, it measures
    the legend (in pixels, so at the figure's real size) before anything else of
    the gauge is drawn and sets the y-limits of the data axes so that their data
    end below the legend: the data keep their limits' lower end and fill the rest.

    Args:
        legend: The legend at the top of ``axes[-1]`` (or of ``holder``).
        limits: ``(axes, (low, high))``: each data axes and its data limits.
    """

    def __init__(self, legend, limits: list[tuple[Axes, tuple[float, float]]]):
        super().__init__()
        self.legend = legend
        self.limits = limits
        self.set_zorder(-1000)
        self.set_in_layout(False)

    def draw(self, renderer) -> None:  # noqa: D102 - an Artist's draw
        holder = self.axes
        height = holder.bbox.height if holder is not None else 0.0
        if height <= 1 or not self.legend.get_visible():
            return
        pad = renderer.points_to_pixels(6.0)
        needed = self.legend.get_window_extent(renderer).height + pad
        fraction = min(needed / height, MAX_HEADROOM)
        for ax, (low, high) in self.limits:
            log = ax.get_yscale() == "log" and low > 0 and high > 0
            lo, hi = (math.log10(low), math.log10(high)) if log else (low, high)
            top = lo + (hi - lo) / (1.0 - fraction)
            top = 10.0**top if log else top
            current = ax.get_ylim()
            if not np.allclose(current, (low, top), rtol=1e-9, atol=0):
                ax.set_ylim(low, top)  # only when it changes: no redraw loop


def legend_on_top(
    top: Axes,
    handles: list,
    data_axes: Sequence[Axes],
    loc: str = "upper right",
    ncols: int | None = None,
):
    """A legend at the top of ``top`` that covers none of ``data_axes``' data.

    Args:
        top: The axes drawn last (the legend goes there, above every curve).
        handles: The legend's handles (with labels).
        data_axes: The axes whose data must stay below the legend; the first of
            them must be drawn first (the gauge's own axes).
        loc: ``"upper left"``, ``"upper center"`` or ``"upper right"``.
        ncols: Columns (default: one for up to three entries, else two).

    Returns:
        The legend.
    """
    if ncols is None:
        ncols = 1 if len(handles) <= 3 else 2
    legend = top.legend(handles=handles, loc=loc, ncols=ncols)
    limits = []
    for ax in data_axes:
        ax.autoscale_view()
        limits.append((ax, tuple(float(v) for v in ax.get_ylim())))
    data_axes[0].add_artist(Headroom(legend, limits))
    return legend


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


def _points_with_trend(
    ax: Axes,
    view: tuple,
    run: Run,
    label: str,
    color: str | None,
    trend_color: str | None,
    linestyle: str = "-",
) -> Line2D:
    """Points plus their trend line; returns the trend line.

    The points of the one run of a classic dashboard are coloured by iteration
    (unless ``color`` is given), those of several runs in their run's colour.
    """
    steps, values, smooth = view
    kwargs: dict[str, Any] = {"s": 7, "linewidths": 0, "alpha": 0.6, "zorder": 2}
    if run.color is not None:
        kwargs.update(color=run.color, alpha=0.3, s=5)
    elif color is None:
        norm = Normalize(vmin=float(steps[0]), vmax=float(max(steps[-1], 1)))
        kwargs.update(c=steps, cmap=ITERATION_CMAP, norm=norm)
    else:
        kwargs.update(color=color)
    points = ax.scatter(steps, values, **kwargs)
    points.set_gid(run.gid)
    last, now = format_number(float(values[-1])), format_number(float(smooth[-1]))
    (line,) = ax.plot(steps, smooth, color=run.color or trend_color or COLORS["dark"],
                      linewidth=1.3, zorder=3, linestyle=linestyle,
                      label=f"{label}: last {last}, trend {now}")  # fmt: skip
    line.set_gid(run.gid)
    return line


def _run_handle(run: Run, label: str | None = None) -> Line2D:
    """A legend entry in the run's colour."""
    return Line2D([], [], color=run.color, lw=2.0, label=label or run.label)


def _style_handle(label: str, linestyle: str = "-", marker: str | None = None):
    """A legend entry for a line style (several runs: colours are runs)."""
    return Line2D([], [], color=COLORS["dark"], lw=1.2, linestyle=linestyle,
                  marker=marker, markersize=3, label=label)  # fmt: skip


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
        data: The run (see :mod:`cockpit.plotting.instruments`).
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


def _mark_nonfinite(ax: Axes, runs: Sequence[Run], options) -> list:
    """Shade the non-finite steps red on an iteration axis; return legend handles.

    A lone step gets a red line, a run of steps a red band with a line where it
    begins, so the curves of a diverged run visibly end in red, not silently.
    With several runs the label names the run.
    """
    handles = []
    red = COLORS["red"]
    for run in runs:
        data = run.data
        spans = nonfinite_spans(data, options["upto"])
        if not spans:
            continue
        for first, last in spans:
            if last > first:
                band = ax.axvspan(first, last, color=red, alpha=0.13, lw=0, zorder=0.5)
                band.set_gid(run.gid)
            ax.axvline(first, color=red, lw=1.0, alpha=0.8, zorder=0.6)
        count = sum(1 for step in data.series(NONFINITE_KEY).steps
                    if options["upto"] is None or step <= options["upto"])  # fmt: skip
        where = (f"step {spans[0][0]}" if count == 1
                 else f"{count} steps from {spans[0][0]}")  # fmt: skip
        who = f" ({run.label})" if run.color is not None else ""
        label = f"non-finite {_nonfinite_what(data, spans)}{who}: {where}"
        handles.append(Patch(facecolor=red, alpha=0.35, edgecolor=red, label=label))
    return handles


def _several(runs: Sequence[Run]) -> bool:
    return len(runs) > 1 or runs[0].color is not None


def _notes(options) -> list:
    """The legend entries naming the runs without data (set by ``draw_gauge``)."""
    notes = options.get("notes", [])
    if notes:
        options["noted"] = True
    return list(notes)


# --- series against the iteration -----------------------------------------------------
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


def draw_series(ax, runs: Sequence[Run], gauge, keys, options) -> Drawn:
    """Series vs iteration, left axis and optionally a twin right axis.

    Estimated values get a band of their standard errors, ``(estimated)`` in
    their label, and ``options["estimated"]`` is set (the title says so); values
    of the GGN standing in for the Hessian (their estimates say
    ``"curvature": "ggn"``) say ``GGN`` there too (``options["curvature"]``).
    """
    several = _several(runs)
    styles = ("-", "--", ":")
    drawn: Drawn = set()
    pending = []  # (run, line, view with errors, bound)
    recorded_any = False
    for run in runs:
        for line in gauge.lines:
            series = run.data.series(keys[line.role], line.reduce)
            if not len(series):
                continue
            recorded_any = True
            view = series.view_errors(options["upto"])
            if len(view[0]):
                pending.append((run, line, view, series.error_bound))
                if "ggn" in series.curvatures:  # the GGN stood in for the Hessian
                    options["curvature"] = "GGN"
    if not pending:
        return _only_nonfinite(ax, runs, options) if recorded_any else set()
    style_iteration_axis(ax, options["show_log_iter"])
    has_twin = any(line.twin for line in gauge.lines)
    handles: list = []
    top = ax
    data_axes = []
    for twin, ylabel in ((False, gauge.ylabel), (True, gauge.twin_ylabel)):
        side = [item for item in pending if item[1].twin == twin]
        if not side:
            if not twin and has_twin:
                ax.set_yticks([])
            continue
        target = top = _twinx(ax) if twin else ax
        data_axes.append(target)
        for run, line, with_errors, bound in side:
            estimated = bool(np.isfinite(with_errors[3]).any())
            label = f"{line.label} (estimated)" if estimated else line.label
            if options.get("curvature"):
                label = (
                    f"{label[:-1]}, {options['curvature']})"
                    if estimated
                    else (f"{label} ({options['curvature']})")
                )
            if several:
                label = f"{run.label}: {label}" if len(gauge.lines) > 1 else run.label
            style = styles[gauge.lines.index(line) % len(styles)] if several else "-"
            view = with_errors[:3]
            if line.steps:
                last = format_number(view[1][-1])
                (drawn_line,) = target.plot(
                    view[0], view[1], color=run.color or line.color,
                    drawstyle="steps-post", linestyle=style,
                    label=f"{label}, last {last}")  # fmt: skip
                drawn_line.set_gid(run.gid)
            else:
                _points_with_trend(target, view, run, label, line.color,
                                   line.ema_color, style)  # fmt: skip
            if estimated:
                _estimate_band(target, with_errors, run.color or line.color, bound)
                options["estimated"] = True
            drawn.add(run.index)
        _value_axis(target, np.concatenate([item[2][1] for item in side]),
                    side[0][1].log)  # fmt: skip
        color = side[0][1].color if has_twin and not several else None
        target.set_ylabel(ylabel, **({"color": color} if color else {}))
        if not several:
            handles += target.get_legend_handles_labels()[0]
    if several:
        handles = _run_legend(runs, drawn, pending, gauge)
    if gauge.reference is not None:
        ax.axhline(gauge.reference, color=COLORS["red"], lw=0.8, linestyle="--")
    handles += _mark_nonfinite(ax, runs, options) + _notes(options)
    legend_on_top(top, handles, data_axes, loc=gauge.legend_loc)
    return drawn


def _run_legend(runs, drawn, pending, gauge) -> list:
    """Several runs: one entry per run (its last value), one per line style."""
    handles = []
    for run in runs:
        if run.index not in drawn:
            continue
        lasts = [format_number(float(view[1][-1]))
                 for r, _, view, _ in pending if r is run]  # fmt: skip
        handles.append(_run_handle(run, f"{run.label}: last {' / '.join(lasts)}"))
    drawn_lines = {id(line) for _, line, _, _ in pending}
    if len(drawn_lines) > 1:
        styles = ("-", "--", ":")
        for index, line in enumerate(gauge.lines):
            if id(line) in drawn_lines:
                side = " (right)" if line.twin else ""
                handles.append(_style_handle(line.label + side, styles[index % 3]))
    return handles


def _only_nonfinite(ax: Axes, runs: Sequence[Run], options) -> Drawn:
    """A gauge whose values were all NaN/inf: the red marks and a note, if any."""
    marks = _mark_nonfinite(ax, runs, options)
    if not marks:
        return set()
    style_iteration_axis(ax, options["show_log_iter"])
    ax.set_yticks([])
    ax.text(0.5, 0.5, "no finite value", ha="center", va="center",
            color=COLORS["red"], transform=ax.transAxes)  # fmt: skip
    ax.legend(handles=marks, loc="upper left")
    return {run.index for run in runs if nonfinite_spans(run.data, options["upto"])}


# --- alpha ---------------------------------------------------------------------------
def draw_alpha(ax, runs: Sequence[Run], gauge, keys, options) -> Drawn:
    """The unit parabola with histograms of the alpha values.

    One run: all values (gray) and the most recent ones (blue); several: one
    outlined histogram per run. Means in the legend.
    """
    lo, hi = -1.5, 1.5
    edges = np.linspace(lo, hi, options["bins"] + 1)
    found = []
    for run in runs:
        _, values, _ = run.data.series(keys["key"]).view(options["upto"], None)
        if len(values) >= 2:
            found.append((run, values))
    if not found:
        return set()
    x = np.linspace(lo, hi, 121)
    ax.plot(x, x**2, color=COLORS["orange"], linewidth=1.5, zorder=3)
    for position in (-1.0, 0.0, 1.0):
        ax.axvline(position, color=COLORS["gray"], linestyle=":", linewidth=0.8)
    ax.set(xlim=(lo, hi), ylim=(0, 1.75), yticks=[], xlabel="normalized step length α",
           xticks=[-1.5, -1, -0.5, 0, 0.5, 1, 1.5])  # fmt: skip
    twin = _twinx(ax)
    peak = 0.0
    for run, values in found:
        clipped = np.clip(values, lo, np.nextafter(hi, lo))
        if run.color is None:
            n_recent = max(1, math.ceil(options["recent"] * len(values)))
            subsets = ((clipped, COLORS["gray"], "all", True),
                       (clipped[-n_recent:], COLORS["blue"],
                        f"last {options['recent']:.0%}", True))  # fmt: skip
        else:
            subsets = ((clipped, run.color, run.label, False),)
        for subset, color, name, fill in subsets:
            counts, _ = np.histogram(subset, edges)
            density = counts / (len(subset) * (edges[1] - edges[0]))
            peak = max(peak, float(density.max()))
            mean = float(np.mean(values[-len(subset) :]))
            stairs = twin.stairs(density, edges, fill=fill, color=color,
                                 alpha=0.45 if fill else 0.9, lw=1.4,
                                 label=f"{name}: mean {mean:+.2f}")  # fmt: skip
            stairs.set_gid(run.gid)
    twin.set_ylim(0, 1.1 * peak if peak > 0 else 1)
    twin.set_yticks([])
    handles = twin.get_legend_handles_labels()[0] + _notes(options)
    legend_on_top(twin, handles, [twin], loc="upper center",
                  ncols=2 if len(handles) <= 4 else 3)  # fmt: skip
    for run, values in found:
        if run.color is not None and len(found) > 1:
            continue  # the counts beyond the range: for one run only
        below, above = int(np.sum(values < lo)), int(np.sum(values > hi))
        marks = ((below, f"◀ {below}", 0.01, "left"),
                 (above, f"{above} ▶", 0.99, "right"))  # fmt: skip
        for count, text, xpos, align in marks:
            if count:
                ax.annotate(text, (xpos, 0.04), xycoords="axes fraction", ha=align,
                            fontsize=7)  # fmt: skip
    return {run.index for run, _ in found}


# --- gradient tests ------------------------------------------------------------------
_TESTS = (("norm_key", "norm", COLORS["blue"], "-"),
          ("inner_key", "inner", COLORS["orange"], "--"),
          ("ortho_key", "ortho", COLORS["green"], ":"))  # fmt: skip


def draw_tests(ax, runs: Sequence[Run], gauge, keys, options) -> Drawn:
    """Latest tests as shapes around the origin (left), their history (right).

    Several runs: each run's shapes outlined in its colour, its tests in its colour
    with one line style per test.
    """
    several = _several(runs)
    found = []
    for run in runs:
        views = [(run.data.series(keys[role]).view(options["upto"]), name, color, ls)
                 for role, name, color, ls in _TESTS]  # fmt: skip
        if any(len(view[0]) for view, _, _, _ in views):
            found.append((run, views))
    if not found:
        return set()
    ax.set_axis_off()
    shape = _extra(ax, ax.inset_axes([0.0, 0.0, 0.36, 0.95]))
    history = _extra(ax, ax.inset_axes([0.52, 0.0, 0.48, 0.95]))
    latest_all = []
    for run, views in found:
        latest = {name: float(view[1][-1]) for view, name, _, _ in views
                  if len(view[0])}  # fmt: skip
        latest_all.append((run, latest))
    limit = max(1.5, 1.15 * max(v for _, latest in latest_all for v in latest.values()))
    shape.set(xlim=(-limit, limit), ylim=(-limit, limit))
    shape.set_aspect("equal", adjustable="box")
    shape.add_patch(
        Circle((0, 0), 1.0, fill=False, linestyle="--", color=COLORS["gray"], lw=0.8)
    )
    for run, latest in latest_all:
        _test_shapes(shape, run, latest, several)
    shape.axhline(0, color=COLORS["dark"], lw=0.6)
    shape.axvline(0, color=COLORS["dark"], lw=0.6)
    shape.xaxis.set_major_formatter(format_number)
    shape.yaxis.set_major_formatter(format_number)
    shape.locator_params(nbins=3)
    shape.set_xlabel("latest, unit circle = 1", fontsize=7)

    values = []
    for run, views in found:
        for (steps, vals, _), name, color, style in views:
            if not len(steps):
                continue
            values.append(vals)
            label = f"{name} {format_number(vals[-1])}"
            (line,) = history.plot(steps, vals, color=run.color or color,
                                   linestyle=style if several else "-",
                                   marker="." if not several else None,
                                   markersize=2.5, lw=0.9, label=label)  # fmt: skip
            line.set_gid(run.gid)
    history.axhline(1.0, color=COLORS["gray"], linestyle="--", lw=0.8)
    _value_axis(history, np.concatenate(values))
    style_iteration_axis(history, options["show_log_iter"])
    _mark_nonfinite(history, runs, options)  # no legend entry: the inset is small
    if several:
        handles = [_run_handle(run) for run, _ in found]
        handles += [_style_handle(name, style) for _, name, _, style in _TESTS]
    else:
        handles = history.get_legend_handles_labels()[0]
    legend_on_top(history, handles + _notes(options), [history], loc="upper left")
    return {run.index for run, _ in found}


def _test_shapes(shape: Axes, run: Run, latest: Mapping[str, float], several: bool):
    """The latest tests of one run as shapes (filled for one run, outlined else)."""
    if "inner" in latest:
        value = latest["inner"]
        if several:
            for y in (-value, value):
                shape.axhline(y, color=run.color, lw=1.0, linestyle="--", gid=run.gid)
        else:
            shape.axhspan(-value, value, color=COLORS["orange"], alpha=0.3)
    if "ortho" in latest:
        value = latest["ortho"]
        if several:
            for x in (-value, value):
                shape.axvline(x, color=run.color, lw=1.0, linestyle=":", gid=run.gid)
        else:
            shape.axvspan(-value, value, color=COLORS["green"], alpha=0.3)
    if "norm" in latest:
        if several:
            circle = Circle((0, 0), latest["norm"], fill=False, color=run.color, lw=1.2)
        else:
            circle = Circle((0, 0), latest["norm"], color=COLORS["blue"], alpha=0.3,
                            lw=0)  # fmt: skip
        circle.set_gid(run.gid)
        shape.add_patch(circle)


# --- histograms ----------------------------------------------------------------------
def draw_hist_1d(ax, runs: Sequence[Run], gauge, keys, options) -> Drawn:
    """The latest 1-D histogram as filled steps on a log count axis.

    Several runs: one outline per run, as the fraction of its elements (runs of
    different models have different counts).
    """
    several = _several(runs)
    found = [(run, run.data.latest(keys["key"], options["upto"])) for run in runs]
    found = [(run, entry) for run, entry in found if entry is not None]
    if not found:
        return set()
    low_edge, high_edge, floors = math.inf, -math.inf, []
    for run, (step, value) in found:
        counts = np.asarray(value["hist"], dtype=float)
        edges = np.asarray(value["edges"], dtype=float)
        if several and counts.sum() > 0:
            counts = counts / counts.sum()
        positive = counts[counts > 0]
        floor = 0.8 * (positive.min() if positive.size else 1.0)
        floors.append(floor)
        stairs = ax.stairs(np.maximum(counts, floor), edges, baseline=floor,
                           fill=not several, lw=1.3,
                           color=run.color or COLORS["orange"],
                           alpha=0.9 if several else 0.85,
                           label=f"{run.label}: step {step}")  # fmt: skip
        stairs.set_gid(run.gid)
        low_edge, high_edge = min(low_edge, edges[0]), max(high_edge, edges[-1])
        if not positive.size:  # NaN gradients fall into no bin
            _empty_note(ax, step)
    _log_counts(ax)
    ax.set_ylim(bottom=min(floors))
    ax.set_xlim(low_edge, high_edge)
    style_value_axis(ax, "x")
    ax.set(xlabel="gradient element value",
           ylabel="fraction of elements" if several else "count")  # fmt: skip
    if several:
        handles = ax.get_legend_handles_labels()[0] + _notes(options)
        legend_on_top(ax, handles, [ax], loc="upper right")
    else:
        _corner_text(ax, f"step {found[0][1][0]}", 7, 0.99, 0.96)
    return {run.index for run, _ in found}


def _empty_note(ax: Axes, step: int) -> None:
    """Say (in red) that a histogram counted nothing, e.g. for NaN gradients."""
    ax.text(0.5, 0.5, f"no finite value counted at step {step}", ha="center",
            va="center", color=COLORS["red"], fontsize=7,
            transform=ax.transAxes)  # fmt: skip


def draw_hist_2d(ax, runs: Sequence[Run], gauge, keys, options) -> Drawn:
    """The latest 2-D histogram as a heat map, with marginal histograms.

    Several runs: one heat map per run side by side (without marginals), each
    titled with the run's name in its colour.
    """
    found = []
    for run in runs:
        latest = run.data.latest(keys["key"], options["upto"])
        param = options["param"]
        entry = latest[1] if latest is not None and param is None else None
        if latest is not None and param is not None:
            entry = latest[1].get(f"param_{param}")
        if entry is not None:
            found.append((run, latest[0], entry))
    if not found:
        return set()
    if not _several(runs):
        _, step, entry = found[0]
        _heat_map(ax, ax, entry, step, options, options["marginals"], runs[0])
        return {runs[0].index}
    ax.set_axis_off()
    width = 1.0 / len(runs)
    entries = {run.index: (step, entry) for run, step, entry in found}
    for position, run in enumerate(runs):
        if run.index not in entries:  # named in its place
            note = ax.text((position + 0.5) * width, 0.45, f"{run.label}:\nno "
                           f"{keys['key']}", ha="center", va="center", fontsize=7,
                           color=COLORS["gray"], style="italic",
                           transform=ax.transAxes)  # fmt: skip
            note.set_gid("cockpit-missing-runs")
            options["noted"] = True
            continue
        step, entry = entries[run.index]
        heat = _extra(ax, ax.inset_axes([position * width + 0.02, 0.0,
                                         width - 0.06, 0.88]))  # fmt: skip
        _heat_map(ax, heat, entry, step, options, False, run)
        heat.set_title(run.label, color=run.color, fontsize=7, pad=2)
        if position:
            heat.set_ylabel("")
    return {run.index for run, _, _ in found}


def _heat_map(ax, heat, entry, step, options, marginals: bool, run: Run) -> None:
    counts = np.asarray(entry["hist"], dtype=float)
    grad_edges = np.asarray(entry["edges"][0], dtype=float)
    param_edges = np.asarray(entry["edges"][1], dtype=float)
    transform = options["transformation"] or (lambda c: np.log10(c + 1.0))
    shown = np.ma.masked_where(counts == 0, np.asarray(transform(counts), float))
    if marginals:
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
    mesh.set_gid(run.gid)
    if np.any(counts > 0):
        if marginals or run.color is None:
            _colour_bar(ax, heat, mesh, counts, {**options, "marginals": marginals})
    else:  # NaN gradients or parameters fall into no bin
        _empty_note(heat, step)
    heat.axhline(0, color=COLORS["gray"], lw=0.5, linestyle=":")
    heat.axvline(0, color=COLORS["gray"], lw=0.5, linestyle=":")
    heat.set(xlabel="parameter value", ylabel="gradient element")
    style_value_axis(heat, "x", nbins=4)
    style_value_axis(heat, "y", nbins=4)
    _corner_text(heat, f"step {step}", 6.5, 0.98, 0.97)


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


# --- learning rates ----------------------------------------------------------------
# Per-element series of list-valued keys, read incrementally like DashboardData's.
_ELEMENT_SERIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def element_series(data: Any, key: str) -> list[Series]:
    """One series per list element of ``key`` (e.g. per parameter group).

    ``learning_rates`` holds one learning rate per parameter group; series ``k``
    holds element ``k`` at every step where the list has one. Like the series of
    :class:`~cockpit.plotting.data.DashboardData`, later calls read only the steps
    added since (and the last one read before, which may have changed).

    Args:
        data: The run (see :mod:`cockpit.plotting.instruments`).
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
    ax.set_ylim(bottom, top if top > 0 else 1.0)


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


def _rate_lines(data: DashboardData, keys, upto) -> tuple[list, int]:
    """The learning-rate lines of a run: ``[(groups, view)]`` and the group count."""
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
        if len(logged[0]):
            merged = [([0], logged)]
    return merged, len(views)


def draw_learning_rates(ax, runs: Sequence[Run], gauge, keys, options) -> Drawn:
    """One step line per parameter group; else the rate handed to Cockpit.log.

    Several runs: the lines of a run in its colour, groups told apart by style.
    """
    several = _several(runs)
    found = [(run, *_rate_lines(run.data, keys, options["upto"])) for run in runs]
    found = [item for item in found if item[1]]
    if not found:
        return set()
    style_iteration_axis(ax, options["show_log_iter"])
    palette = [COLORS[c] for c in ("blue", "orange", "green", "purple", "gray")]
    styles = ("-", "--", ":", "-.")
    handles = []
    for run, merged, groups in found:
        single = len(merged) == 1 and groups <= 1
        for index, (members, (steps, values, _)) in enumerate(merged):
            label = _group_label(members, values[-1], single)
            if several:
                label = f"{run.label}: {label}"
            color = run.color or palette[index % len(palette)]
            style = styles[index % len(styles)] if several else "-"
            (line,) = ax.plot(steps, values, drawstyle="steps-post", lw=1.4,
                              color=color, linestyle=style, label=label)  # fmt: skip
            line.set_gid(run.gid)
            handles.append(line)
    _rate_axis(ax, np.concatenate([v[1] for _, merged, _ in found for _, v in merged]))
    ax.set_ylabel(gauge.ylabel)
    if len(handles) > 6:
        extra = Patch(color="none", label=f"+{len(handles) - 5} more lines")
        handles = handles[:5] + [extra]
    handles += _mark_nonfinite(ax, runs, options) + _notes(options)
    legend_on_top(ax, handles, [ax], loc="upper right")
    return {run.index for run, _, _ in found}


# --- performance -------------------------------------------------------------------
def draw_performance(ax, runs: Sequence[Run], gauge, keys, options) -> Drawn:
    """Mini-batch loss (points + trend), logged losses (lines), accuracies (twin).

    Several runs: colours are runs; logged losses and accuracies are told apart by
    line style (a key in the legend).
    """
    several = _several(runs)
    upto = options["upto"]
    loss_styles = ("--", "-.", (0, (5, 1, 1, 1)))
    acc_styles = (":", (0, (1, 3)), (0, (3, 3)))
    found = []
    recorded = False
    for run in runs:
        loss = run.data.series(keys["loss_key"]).view(upto)
        recorded |= len(run.data.series(keys["loss_key"])) > 0
        logged = [(k, run.data.series(k).view(upto)) for k in options["log_losses"]]
        accs = [(k, run.data.series(k).view(upto)) for k in options["accuracies"]]
        logged = [(k, view) for k, view in logged if len(view[0])]
        accs = [(k, view) for k, view in accs if len(view[0])]
        if len(loss[0]) or logged or accs:
            found.append((run, loss, logged, accs))
    if not found:
        return _only_nonfinite(ax, runs, options) if recorded else set()
    style_iteration_axis(ax, options["show_log_iter"])
    handles: list = []
    values = []
    any_accuracy = any(accs for *_, accs in found)
    twin = _twinx(ax) if any_accuracy else None
    styles_used: dict[str, Any] = {}
    for run, loss, logged, accs in found:
        if len(loss[0]):
            line = _points_with_trend(ax, loss, run, "mini-batch loss", None, None)
            values.append(loss[1])
            if not several:
                handles.append(line)
        for position, (name, (steps, vals, _)) in enumerate(logged):
            label = f"{name.replace('_', ' ')}, last {format_number(vals[-1])}"
            if several:
                color, style = run.color, loss_styles[position % 3]
                styles_used.setdefault(name, style)
            else:
                color = (COLORS["blue"], COLORS["red"], COLORS["purple"])[position % 3]
                style = "-"
            (line,) = ax.plot(steps, vals, color=color, lw=1.2, linestyle=style,
                              label=label)  # fmt: skip
            line.set_gid(run.gid)
            values.append(vals)
            if not several:
                handles.append(line)
        for position, (name, (steps, vals, _)) in enumerate(accs):
            label = f"{name.replace('_', ' ')}, last {100 * vals[-1]:.1f}%"
            if several:
                color, style = run.color, acc_styles[position % 3]
                styles_used.setdefault(name, style)
            else:
                color = (COLORS["green"], COLORS["orange"], COLORS["gray"])[
                    position % 3
                ]
                style = "--"
            (line,) = twin.plot(steps, vals, color=color, lw=1.2, linestyle=style,
                                label=label)  # fmt: skip
            line.set_gid(run.gid)
            if not several:
                handles.append(line)
    ax.set_ylabel("loss")
    data_axes = [ax]
    if values:
        _value_axis(ax, np.concatenate(values))
    if twin is not None:
        twin.set_ylim(0, 1.02)
        twin.set_yticks([0, 0.2, 0.4, 0.6, 0.8, 1.0])  # none above 100 %
        twin.yaxis.set_major_formatter(lambda y, _pos: f"{100 * y:.0f}%")
        twin.set_ylabel("accuracy")
        data_axes.append(twin)
    if several:
        handles = [_run_handle(run) for run, *_ in found]
        if any(len(loss[0]) for _, loss, _, _ in found):
            handles.append(_style_handle("mini-batch loss (trend)"))
        handles += [_style_handle(name.replace("_", " "), style)
                    for name, style in styles_used.items()]  # fmt: skip
    handles += _mark_nonfinite(ax, runs, options) + _notes(options)
    legend_on_top(twin or ax, handles, data_axes, loc="upper right")
    return {run.index for run, *_ in found}


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
    budget = PANEL_LINES - checks_lines - count - headers
    detail_lines = min(3, budget // max(count, 1))
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
