"""Timelapse: the dashboard of a run as an animated GIF, frame by frame."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from cockpit.plotting.dashboard import CockpitPlotter, resolve_source
from cockpit.plotting.data import DashboardData
from cockpit.plotting.style import dashboard_style


def make_timelapse(
    source: Any,
    path: str | os.PathLike = "cockpit.gif",
    frames: int = 30,
    fps: float = 4.0,
    secondary_screen: bool = False,
    show_log_iter: bool = False,
    plot_title: str | None = None,
    figsize: tuple[float, float] = (16.0, 9.0),
    dpi: float = 60.0,
) -> str:
    """Write an animated GIF of the dashboard as the run progresses.

    Frame ``k`` shows the dashboard with the data up to the ``k``-th of ``frames``
    evenly spaced steps of the run (the last frame shows the whole run). The data
    is read once; each frame only redraws.

    Args:
        source: A :class:`~cockpit.Cockpit`, a :class:`~cockpit.history.History`,
            or a log path (ours or cockpit-for-pytorch 1.0.2's).
        path: Output file (``.gif``); parent folders are created.
        frames: Number of frames (fewer if the run has fewer steps).
        fps: Frames per second.
        secondary_screen: Animate the secondary screen instead of the primary.
        show_log_iter: Symmetric-log iteration axes.
        plot_title: Title of every frame (default: as :meth:`CockpitPlotter.plot`).
        figsize: Figure size in inches.
        dpi: Resolution (60 gives 960x540 pixels for the default size).

    Returns:
        The path written.

    Raises:
        ValueError: If the run has no steps or ``frames`` is not positive.
    """
    from matplotlib.animation import PillowWriter

    if frames < 1:
        raise ValueError(f"frames must be positive, got {frames}.")
    history, default_title, _ = resolve_source(source)
    steps = history.steps
    if not steps:
        raise ValueError("The run has no recorded steps: nothing to animate.")
    positions = np.unique(np.linspace(0, len(steps) - 1, frames).round().astype(int))
    cuts = [steps[i] for i in positions]

    plotter = CockpitPlotter(
        secondary_screen=secondary_screen, figsize=figsize, dpi=dpi
    )
    title = plot_title or default_title
    data = DashboardData(history)
    data.refresh()
    path = os.fspath(path)
    parent = os.path.dirname(path)
    if parent:
        os.makedirs(parent, exist_ok=True)
    writer = PillowWriter(fps=fps)
    with dashboard_style():
        plotter._ensure_figures(managed=False)
        fig = plotter.fig_secondary if secondary_screen else plotter.fig
        with writer.saving(fig, path, dpi):
            for cut in cuts:
                plotter.draw(data, title, show_log_iter=show_log_iter, upto=cut)
                writer.grab_frame()
    return path
