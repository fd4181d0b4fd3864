"""Animations of dashboards saved during training (``build_animation``)."""

from __future__ import annotations

import glob
import os
import re


def _animation_frames(stem: str, screen: str) -> list[str]:
    """The frames of one screen for :meth:`CockpitPlotter.build_animation`."""
    tail = f"__{screen}__epoch__*.png"
    groups: dict[str, list[str]] = {}
    for pattern in (
        glob.escape(stem) + tail,
        os.path.join(glob.escape(stem), "*" + tail),
    ):
        for path in glob.glob(pattern):
            groups.setdefault(path.rsplit(f"__{screen}__epoch__", 1)[0], []).append(
                path
            )
    if not groups:
        raise FileNotFoundError(
            f"No frames for the {screen} screen: no {stem}{tail} and no "
            f"{os.path.join(stem, '<savename>' + tail)}. Fix: during training call "
            f"plotter.plot(..., save_plot=True, savename_append=f'__epoch__{{k}}') "
            "with k growing, then build the animation from the same log path."
        )
    if len(groups) > 1:
        raise ValueError(
            f"Frames of {len(groups)} runs match for the {screen} screen: "
            f"{sorted(groups)}. Fix: keep one run's frames (one savename) there."
        )
    (frames,) = groups.values()

    def order(path: str) -> tuple[float, str]:
        number = re.match(r"-?\d+(\.\d+)?", path.rsplit("__epoch__", 1)[1])
        return (float(number.group()) if number else float("inf"), path)

    return sorted(frames, key=order)


def write_gifs(
    stem: str, screens: list[str], duration: int = 200, loop: int = 0
) -> list[str]:
    """Stitch the saved frames of each screen into ``<stem>__<screen>.gif``.

    Args:
        stem: The log path without ``.json``.
        screens: ``"primary"`` and, if wanted, ``"secondary"``.
        duration: Time each frame is shown, in milliseconds.
        loop: How often the GIF repeats (0: forever).

    Returns:
        The GIFs written.

    Raises:
        FileNotFoundError: If a screen has no frames.
        ValueError: If frames of several runs (savenames) match.
    """
    from PIL import Image

    written = []
    for screen in screens:
        frames = _animation_frames(stem, screen)
        target = f"{stem}__{screen}.gif"
        images = [Image.open(frame) for frame in frames]
        try:
            images[0].save(target, format="GIF", save_all=True, loop=loop,
                           append_images=images[1:], duration=duration)  # fmt: skip
        finally:
            for image in images:
                image.close()
        written.append(target)
    return written
