"""What every drawer shares: extra axes, legends that leave the data alone, marks."""

from __future__ import annotations

import math
import weakref
from typing import Any, Sequence

import numpy as np
from matplotlib.artist import Artist
from matplotlib.axes import Axes
from matplotlib.colors import Normalize
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import LogLocator, NullFormatter

from cockpit.log.keys import NONFINITE_KEY
from cockpit.plotting.data import DashboardData, as_data, spans_decades
from cockpit.plotting.runs import Run
from cockpit.plotting.style import (
    COLORS,
    ITERATION_CMAP,
    format_number,
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
        fit_legend(self.legend, holder, renderer, MAX_HEADROOM * height - pad)
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


#: The smallest font size (points) a legend is shrunk to so that it fits its axes.
MIN_LEGEND_SIZE = 5.0


def fit_legend(legend, ax: Axes, renderer, max_height: float) -> None:
    """Shrink a legend until it lies inside its axes (at most ``max_height`` high).

    Long run labels of several runs would otherwise spill out of a small gauge
    and be cut by its neighbours: the legend's font gets smaller (down to
    :data:`MIN_LEGEND_SIZE`) until it fits.
    """
    width = ax.bbox.width - renderer.points_to_pixels(4.0)

    def fits() -> bool:
        box = legend.get_window_extent(renderer)
        return box.width <= width and box.height <= max_height

    texts = legend.get_texts()
    if not texts or fits():
        return
    size = texts[0].get_fontsize()
    while size > MIN_LEGEND_SIZE and not fits():
        size = max(MIN_LEGEND_SIZE, size - 0.5)
        for text in texts:
            text.set_fontsize(size)


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
        log = spans_decades(values)
    if log:
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(numticks=5))
        ax.yaxis.set_minor_formatter(NullFormatter())
    else:
        style_value_axis(ax)


#: A run is clipped (drawn up to the top of its data, with a marker) when its
#: values rise above the other runs' by more than this many times the span of
#: theirs: on a linear axis tenfold (drawn whole, it would squeeze the others
#: into a tenth of the axes), on a log axis threefold in decades (each of which
#: is a factor of ten already: the others would keep a quarter).
CLIP_FACTOR = {"linear": 10.0, "log": 3.0}

#: ``get_gid()`` of the marker where a clipped run leaves the top of the axes.
CLIPPED_GID = "cockpit-clipped"


def clip_outlying_runs(ax: Axes, items: Sequence[tuple[Run, Any, Any]]) -> list:
    """Keep one run that shoots up (a diverged run) from squashing the others.

    Args:
        ax: Axes with the runs drawn on it (log or linear y-axis, set already).
        items: ``(run, steps, values)`` of each series drawn (a run may have
            several).

    Returns:
        Legend handles, one per clipped run (a triangle in its colour, where its
        values leave the axes and their largest); the y-limits then cover the
        other runs (and the clipped runs' values below their top), and a marker
        at the top of the data shows where each clipped run leaves them.
    """
    return clipped_handles([clip_runs(ax, items)])


def clipped_handles(sides: Sequence[list[tuple[Run, float, float]]]) -> list:
    """One legend handle per clipped run, over the axes it was clipped on.

    ``sides``: what :func:`clip_runs` returned for each axes of a gauge (a twin
    axes is a second side); a run clipped on both is listed once, with the
    step it first leaves any of them and its largest value on each
    (``up to a / b``, as the legend's ``last a / b``).
    """
    runs: dict[int, list] = {}
    for side in sides:
        for run, first, largest in side:
            runs.setdefault(run.index, [run, first, []])
            runs[run.index][1] = min(runs[run.index][1], first)
            runs[run.index][2].append(format_number(largest))
    handles = []
    for run, first, largest in runs.values():
        label = (f"{run.label}: above the axes from step {first:g} "
                 f"(up to {' / '.join(largest)})")  # fmt: skip
        handles.append(Line2D([], [], marker="^", color=run.color or COLORS["dark"],
                              linestyle="none", label=label))  # fmt: skip
    return handles


def clip_runs(
    ax: Axes, items: Sequence[tuple[Run, Any, Any]]
) -> list[tuple[Run, float, float]]:
    """Clip the outlying runs on ``ax`` (see :func:`clip_outlying_runs`).

    Returns:
        ``(run, first step above the axes, largest value)`` of each clipped run.
    """
    log = ax.get_yscale() == "log"
    spans: dict[int, list] = {}
    for run, steps, values in items:
        steps, values = np.asarray(steps), np.asarray(values, dtype=float)
        keep = np.isfinite(values) & ((values > 0) if log else True)
        if keep.any():
            spans.setdefault(run.index, []).append((run, steps[keep], values[keep]))
    if len(spans) < 2:
        return []
    scale = np.log10 if log else (lambda v: v)
    ends = {k: (min(float(scale(v).min()) for _, _, v in parts),
                max(float(scale(v).max()) for _, _, v in parts))
            for k, parts in spans.items()}  # fmt: skip
    clipped = []
    for k, (_, high) in ends.items():
        lows, highs = zip(*(ends[j] for j in ends if j != k))
        span = max(
            max(highs) - min(lows), 0.5 if log else 1e-12 + 0.1 * abs(max(highs))
        )
        if high - max(highs) > CLIP_FACTOR["log" if log else "linear"] * span:
            clipped.append(k)
    if not clipped or len(clipped) == len(ends):
        return []
    kept = [ends[k] for k in ends if k not in clipped]
    low = min(low for low, _ in ends.values())
    high = max(high for _, high in kept)
    margin = 0.05 * max(high - min(lo for lo, _ in kept), 1e-12)
    top = high + margin
    bottom = low - margin
    unscale = (lambda v: 10.0**v) if log else (lambda v: v)
    ax.set_ylim(unscale(bottom), unscale(top))
    found = []
    for k in clipped:
        run = spans[k][0][0]
        over = [(s[scale(v) > top], v.max()) for _, s, v in spans[k]]
        first = min(float(s.min()) for s, _ in over if s.size)
        largest = max(float(m) for _, m in over)
        (mark,) = ax.plot([first], [unscale(top)], marker="^",
                          color=run.color or COLORS["dark"], markersize=6,
                          linestyle="none", clip_on=False, zorder=6)  # fmt: skip
        mark.set_gid(CLIPPED_GID)
        found.append((run, first, largest))
    return found


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
