"""Loss is not enough: two learning-rate schedules, alike in loss, opposite in alpha.

A noisy two-dimensional quadratic (linear least squares with anisotropic inputs,
Hessian ``diag(2, 0.2)``) is trained with SGD twice:

* a constant learning rate of 0.9, close to the stability limit ``2 / 2 = 1`` of the
  steep direction: the iterate zig-zags across the valley;
* a decaying schedule ``0.45 * 0.95**t``: every step stops short.

For the first steps the two loss curves are almost on top of each other, and later
both look flat. The Alpha gauge tells them apart at once: the constant rate lands
near ``alpha = +1`` (each step jumps to the opposite wall of the valley), the
decaying one near ``alpha = -1`` (steps far shorter than the distance to the 1-D
minimum).

Run: ``python examples/loss_is_not_enough.py [--steps 40] [--out FILE.png]``.
"""

from __future__ import annotations

import argparse
import os
import warnings
from typing import Callable

import numpy as np
import torch
from backpack import extend
from matplotlib.figure import Figure

from cockpit import Cockpit
from cockpit.history import History
from cockpit.plotting import dashboard_style, instruments
from cockpit.plotting.style import COLORS
from cockpit.quantities import Alpha, Loss
from cockpit.utils.schedules import linear

#: Variances of the two input coordinates; the Hessian of the mean squared error is
#: ``2 * diag(SCALES)``.
SCALES = (1.0, 0.1)
SCHEDULES: dict[str, Callable[[int], float]] = {
    "constant lr 0.9": lambda step: 0.9,
    "decaying lr 0.45 * 0.95^t": lambda step: 0.45 * 0.95**step,
}


def train(schedule: Callable[[int], float], steps: int, seed: int = 0) -> History:
    """SGD on the noisy quadratic; returns the history (Alpha and Loss)."""
    generator = torch.Generator().manual_seed(seed)
    model = extend(torch.nn.Linear(2, 1, bias=False))
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[3.0, 3.0]]))
    target = torch.tensor([1.0, -1.0])
    loss_fn = extend(torch.nn.MSELoss())
    optimizer = torch.optim.SGD(model.parameters(), lr=schedule(0))
    cockpit = Cockpit(model.parameters(), [Alpha(linear(1)), Loss(linear(1))])
    std = torch.tensor(SCALES).sqrt()
    batch_size = 64
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = schedule(step)
        x = torch.randn(batch_size, 2, generator=generator) * std
        noise = 0.02 * torch.randn(batch_size, generator=generator)
        y = (x @ target + noise).unsqueeze(1)
        optimizer.zero_grad()
        outputs = model(x)
        loss = loss_fn(outputs, y)
        info = {
            "batch_size": batch_size,
            "individual_losses": ((outputs - y) ** 2).squeeze(1),
            "loss": loss,
            "optimizer": optimizer,
        }
        with cockpit(step, info=info):
            loss.backward()
        optimizer.step()
    return cockpit.history


def main(steps: int = 40, out: str = "loss_is_not_enough.png") -> dict[str, float]:
    """Train with both schedules and save the comparison figure.

    Args:
        steps: Training steps per run (a test runs a handful).
        out: Path of the PNG.

    Returns:
        The mean alpha of each run, by schedule name.
    """
    with warnings.catch_warnings():  # BackPACK's hook on the input layer is harmless
        warnings.filterwarnings("ignore", "Full backward hook is firing")
        histories = {name: train(s, steps) for name, s in SCHEDULES.items()}
    with dashboard_style():
        fig = Figure(figsize=(11, 7), layout="constrained")
        grid = fig.add_gridspec(2, 2, height_ratios=[1.0, 1.1])
        loss_ax = fig.add_subplot(grid[0, :])
        for (name, history), color in zip(
            histories.items(), (COLORS["orange"], COLORS["blue"])
        ):
            steps_, losses = history.series("Loss")
            loss_ax.plot(steps_, losses, color=color, marker=".", label=name)
        loss_ax.set_title("Mini-batch loss: hard to tell apart")
        loss_ax.set_xlabel("iteration")
        loss_ax.set_ylabel("loss")
        loss_ax.legend()
        for column, (name, history) in enumerate(histories.items()):
            ax = fig.add_subplot(grid[1, column])
            instruments.plot_alpha(ax, history)
            ax.title.set_text(f"Alpha: {name}")  # keeps the room for the caption
        fig.suptitle("Loss is not enough: the Alpha gauge separates the two runs")
        parent = os.path.dirname(out)
        if parent:
            os.makedirs(parent, exist_ok=True)
        fig.savefig(out, dpi=90)
    return {
        name: float(np.mean(history.series("Alpha")[1]))
        for name, history in histories.items()
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--out", default="loss_is_not_enough.png")
    args = parser.parse_args()
    for name, alpha in main(args.steps, args.out).items():
        print(f"{name}: mean alpha {alpha:+.2f}")
    print(f"figure: {args.out}")
