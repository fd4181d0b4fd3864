"""cockpit-for-pytorch 1.0.2's gauge functions, called as ``gauge(plotter, fig, gs)``.

Each function adds one subplot at ``gridspec`` (a ``SubplotSpec``, e.g. ``gs[0, 1]``
of ``fig.add_gridspec(...)``) and draws the gauge there from the data the plotter
loaded with :meth:`~cockpit.plotting.CockpitPlotter.plot` or
:meth:`~cockpit.plotting.CockpitPlotter.load`, honouring its ``discard`` and
``show_log_iter``. The drawing is the dashboard's own (see
:mod:`cockpit.plotting.instruments`), in the dashboard's style; matplotlib's global
state is left alone. Unlike 1.0.2, a gauge without data is not skipped: its subplot
says what to track (and with ``plot(..., debug=True)`` a warning says so too). Each
function returns the ``Axes`` it drew on (1.0.2 returned ``None``).

Example::

    plotter = CockpitPlotter()
    plotter.load("logs/run.json")
    fig = matplotlib.figure.Figure(figsize=(8, 3))
    gs = fig.add_gridspec(1, 2)
    alpha_gauge(plotter, fig, gs[0, 0])
    grad_norm_gauge(plotter, fig, gs[0, 1])
"""

from __future__ import annotations

from typing import Any, Callable

from matplotlib.axes import Axes

from cockpit.plotting.instruments import draw_gauge, warn_if_empty
from cockpit.plotting.style import dashboard_style

__all__ = [
    "alpha_gauge",
    "cabs_gauge",
    "distance_gauge",
    "early_stopping_gauge",
    "grad_norm_gauge",
    "gradient_tests_gauge",
    "histogram_1d_gauge",
    "histogram_2d_gauge",
    "hyperparameter_gauge",
    "max_ev_gauge",
    "mean_gsnr_gauge",
    "performance_gauge",
    "tic_gauge",
    "trace_gauge",
]


def _draw(name: str, plotter: Any, fig: Any, gridspec: Any, **options: Any) -> Axes:
    """Draw gauge ``name`` of the plotter's data into ``fig.add_subplot(gridspec)``."""
    data = getattr(plotter, "data", None)
    if data is None:
        raise RuntimeError(
            f"The 1.0.2 gauge functions draw a CockpitPlotter's loaded run, got "
            f"{type(plotter).__name__} without one. Fix: call plotter.plot(source) "
            "or plotter.load(source) first, then pass the plotter."
        )
    if getattr(plotter, "several", False):
        data = plotter.gauge_source()  # the runs side by side
    ax = fig.add_subplot(gridspec)
    with dashboard_style():
        draw_gauge(name, ax, data, show_log_iter=plotter.show_log_iter,
                   upto=plotter.discard, **options)  # fmt: skip
    if plotter.debug:
        warn_if_empty(ax, stacklevel=4)
    return ax


def _gauge(name: str, title: str) -> Callable[[Any, Any, Any], Axes]:
    def gauge(self: Any, fig: Any, gridspec: Any) -> Axes:
        return _draw(name, self, fig, gridspec)

    gauge.__doc__ = (
        f"{title} (see :func:`cockpit.plotting.instruments.plot_{name}`).\n\n"
        "Args:\n"
        "    self: A CockpitPlotter with a loaded run.\n"
        "    fig: The figure to draw in.\n"
        "    gridspec: Where in ``fig`` (a SubplotSpec).\n\n"
        "Returns:\n    The new ``Axes``.\n"
    )
    return gauge


alpha_gauge = _gauge("alpha", "Alpha Distribution")
distance_gauge = _gauge("distance", "Distance")
grad_norm_gauge = _gauge("grad_norm", "Gradient Norm")
gradient_tests_gauge = _gauge("gradient_tests", "Gradient Tests")
histogram_1d_gauge = _gauge("hist_1d", "Gradient Element Histogram")
max_ev_gauge = _gauge("max_ev", "Max Eigenvalue")
trace_gauge = _gauge("trace", "Trace")
tic_gauge = _gauge("tic", "TIC")
hyperparameter_gauge = _gauge("hyperparameters", "Hyperparameters")
performance_gauge = _gauge("performance", "Performance Plot")
mean_gsnr_gauge = _gauge("mean_gsnr", "Mean GSNR")
cabs_gauge = _gauge("cabs", "CABS")
early_stopping_gauge = _gauge("early_stopping", "Early stopping")


def histogram_2d_gauge(
    self: Any,
    fig: Any,
    gridspec: Any,
    transformation: Callable | None = None,
    marginals: bool = True,
    idx: int | None = None,
) -> Axes:
    """Gradient/Parameter Element Histogram (see ``plot_hist_2d``).

    Args:
        self: A CockpitPlotter with a loaded run.
        fig: The figure to draw in.
        gridspec: Where in ``fig`` (a SubplotSpec).
        transformation: Map applied to the bin counts for the colours (default
            ``log10(count + 1)``).
        marginals: Draw the marginal histograms.
        idx: Draw this parameter tensor's histogram (needs
            ``GradHist2d(..., keep_individual=True)``) instead of all of them.

    Returns:
        The new ``Axes``.
    """
    return _draw("hist_2d", self, fig, gridspec, transformation=transformation,
                 marginals=marginals, param=idx)  # fmt: skip
