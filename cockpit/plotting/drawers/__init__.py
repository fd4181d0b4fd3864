"""The drawing routines of the gauges, one per kind, for one run or several.

Each routine takes ``(ax, runs, gauge, keys, options)`` (see
:data:`cockpit.plotting.instruments.DRAWERS`) and returns the indices of the runs
it drew (empty: nothing to draw). ``runs`` holds one
:class:`~cockpit.plotting.runs.Run` without a colour (the classic look: points
coloured by iteration, a dark trend line) or several with a colour each: then every
artist drawn for run ``k`` has the gid ``cockpit-run-k`` and the legend names the
runs. ``options`` holds the gauge's options plus ``upto`` and ``show_log_iter``.

Legends never cover data: a legend sits at the top of its axes, and
:class:`~cockpit.plotting.drawers.common.Headroom` keeps that much of the axes free
of data each time the figure is drawn (the data are squeezed into the rest,
whatever the figure's size).

The modules: :mod:`~.common` (extra axes, legends, shared marks),
:mod:`~.series` (series, Alpha, gradient tests), :mod:`~.histograms`,
:mod:`~.training` (learning rates, loss and accuracy) and :mod:`~.findings`
(the Diagnosis panel).
"""

from cockpit.plotting.drawers.common import (
    ESTIMATE_BAND_GID,
    ESTIMATE_SPAN,
    MAX_HEADROOM,
    Drawn,
    Headroom,
    clear_gauge,
    extra_axes,
    legend_on_top,
    nonfinite_spans,
)
from cockpit.plotting.drawers.findings import (
    PANEL_LINES,
    SEVERITY_COLORS,
    FittedText,
    diagnosis_findings,
    draw_findings,
    fitted_caption,
)
from cockpit.plotting.drawers.histograms import draw_hist_1d, draw_hist_2d
from cockpit.plotting.drawers.series import draw_alpha, draw_series, draw_tests
from cockpit.plotting.drawers.training import (
    draw_learning_rates,
    draw_performance,
    element_series,
)

__all__ = [
    "Drawn",
    "ESTIMATE_BAND_GID",
    "ESTIMATE_SPAN",
    "FittedText",
    "Headroom",
    "MAX_HEADROOM",
    "PANEL_LINES",
    "SEVERITY_COLORS",
    "clear_gauge",
    "diagnosis_findings",
    "draw_alpha",
    "draw_findings",
    "draw_hist_1d",
    "draw_hist_2d",
    "draw_learning_rates",
    "draw_performance",
    "draw_series",
    "draw_tests",
    "element_series",
    "extra_axes",
    "fitted_caption",
    "legend_on_top",
    "nonfinite_spans",
]
