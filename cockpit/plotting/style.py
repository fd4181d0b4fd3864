"""Look of the dashboard: colours, fonts, number formats, the "no data" note.

Everything style-related is applied through :func:`dashboard_style`, a
``matplotlib.rc_context``: the user's ``rcParams`` are restored when it exits.
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator

import matplotlib
from matplotlib.axes import Axes
from matplotlib.ticker import FuncFormatter, MaxNLocator

#: Line and marker colours (blue, orange, green as in cockpit-for-pytorch, plus
#: gray for secondary information and a dark tone for moving averages).
COLORS = {
    "blue": "#2f6db3",
    "orange": "#e07b26",
    "green": "#3a9a4a",
    "red": "#c4393b",
    "purple": "#7b5ab6",
    "gray": "#8c8c8c",
    "dark": "#333333",
}

#: Background tints of the dashboard's panels.
PANEL_COLORS = {
    "step size": "#e6eef8",
    "gradients": "#fbeee2",
    "curvature": "#e6f3e8",
    "bottom": "#ececec",
    "auxiliary": "#efe9f6",
    "layerwise": "#ececec",
}

#: Colour map for points coloured by iteration.
ITERATION_CMAP = "viridis"

#: Colour map for 2-D histograms.
HISTOGRAM_CMAP = "magma_r"

#: The rc settings of the dashboard (only used inside :func:`dashboard_style`).
STYLE_RC = {
    "font.size": 8,
    "axes.titlesize": 9,
    "axes.titleweight": "bold",
    "axes.titlepad": 4,
    "axes.labelsize": 8,
    "axes.labelpad": 2,
    "axes.facecolor": "#fcfcfc",
    "axes.edgecolor": "#a0a0a0",
    "axes.linewidth": 0.8,
    "axes.grid": True,
    "axes.axisbelow": True,
    "grid.color": "#e2e2e2",
    "grid.linewidth": 0.6,
    "xtick.labelsize": 7,
    "ytick.labelsize": 7,
    "xtick.color": "#555555",
    "ytick.color": "#555555",
    "xtick.major.size": 2.5,
    "ytick.major.size": 2.5,
    "xtick.minor.size": 1.5,
    "ytick.minor.size": 1.5,
    "legend.fontsize": 6.5,
    "legend.frameon": True,
    "legend.framealpha": 0.85,
    "legend.edgecolor": "#d0d0d0",
    "legend.borderpad": 0.3,
    "legend.handlelength": 1.2,
    "legend.labelspacing": 0.25,
    "lines.linewidth": 1.3,
    "figure.facecolor": "white",
    "figure.titlesize": 13,
    "figure.titleweight": "bold",
    "savefig.facecolor": "white",
    "image.cmap": ITERATION_CMAP,
}


@contextlib.contextmanager
def dashboard_style() -> Iterator[None]:
    """Apply :data:`STYLE_RC` inside the block and restore all rcParams after it."""
    with matplotlib.rc_context(STYLE_RC):
        yield


def format_number(x: float, _pos: int | None = None) -> str:
    """Short tick label: three significant digits, ``k``/``M`` or an exponent.

    SI suffixes for thousands and millions, scientific notation beyond (and for
    tiny numbers), never both: ``2.4e19``, not ``2.4e+13M``.

    Args:
        x: The number.
        _pos: Tick position (ignored; matplotlib's formatter signature).

    Returns:
        E.g. ``"0"``, ``"0.25"``, ``"2500"``, ``"15k"``, ``"2M"``, ``"3e-5"``,
        ``"1.9e19"``.
    """
    if x == 0 or not math.isfinite(x):
        return "0" if x == 0 else str(x)
    magnitude = abs(x)
    for scale, suffix in ((1e6, "M"), (1e4, "k")):
        if magnitude >= scale:
            text = f"{x / (1e3 if suffix == 'k' else scale):.3g}"
            if "e" in text or abs(float(text)) >= 1000:
                break  # too large for the suffix: an exponent instead
            return text + suffix
    else:
        if magnitude >= 1e3:
            return f"{x:.0f}"
        if magnitude >= 1e-3:
            return f"{x:.3g}"
    mantissa, exponent = f"{x:.1e}".split("e")
    mantissa = mantissa.rstrip("0").rstrip(".")
    return f"{mantissa}e{int(exponent)}"


#: Tick formatter using :func:`format_number`.
NUMBER_FORMATTER = FuncFormatter(format_number)


def style_iteration_axis(ax: Axes, show_log_iter: bool = False) -> None:
    """Label the x-axis as iterations with integer, compact ticks.

    Args:
        ax: The axes.
        show_log_iter: Use a symmetric-log x-axis (many steps early on).
    """
    if show_log_iter:
        ax.set_xscale("symlog", linthresh=1)
    else:
        ax.xaxis.set_major_locator(MaxNLocator(nbins=5, integer=True))
        ax.xaxis.set_major_formatter(NUMBER_FORMATTER)
    ax.set_xlabel("iteration")


def style_value_axis(ax: Axes, axis: str = "y", nbins: int = 5) -> None:
    """Give a linear value axis compact tick labels (no offset text)."""
    target = ax.yaxis if axis == "y" else ax.xaxis
    target.set_major_locator(MaxNLocator(nbins=nbins))
    target.set_major_formatter(NUMBER_FORMATTER)


def no_data(ax: Axes, title: str, hint: str) -> Axes:
    """Draw an empty gauge that says why it is empty.

    Args:
        ax: The axes.
        title: The gauge's title (kept, so the layout stays recognisable).
        hint: What to track to fill the gauge, e.g. ``"track GradNorm"``.

    Returns:
        ``ax``.
    """
    ax.set_title(title)
    ax.set_xticks([])
    ax.set_yticks([])
    ax.grid(False)
    ax.set_facecolor("#f4f4f4")
    ax.text(
        0.5,
        0.5,
        f"no data\n{hint}",
        ha="center",
        va="center",
        color=COLORS["gray"],
        fontsize=8,
        transform=ax.transAxes,
    )
    ax._cockpit_no_data = True  # read by tests and by the plotter's debug mode
    return ax
