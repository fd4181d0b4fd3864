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
  accepts: a ``History``, a ``Cockpit``, a ``{step: {key: value}}`` dict, a log path;
  or several runs, a list or tuple of these (or of
  :class:`~cockpit.plotting.runs.Run`): one colour per run, aligned by step, the
  runs named in the legend (``labels=`` names them; default: the file names), and
  the runs without data for the gauge named in it (gid
  :data:`MISSING_RUNS_GID`).
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
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Union

from matplotlib.axes import Axes

from cockpit.errors import CockpitWarning
from cockpit.plotting import drawers
from cockpit.plotting.data import as_data
from cockpit.plotting.drawers import (  # noqa: F401 - public here since 1.0
    ESTIMATE_BAND_GID,
    ESTIMATE_SPAN,
    PANEL_LINES,
    SEVERITY_COLORS,
    clear_gauge,
    diagnosis_findings,
    element_series,
    extra_axes,
    nonfinite_spans,
)
from cockpit.plotting.runs import Run, as_runs, is_several
from cockpit.plotting.style import COLORS, no_data

#: ``Axes.get_gid()`` of a gauge that had nothing to draw.
NO_DATA_GID = "cockpit-no-data"

#: ``Axes.get_gid()`` of a gauge that drew data.
GAUGE_GID = "cockpit-gauge"

#: ``get_gid()`` of the note that names the runs without data for a gauge.
MISSING_RUNS_GID = "cockpit-missing-runs"

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


#: The drawing routine of each kind of gauge: ``(ax, runs, gauge, keys, options)``
#: to the indices of the runs drawn (see :mod:`cockpit.plotting.drawers`).
DRAWERS: dict[str, Callable[..., set]] = {
    "series": drawers.draw_series,
    "alpha": drawers.draw_alpha,
    "tests": drawers.draw_tests,
    "hist_1d": drawers.draw_hist_1d,
    "hist_2d": drawers.draw_hist_2d,
    "performance": drawers.draw_performance,
    "learning_rates": drawers.draw_learning_rates,
    "findings": drawers.draw_findings,
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
        caption="disc: norm, bands: inner (horizontal), ortho (vertical); "
        "past the unit circle: batch too small",
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
    labels: Any = None,
    **arguments: Any,
) -> Axes:
    """Draw the gauge ``name`` of :data:`GAUGES` onto ``ax``.

    Args:
        name: The gauge (e.g. ``"grad_norm"``).
        ax: Axes to draw on (cleared first, see :func:`clear_gauge`).
        data: The run, or a list of runs (see the module docstring).
        show_log_iter: Symmetric-log iteration axis.
        upto: Ignore steps after this one.
        labels: Names of several runs (default: their file names).
        **arguments: History keys (by the gauge's key arguments) and options.

    Returns:
        ``ax``.

    Raises:
        ValueError: For an unknown gauge, or labels that do not fit the runs.
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
            f"{roles + list(gauge.options)} besides show_log_iter, upto and labels."
        )
    keys = {role: arguments.get(role, key) for role, key, _ in gauge.keys}
    options = {
        **gauge.options,
        **{k: v for k, v in arguments.items() if k in gauge.options},
        "show_log_iter": show_log_iter,
        "upto": upto,
    }
    runs = as_runs(data, labels)
    clear_gauge(ax)
    context = {**keys, **options}
    title = _text(gauge.title, context)
    several = is_several(data)
    missing = [
        run for run in runs if several and not run_has(run, gauge, keys, options)
    ]
    if missing:
        options["notes"] = [_missing_handle(gauge, keys, missing)]
    if not DRAWERS[gauge.kind](ax, runs, gauge, keys, options):
        hint = _missing_hint(runs, gauge_reads(gauge, keys, options)) or (
            _text(gauge.hint, context) or "track " + " or ".join(keys.values())
        )
        no_data(ax, title, hint)
        ax.set_gid(NO_DATA_GID)
        return ax
    if options.get("estimated"):
        title += " (estimated)"
    if options.get("curvature"):  # the GGN in place of the Hessian
        title = (
            f"{title[:-1]}, {options['curvature']})"
            if options.get("estimated")
            else f"{title} ({options['curvature']})"
        )
    if gauge.caption:
        drawers.fitted_caption(ax, title, gauge.caption)
    else:
        ax.set_title(title)
    if missing and not options.get("noted"):
        text = ax.text(0.01, 0.01, options["notes"][0].get_label(), fontsize=6.5,
                       color=COLORS["gray"], style="italic", ha="left", va="bottom",
                       transform=ax.transAxes)  # fmt: skip
        text.set_gid(MISSING_RUNS_GID)
    ax._cockpit_missing_runs = [run.label for run in missing]
    ax.set_gid(GAUGE_GID)
    return ax


def gauge_reads(gauge: Gauge, keys: Mapping[str, str], options=None) -> list[str]:
    """The history keys a gauge draws (with the logged losses and accuracies)."""
    read = list(keys.values())
    if gauge.kind == "performance":
        options = {**gauge.options, **(options or {})}
        read += [*options["log_losses"], *options["accuracies"]]
    return read


def run_has(run: Run, gauge: Gauge, keys: Mapping[str, str], options=None) -> bool:
    """Whether a run recorded anything the gauge draws (at any step).

    The findings panel has something for every run with a step; a per-layer
    histogram needs its parameter's entry.
    """
    if gauge.kind == "findings":
        return run.data.last_step is not None
    options = {**gauge.options, **(options or {})}
    if gauge.kind == "hist_2d" and options.get("param") is not None:
        return layer_count(run.data, keys["key"]) > options["param"]
    return any(run.data.has(key) for key in gauge_reads(gauge, keys, options))


#: Latest steps searched for a ``missing`` record of a gauge's keys.
MISSING_LOOKBACK = 50


def missing_record(run: Run, keys) -> tuple[str, str] | None:
    """``(key, reason)`` of one of ``keys`` a run tracked but recorded as missing.

    Searches the run's latest :data:`MISSING_LOOKBACK` steps; ``None`` if none.
    """
    wanted = set(keys)
    history = run.data.history
    for step in reversed(history.steps[-MISSING_LOOKBACK:]):
        missing = history.missing_at(int(step)) or {}
        for key in sorted(wanted & set(missing)):
            return key, str(missing[key])
    return None


def _missing_hint(runs, reads) -> str:
    """Say that a key was tracked but has no value, where a run recorded it missing.

    A gauge without data whose quantity was tracked but recorded under ``missing``
    says so (with the start of the reason), instead of asking to track it.
    """
    for run in runs:
        found = missing_record(run, reads)
        if found is not None:
            key, reason = found
            reason = reason.split(". ")[0]
            if len(reason) > 60:
                reason = reason[:59].rstrip() + "…"
            where = "(cockpit report <log> says why)"
            return f"{key} tracked, no value:\n{reason}\n{where}"
    return ""


def _missing_handle(gauge: Gauge, keys: Mapping[str, str], missing: list[Run]):
    """A legend entry (without a mark) that names the runs without the gauge's data."""
    from matplotlib.patches import Patch

    what = "/".join(dict.fromkeys(gauge_reads(gauge, keys)))
    if gauge.kind == "findings":
        what = "steps"
    names = ", ".join(run.label for run in missing)
    return Patch(color="none", label=f"no {what}: {names}")


def _public(name: str) -> Callable[..., Axes]:
    """``plot_<name>(ax, data, *, show_log_iter, upto, <keys>, <options>)``."""
    gauge = GAUGES[name]

    def plot(ax: Axes, data: Any, **arguments: Any) -> Axes:
        return draw_gauge(name, ax, data, **arguments)

    keyword = inspect.Parameter.KEYWORD_ONLY
    positional = inspect.Parameter.POSITIONAL_OR_KEYWORD
    defaults = [("show_log_iter", False), ("upto", None), ("labels", None)]
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
        "or log path; or a list of them: several runs, one colour each.",
        "show_log_iter: Symmetric-log iteration axis (if the gauge has one).",
        "upto: Ignore steps after this one.",
        "labels: Names of several runs (default: their file names).",
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
