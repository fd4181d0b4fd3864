"""A small ResNet with GroupNorm on scikit-learn's digits, tracked by cockpit.

Residual connections live in ``forward()`` code and BackPACK has no GroupNorm rule:
cockpit computes every per-sample gradient in BackPACK's backward pass (GroupNorm's
with a rule of its own, from the layer's input and output gradient) and estimates
the Hessian trace with Hutchinson's method (BackPACK's exact diagonal needs an
``nn.Sequential`` of layers it knows). ``coverage()`` says who computed what.
ReLUs are not in-place: an in-place activation on the output of an ``extend``-ed
layer fails in the forward pass (see ``docs/any_model.md``).

Run: ``python examples/resnet_digits.py [--steps 150] [--out resnet_digits_output]``.
Writes ``<out>/log.json`` and ``<out>/dashboard.png``; prints the coverage report.
"""

from __future__ import annotations

import argparse
import os
import warnings

import torch
from backpack import extend

from cockpit import Cockpit, CockpitPlotter
from cockpit import quantities as Q
from cockpit.utils.configuration import configuration
from cockpit.utils.schedules import linear


class Block(torch.nn.Module):
    """``relu(x + GN(conv(relu(GN(conv(x))))))``."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.norm1 = torch.nn.GroupNorm(4, channels)
        self.conv2 = torch.nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.norm2 = torch.nn.GroupNorm(4, channels)

    def forward(self, x):
        h = torch.relu(self.norm1(self.conv1(x)))
        return torch.relu(x + self.norm2(self.conv2(h)))


class ResNet(torch.nn.Module):
    """A stem convolution, two residual blocks, global pooling and a classifier."""

    def __init__(self, channels: int = 16, classes: int = 10):
        super().__init__()
        self.stem = torch.nn.Conv2d(1, channels, 3, padding=1)
        self.blocks = torch.nn.Sequential(Block(channels), Block(channels))
        self.head = torch.nn.Linear(channels, classes)

    def forward(self, x):
        h = self.blocks(torch.relu(self.stem(x)))
        return self.head(h.mean(dim=(2, 3)))


def load_digits():
    """The 8x8 digit images of scikit-learn, scaled to [0, 1], and their labels."""
    from sklearn.datasets import load_digits as sklearn_digits

    digits = sklearn_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16
    return x, torch.tensor(digits.target)


def main(
    steps: int = 150, out: str = "resnet_digits_output", seed: int = 0
) -> dict[str, str]:
    """Train the ResNet, track it, save the log and the dashboard.

    Args:
        steps: Training steps (a test runs a handful).
        out: Output folder.
        seed: Random seed.

    Returns:
        Paths of the log and the dashboard, and the coverage summary.
    """
    torch.manual_seed(seed)
    x, y = load_digits()
    model = extend(ResNet())
    loss_fn = extend(torch.nn.CrossEntropyLoss())
    individual_loss_fn = torch.nn.CrossEntropyLoss(reduction="none")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    quantities = configuration("economy") + [Q.HessTrace(linear(10))]
    cockpit = Cockpit(model.named_parameters(), quantities=quantities)
    generator = torch.Generator().manual_seed(seed)
    batch_size = 32

    for step in range(steps):
        index = torch.randint(0, len(x), (batch_size,), generator=generator)
        inputs, labels = x[index], y[index]
        optimizer.zero_grad()
        outputs = model(inputs)
        loss = loss_fn(outputs, labels)
        losses = individual_loss_fn(outputs, labels)
        info = {
            "batch_size": batch_size,
            "individual_losses": losses,
            "loss": loss,
            "optimizer": optimizer,
        }
        with cockpit(step, info=info):
            loss.backward(create_graph=cockpit.create_graph(step))
        optimizer.step()
        if step % 10 == 0 or step == steps - 1:
            with torch.no_grad():
                accuracy = (model(x).argmax(1) == y).float().mean().item()
            cockpit.log(step, 0, loss.item(), None, None, accuracy, None, None, 0.1)

    logpath = cockpit.write(os.path.join(out, "log"))
    plotter = CockpitPlotter()
    plotter.plot(logpath, show_plot=False, plot_title="ResNet (GroupNorm) on digits")
    (dashboard,) = plotter.save(os.path.join(out, "dashboard.png"))
    return {
        "log": logpath,
        "dashboard": dashboard,
        "coverage": cockpit.coverage().summary(),
    }


if __name__ == "__main__":
    warnings.filterwarnings("ignore", "Full backward hook is firing")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--out", default="resnet_digits_output")
    args = parser.parse_args()
    for name, value in main(args.steps, args.out).items():
        print(f"{name}: {value}")
