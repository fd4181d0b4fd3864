"""Quick start: track a training run with cockpit and look at its dashboard.

A small MLP learns to classify synthetic data (labels from a random "teacher"
network). Four changes to an ordinary PyTorch loop:

1. ``extend`` the model and the (mean-reduced) loss with BackPACK;
2. create a ``Cockpit`` with the quantities to track (here the ``economy`` set);
3. run ``loss.backward()`` inside ``with cockpit(step, info=...)``;
4. draw the dashboard with ``CockpitPlotter`` -- during training (``--live``) or
   at the end, from the cockpit or from the written log.

Run: ``python examples/quickstart.py [--steps 150] [--out quickstart_output]``;
``--live`` shows the dashboard in a window while training (on a GUI backend).
Writes ``<out>/log.json`` and ``<out>/dashboard.png``.
"""

from __future__ import annotations

import argparse
import os
import warnings

import torch
from backpack import extend
from tqdm import tqdm

from cockpit import Cockpit, CockpitPlotter
from cockpit.utils.configuration import configuration


def make_data(n: int = 2048, dim: int = 20, classes: int = 5, seed: int = 0):
    """Inputs ``x ~ N(0, I)`` and labels of a random teacher network."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=generator)
    teacher = torch.randn(dim, classes, generator=generator)
    y = torch.tanh(x @ teacher) + 0.3 * torch.randn(n, classes, generator=generator)
    return x, y.argmax(1)


def main(
    steps: int = 150, out: str = "quickstart_output", live: bool = False, seed: int = 0
) -> dict[str, str]:
    """Train, track, and save the log and the dashboard.

    Args:
        steps: Training steps (a test runs a handful).
        out: Output folder.
        live: Update a dashboard window every 25 steps while training.
        seed: Random seed.

    Returns:
        Paths of the written log and dashboard.
    """
    torch.manual_seed(seed)
    x, y = make_data(seed=seed)
    model = extend(
        torch.nn.Sequential(
            torch.nn.Linear(20, 32), torch.nn.ReLU(), torch.nn.Linear(32, 5)
        )
    )
    loss_fn = extend(torch.nn.CrossEntropyLoss())  # reduction="mean"
    individual_loss_fn = torch.nn.CrossEntropyLoss(reduction="none")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2)

    cockpit = Cockpit(model.parameters(), quantities=configuration("economy"))
    plotter = CockpitPlotter()
    batch_size = 64
    generator = torch.Generator().manual_seed(seed)

    # a progress bar on a terminal (disable=None), none in a log file or a test
    for step in tqdm(range(steps), desc="quickstart", unit="step", disable=None):
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

        if step % 10 == 0 or step == steps - 1:  # what you would watch anyway
            with torch.no_grad():
                full = model(x)
                accuracy = (full.argmax(1) == y).float().mean().item()
                train_loss = loss_fn(full, y).item()
            cockpit.log(step, 0, train_loss, None, None, accuracy, None, None, 0.2)
        if live and step % 25 == 0:
            plotter.plot(cockpit)  # non-blocking; later calls update the window

    logpath = cockpit.write(os.path.join(out, "log"))
    plotter.plot(logpath, show_plot=live, plot_title="Quick start: SGD on a teacher")
    (dashboard,) = plotter.save(os.path.join(out, "dashboard.png"))
    return {"log": logpath, "dashboard": dashboard}


if __name__ == "__main__":
    # PyTorch warns when BackPACK's hook fires on the first layer, whose input needs
    # no gradient; that is expected and harmless.
    warnings.filterwarnings("ignore", "Full backward hook is firing")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--out", default="quickstart_output")
    parser.add_argument("--live", action="store_true")
    args = parser.parse_args()
    for name, path in main(args.steps, args.out, args.live).items():
        print(f"{name}: {path}")
