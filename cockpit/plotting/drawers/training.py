"""What practitioners already watch: the learning rates, loss and accuracy."""

from __future__ import annotations

import weakref
from typing import Any, Sequence

import numpy as np
from matplotlib.axes import Axes
from matplotlib.patches import Patch

from cockpit.plotting.data import DashboardData, Series, as_data
from cockpit.plotting.drawers.common import (
    Drawn,
    _mark_nonfinite,
    _notes,
    _points_with_trend,
    _run_handle,
    _several,
    _style_handle,
    _twinx,
    _value_axis,
    legend_on_top,
)
from cockpit.plotting.drawers.series import _only_nonfinite
from cockpit.plotting.runs import Run
from cockpit.plotting.style import (
    COLORS,
    format_number,
    style_iteration_axis,
    style_value_axis,
)

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
