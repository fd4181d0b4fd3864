"""Vanishing gradients: per-layer 2-D histograms of a sigmoid network.

Two six-layer MLPs on scikit-learn's digits, identical except for the activation
(ReLU vs sigmoid), both with He-initialised weights, are looked at in their first
step with ``GradHist2d(..., keep_individual=True)``: a joint histogram of individual
gradient elements (y-axis) and parameter values (x-axis), for the whole network
and for every weight matrix.

The sigmoid's derivative is at most 1/4, so the gradient shrinks on its way back:
in the sigmoid network the first layers' gradient mass sits in the bins at zero
(vanishing gradients), while every layer of the ReLU network shows a similar
spread (its extra mass exactly at zero comes from inactive units).

Run: ``python examples/vanishing_gradients.py [--out vanishing_gradients.png]``.
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
from cockpit.demo import load_digits_tensors
from cockpit.history import History
from cockpit.plotting import dashboard_style, instruments
from cockpit.quantities import GradHist2d
from cockpit.utils.schedules import linear

#: Ranges of the histograms: (individual gradient elements, parameter values).
RANGES = ((-0.1, 0.1), (-0.75, 0.75))
DEPTH = 6  # linear layers


def make_model(activation: type[torch.nn.Module], seed: int = 0) -> torch.nn.Module:
    """64 -> 32 (x5) -> 10 MLP with He-initialised weights and zero biases."""
    torch.manual_seed(seed)
    widths = [64] + [32] * (DEPTH - 1) + [10]
    layers: list[torch.nn.Module] = []
    for i, (fan_in, fan_out) in enumerate(zip(widths[:-1], widths[1:])):
        linear_layer = torch.nn.Linear(fan_in, fan_out)
        torch.nn.init.kaiming_normal_(linear_layer.weight, nonlinearity="relu")
        torch.nn.init.zeros_(linear_layer.bias)
        layers.append(linear_layer)
        if i < DEPTH - 1:
            layers.append(activation())
    return extend(torch.nn.Sequential(*layers))


def track(activation: type[torch.nn.Module], steps: int = 1) -> History:
    """Run ``steps`` SGD steps and track per-layer 2-D histograms."""
    x, y = load_digits_tensors()
    model = make_model(activation)
    loss_fn = extend(torch.nn.CrossEntropyLoss())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    histogram = GradHist2d(linear(1), range=RANGES, keep_individual=True)
    cockpit = Cockpit(model.parameters(), [histogram])
    generator = torch.Generator().manual_seed(0)
    for step in range(steps):
        index = torch.randint(0, len(x), (64,), generator=generator)
        optimizer.zero_grad()
        loss = loss_fn(model(x[index]), y[index])
        with cockpit(step, info={"batch_size": 64, "loss": loss}):
            loss.backward()
        optimizer.step()
    return cockpit.history


def gradient_rms(history: History, param: int) -> float:
    """Root mean square of a parameter's individual gradient elements.

    Read off its histogram (bin centres, values clipped to the range), so it
    cannot resolve less than half a bin width.
    """
    entry = history[history.steps[-1]]["GradHist2d"][f"param_{param}"]
    counts = np.asarray(entry["hist"]).sum(axis=1)  # over the parameter axis
    edges = np.asarray(entry["edges"][0])
    centers = (edges[:-1] + edges[1:]) / 2
    return float(np.sqrt(np.sum(counts * centers**2) / np.sum(counts)))


def main(
    steps: int = 1, out: str = "vanishing_gradients.png"
) -> dict[str, list[float]]:
    """Track both networks and save the per-layer comparison.

    Args:
        steps: Tracked steps; the histograms of the last one are shown (1: at
            initialisation).
        out: Path of the PNG.

    Returns:
        Per network, the root mean square of each weight matrix's individual
        gradient elements (:func:`gradient_rms`), first layer first.
    """
    runs = {"ReLU": torch.nn.ReLU, "sigmoid": torch.nn.Sigmoid}
    with warnings.catch_warnings():  # BackPACK's hook on the input layer is harmless
        warnings.filterwarnings("ignore", "Full backward hook is firing")
        histories = {name: track(act, steps) for name, act in runs.items()}
    weights = [2 * layer for layer in range(DEPTH)]  # parameters: weight, bias, ...
    spreads = {
        name: [gradient_rms(history, k) for k in weights]
        for name, history in histories.items()
    }
    with dashboard_style():
        fig = Figure(figsize=(18, 6.5), layout="constrained")
        rows = fig.subfigures(len(runs), 1)
        for row, (name, history) in zip(rows, histories.items()):
            row.suptitle(f"{name} network", fontweight="bold")
            axes = row.subplots(1, DEPTH + 1)
            instruments.plot_hist_2d(axes[0], history, marginals=False)
            axes[0].set_title("all parameters")
            for ax, param, rms in zip(axes[1:], weights, spreads[name]):
                instruments.plot_hist_2d(ax, history, param=param, marginals=False)
                ax.set_title(f"layer {param // 2 + 1} weights, RMS {rms:.3f}")
        fig.suptitle(
            "Vanishing gradients: the per-layer histograms show where the sigmoid "
            "network's gradient disappears"
        )
        parent = os.path.dirname(out)
        if parent:
            os.makedirs(parent, exist_ok=True)
        fig.savefig(out, dpi=80)
    return spreads


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--out", default="vanishing_gradients.png")
    args = parser.parse_args()
    for name, values in main(args.steps, args.out).items():
        listed = ", ".join(f"{v:.3f}" for v in values)
        print(f"{name}: RMS of individual gradient elements per layer: {listed}")
    print(f"figure: {args.out}")
