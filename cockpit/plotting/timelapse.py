"""Timelapse: the dashboard of a run as an animated GIF, frame by frame."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from cockpit.plotting.dashboard import CockpitPlotter
from cockpit.plotting.style import dashboard_style


def make_timelapse(
    source: Any,
    path: str | os.PathLike = "cockpit.gif",
    frames: int = 30,
    fps: float = 4.0,
    secondary_screen: bool = False,
    show_log_iter: bool = False,
    plot_title: str | None = None,
    figsize: tuple[float, float] = (12.8, 7.2),
    dpi: float = 100.0,
    progress: bool | None = None,
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
        dpi: Resolution. The default frame, 12.8 x 7.2 inches at 100 dpi, is
            1280x720 pixels with text of 11 pixels and more (the 16 x 9 inch
            dashboard scaled down to 960x540 had text of 6-7 pixels, unreadable).
        progress: Show a progress bar of the frames on stderr (``None``: only
            where stderr is a terminal; each frame redraws the whole dashboard).

    Returns:
        The path written.

    Raises:
        LogFileError: If a log cannot be read or has no tracked steps.
        ValueError: If another source has no tracked steps, or ``frames`` is not
            positive.
    """
    from matplotlib.animation import PillowWriter
    from tqdm.auto import tqdm

    if frames < 1:
        raise ValueError(f"frames must be positive, got {frames}.")
    plotter = CockpitPlotter(
        secondary_screen=secondary_screen, figsize=figsize, dpi=dpi
    )
    plotter.load(source, plot_title=plot_title)
    plotter.show_log_iter = show_log_iter
    steps = plotter.data.history.steps
    positions = np.unique(np.linspace(0, len(steps) - 1, frames).round().astype(int))
    path = os.fspath(path)
    parent = os.path.dirname(path)
    if parent:
        os.makedirs(parent, exist_ok=True)
    writer = PillowWriter(fps=fps)
    first = plotter.draw(upto=steps[positions[0]])
    fig = first[1] if secondary_screen else first[0]
    bar = tqdm(
        positions,
        desc="cockpit timelapse",
        unit="frame",
        disable=None if progress is None else not progress,
    )
    with dashboard_style(), writer.saving(fig, path, dpi), bar:
        for index in bar:
            plotter.draw(upto=steps[index])
            writer.grab_frame()
    return path
