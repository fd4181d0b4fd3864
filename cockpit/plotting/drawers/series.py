"""Series against the iteration, Alpha and the gradient tests."""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import numpy as np
from matplotlib.axes import Axes
from matplotlib.patches import Circle

from cockpit.plotting.drawers.common import (
    ESTIMATE_BAND_GID,
    ESTIMATE_SPAN,
    Drawn,
    _extra,
    _mark_nonfinite,
    _notes,
    _points_with_trend,
    _run_handle,
    _several,
    _style_handle,
    _twinx,
    _value_axis,
    clip_runs,
    clipped_handles,
    legend_on_top,
    nonfinite_spans,
)
from cockpit.plotting.runs import Run
from cockpit.plotting.style import (
    COLORS,
    format_number,
    style_iteration_axis,
)


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
    clipped: list = []
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
        clipped.append(
            clip_runs(target, [(run, view[0], view[1]) for run, _, view, _ in side])
        )
        color = side[0][1].color if has_twin and not several else None
        target.set_ylabel(ylabel, **({"color": color} if color else {}))
        if not several:
            handles += target.get_legend_handles_labels()[0]
    if several:
        handles = _run_legend(runs, drawn, pending, gauge)
    if gauge.reference is not None:
        ax.axhline(gauge.reference, color=COLORS["red"], lw=0.8, linestyle="--")
    handles += clipped_handles(clipped)
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
    parabola = COLORS["dark"] if _several(runs) else COLORS["orange"]  # no run's
    ax.plot(x, x**2, color=parabola, linewidth=1.5, zorder=3)
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

#: z-order of each test's line: the norm test on top (drawn first, it was hidden
#: behind the orthogonality test's line where they agree).
_TEST_ZORDER = {"norm": 2.3, "inner": 2.2, "ortho": 2.1}


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
                                   markersize=2.5, lw=0.9, label=label,
                                   zorder=_TEST_ZORDER[name])  # fmt: skip
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
