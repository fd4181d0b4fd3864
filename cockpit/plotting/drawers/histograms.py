"""The gradient element histograms: 1-D and 2-D (with marginals)."""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
from matplotlib.axes import Axes
from matplotlib.ticker import MaxNLocator, NullLocator

from cockpit.plotting.drawers.common import (
    Drawn,
    _corner_text,
    _extra,
    _log_counts,
    _notes,
    _several,
    legend_on_top,
)
from cockpit.plotting.runs import Run
from cockpit.plotting.style import (
    COLORS,
    HISTOGRAM_CMAP,
    format_number,
    style_value_axis,
)


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
