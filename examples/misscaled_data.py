"""Mis-scaled input data: the gradient histogram shows what the images hide.

The same small CNN, from the same initialisation, sees scikit-learn's 8x8 digits
twice: once with pixel values scaled to ``[0, 1]``, once with raw ``[0, 255]``
values (a forgotten normalisation). Plotted with ``imshow`` the two inputs look
identical. The gradient element histogram at initialisation (individual gradients
of all samples and weights, clipped to ``[-2, 2]``) does not: with raw data the
individual gradients are far larger and about a tenth of them pile up in the two
edge bins.

Run: ``python examples/misscaled_data.py [--steps 1] [--out misscaled_data.png]``
(``--steps`` > 1 trains a few SGD steps first and shows the last histogram).
"""

from __future__ import annotations

import argparse
import os
import warnings

import numpy as np
import torch
from backpack import extend
from matplotlib.figure import Figure

from cockpit import Cockpit
from cockpit.history import History
from cockpit.plotting import dashboard_style, instruments
from cockpit.quantities import GradHist1d
from cockpit.utils.schedules import linear


def load_images(scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Digits as ``[N, 1, 8, 8]`` images with pixel values in ``[0, scale]``."""
    from sklearn.datasets import load_digits

    data = load_digits()
    images = torch.as_tensor(data.images, dtype=torch.float32) / 16.0 * scale
    return images.unsqueeze(1), torch.as_tensor(data.target)


def make_model(seed: int = 0) -> torch.nn.Module:
    """A small CNN (conv 3x3, ReLU, linear), extended for BackPACK."""
    torch.manual_seed(seed)
    return extend(
        torch.nn.Sequential(
            torch.nn.Conv2d(1, 8, kernel_size=3),
            torch.nn.ReLU(),
            torch.nn.Flatten(),
            torch.nn.Linear(8 * 6 * 6, 10),
        )
    )


def track(scale: float, steps: int, seed: int = 0) -> History:
    """Train a few SGD steps from the same initialisation; track GradHist1d."""
    x, y = load_images(scale)
    model = make_model(seed)
    loss_fn = extend(torch.nn.CrossEntropyLoss())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    cockpit = Cockpit(model.parameters(), [GradHist1d(linear(1))])
    generator = torch.Generator().manual_seed(seed)
    for step in range(steps):
        index = torch.randint(0, len(x), (32,), generator=generator)
        optimizer.zero_grad()
        loss = loss_fn(model(x[index]), y[index])
        with cockpit(step, info={"batch_size": 32, "loss": loss}):
            loss.backward()
        optimizer.step()
    return cockpit.history


def edge_fraction(history: History) -> float:
    """Fraction of gradient elements in the two edge bins of the last histogram."""
    counts = np.asarray(history[history.steps[-1]]["GradHist1d"]["hist"])
    return float((counts[0] + counts[-1]) / counts.sum())


def main(steps: int = 1, out: str = "misscaled_data.png") -> dict[str, float]:
    """Track both scalings and save the comparison figure.

    Args:
        steps: Tracked steps per run; the histogram of the last one is shown
            (1: at initialisation).
        out: Path of the PNG.

    Returns:
        The fraction of gradient elements in the edge bins, per scaling.
    """
    runs = {"inputs in [0, 1]": 1.0, "inputs in [0, 255]": 255.0}
    with warnings.catch_warnings():  # BackPACK's hook on the input layer is harmless
        warnings.filterwarnings("ignore", "Full backward hook is firing")
        histories = {name: track(scale, steps) for name, scale in runs.items()}
    with dashboard_style():
        fig = Figure(figsize=(10, 6.5), layout="constrained")
        grid = fig.add_gridspec(2, 2, height_ratios=[1.0, 1.6])
        for column, (name, scale) in enumerate(runs.items()):
            image_ax = fig.add_subplot(grid[0, column])
            image = image_ax.imshow(load_images(scale)[0][0, 0].numpy(), cmap="gray_r")
            fig.colorbar(image, ax=image_ax, shrink=0.8)
            image_ax.set_title(f"A training image, {name}")
            image_ax.set_axis_off()
            ax = fig.add_subplot(grid[1, column])
            instruments.plot_hist_1d(ax, histories[name])
            share = edge_fraction(histories[name])
            ax.set_title(f"Gradient elements, {name}: {share:.1%} in the edge bins")
        fig.suptitle("Mis-scaled data: identical pictures, very different gradients")
        parent = os.path.dirname(out)
        if parent:
            os.makedirs(parent, exist_ok=True)
        fig.savefig(out, dpi=90)
    return {name: edge_fraction(history) for name, history in histories.items()}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--out", default="misscaled_data.png")
    args = parser.parse_args()
    for name, share in main(args.steps, args.out).items():
        print(f"{name}: {share:.1%} of gradient elements in the edge bins")
    print(f"figure: {args.out}")
