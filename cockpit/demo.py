"""The demo run: a small network on scikit-learn's digits, tracked by cockpit.

scikit-learn ships the 8x8 digits data set, so nothing is downloaded. The run trains
with plain SGD, logs train/validation loss and accuracy via :meth:`Cockpit.log`,
writes the cockpit log and renders the dashboard to a PNG.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from cockpit.cockpit import Cockpit
from cockpit.engines.backpack.api import extend


@dataclass
class DemoResult:
    """What :func:`run_demo` produced.

    Attributes:
        cockpit: The cockpit of the run (its history holds everything tracked).
        logpath: Path of the written log.
        dashboard: Path of the dashboard PNG (``None`` if none was requested).
    """

    cockpit: Cockpit
    logpath: str
    dashboard: str | None = None


def load_digits_tensors(dtype=torch.float32):
    """Return the digits images (standardised, ``[1797, 64]``) and labels."""
    table = _digits_table()
    x = torch.as_tensor(table[:, :-1], dtype=dtype)
    x = (x - x.mean(0)) / (x.std(0) + 1e-6)
    y = torch.as_tensor(table[:, -1], dtype=torch.long)
    return x, y


def _digits_table():
    """scikit-learn's digits as one ``[1797, 65]`` array (pixels, then the label).

    Read from the file scikit-learn ships (``datasets/data/digits.csv.gz``, what
    ``load_digits`` reads) without importing scikit-learn, which takes seconds;
    ``load_digits`` itself where that file is not found.
    """
    spec = importlib.util.find_spec("sklearn")
    if spec is None:  # pragma: no cover - depends on the environment
        raise ImportError(
            "The demo needs scikit-learn for its data: pip install scikit-learn "
            "(or install cockpit with the 'demo' extra)."
        )
    for root in spec.submodule_search_locations or []:
        path = os.path.join(root, "datasets", "data", "digits.csv.gz")
        if os.path.isfile(path):
            return np.loadtxt(path, delimiter=",")
    from sklearn.datasets import load_digits  # pragma: no cover - another layout

    data = load_digits()  # pragma: no cover
    return np.column_stack([data.data, data.target])  # pragma: no cover


def make_demo_model(seed: int = 0) -> torch.nn.Module:
    """A 64-32-10 MLP with ReLU, extended for BackPACK."""
    torch.manual_seed(seed)
    return extend(
        torch.nn.Sequential(
            torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10)
        )
    )


def _split(x: torch.Tensor, y: torch.Tensor, seed: int):
    """Shuffle once and split into train (80 %) and validation (20 %)."""
    order = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(seed))
    cut = int(0.8 * x.shape[0])
    train, valid = order[:cut], order[cut:]
    return (x[train], y[train]), (x[valid], y[valid])


@torch.no_grad()
def _evaluate(model, loss_fn, x, y) -> tuple[float, float]:
    outputs = model(x)
    loss = float(loss_fn(outputs, y))
    accuracy = float((outputs.argmax(1) == y).float().mean())
    return loss, accuracy


def run_demo(
    quantities,
    logpath: str = "cockpit_demo/log",
    steps: int = 200,
    batch_size: int = 64,
    lr: float = 0.1,
    seed: int = 0,
    progress: bool = True,
    eval_every: int = 10,
    dashboard: str | None = None,
    secondary: str | None = None,
    live_every: int = 0,
) -> DemoResult:
    """Train the demo network with SGD, write the cockpit log and the dashboard.

    Args:
        quantities: The quantities to track.
        logpath: Log path without the ``.json`` suffix.
        steps: Number of training steps.
        batch_size: Mini-batch size.
        lr: SGD learning rate.
        seed: Seed for the model, the split and the batch order.
        progress: Show a tqdm progress bar with live loss, Alpha and gradient norm.
        eval_every: Evaluate train/validation loss and accuracy every this many
            steps (and at the last step) and hand them to :meth:`Cockpit.log`.
        dashboard: Where to save the dashboard PNG (``None``: no image).
        secondary: Where to save the secondary screen (``None``: not drawn).
        live_every: Update a live dashboard window every this many steps
            (0: no live window).

    Returns:
        The cockpit, the log path and the dashboard path.
    """
    from tqdm.auto import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    x, y = load_digits_tensors()
    (x_train, y_train), (x_valid, y_valid) = _split(x, y, seed)
    model = make_demo_model(seed)
    loss_fn = extend(torch.nn.CrossEntropyLoss())
    individual_loss_fn = torch.nn.CrossEntropyLoss(reduction="none")
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    cockpit = Cockpit(model.parameters(), quantities=quantities)
    generator = torch.Generator().manual_seed(seed)
    plotter = None
    if live_every > 0 or dashboard is not None or secondary is not None:
        from cockpit.plotting import CockpitPlotter

        plotter = CockpitPlotter(secondary_screen=secondary is not None)

    bar = tqdm(range(steps), desc="cockpit demo", disable=not progress)
    # cockpit's coverage line above the bar, not in it
    redirect = logging_redirect_tqdm([logging.getLogger("cockpit")], type(bar))
    with warnings.catch_warnings(), redirect:
        # Expected and harmless here: BackPACK's full backward hooks fire on the
        # first layer, whose input needs no gradient; and HessMaxEV's create_graph
        # backward (the cockpit detaches .grad afterwards, breaking the cycle).
        warnings.filterwarnings("ignore", "Full backward hook is firing")
        warnings.filterwarnings("ignore", r"Using backward\(\) with create_graph=True")
        for step in bar:
            index = torch.randint(
                0, x_train.shape[0], (batch_size,), generator=generator
            )
            inputs, targets = x_train[index], y_train[index]
            optimizer.zero_grad()
            outputs = model(inputs)
            loss = loss_fn(outputs, targets)
            losses = individual_loss_fn(outputs, targets)
            info = {
                "batch_size": batch_size,
                "individual_losses": losses,
                "loss": loss,
                "optimizer": optimizer,
            }
            with cockpit(step, info=info):
                loss.backward(create_graph=cockpit.create_graph(step))
            optimizer.step()
            if step % eval_every == 0 or step == steps - 1:
                train_loss, train_acc = _evaluate(model, loss_fn, x_train, y_train)
                valid_loss, valid_acc = _evaluate(model, loss_fn, x_valid, y_valid)
                epoch = step * batch_size // x_train.shape[0]
                cockpit.log(
                    step, epoch, train_loss, valid_loss, None, train_acc, valid_acc,
                    None, optimizer.param_groups[0]["lr"],
                )  # fmt: skip
            bar.set_postfix(_postfix(cockpit, step), refresh=False)
            if live_every > 0 and step % live_every == 0:
                plotter.plot(cockpit, show_plot=True)
    path = cockpit.write(logpath)
    result = DemoResult(cockpit, os.fspath(path))
    if dashboard is not None or secondary is not None:
        plotter.plot(cockpit, show_plot=live_every > 0)
        saved = plotter.save(dashboard, secondary)
        result.dashboard = saved[0] if dashboard is not None else None
    return result


def _postfix(cockpit: Cockpit, step: int) -> dict[str, str]:
    """Latest loss, Alpha (previous step), gradient norm and diagnosis for the bar."""
    history = cockpit.history
    postfix = {}
    current = history[step] if step in history else {}
    previous = history[step - 1] if step - 1 in history else {}
    if "Loss" in current:
        postfix["loss"] = f"{current['Loss']:.3f}"
    if "Alpha" in previous:
        postfix["alpha"] = f"{previous['Alpha']:+.2f}"
    if "GradNorm" in current:
        norm = sum(v * v for v in current["GradNorm"]) ** 0.5
        postfix["|g|"] = f"{norm:.3f}"
    if cockpit.diagnosis is not None:  # the live diagnosis: "ok" or the findings
        postfix["diagnosis"] = cockpit.diagnosis.postfix()
    return postfix
