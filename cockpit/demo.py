"""The demo run: a small network on scikit-learn's digits, tracked by cockpit.

scikit-learn ships the 8x8 digits data set, so nothing is downloaded.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from backpack import extend

from cockpit.cockpit import Cockpit


@dataclass
class DemoResult:
    """What :func:`run_demo` produced."""

    cockpit: Cockpit
    logpath: str


def load_digits_tensors(dtype=torch.float32):
    """Return the digits images (standardised, ``[1797, 64]``) and labels."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise ImportError(
            "The demo needs scikit-learn for its data: pip install scikit-learn "
            "(or install cockpit with the 'demo' extra)."
        ) from error
    data = load_digits()
    x = torch.as_tensor(data.data, dtype=dtype)
    x = (x - x.mean(0)) / (x.std(0) + 1e-6)
    y = torch.as_tensor(data.target, dtype=torch.long)
    return x, y


def make_demo_model(seed: int = 0) -> torch.nn.Module:
    """A 64-32-10 MLP with ReLU, extended for BackPACK."""
    torch.manual_seed(seed)
    return extend(
        torch.nn.Sequential(
            torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10)
        )
    )


def run_demo(
    quantities,
    logpath: str = "cockpit_demo/log",
    steps: int = 200,
    batch_size: int = 64,
    lr: float = 0.1,
    seed: int = 0,
    progress: bool = True,
) -> DemoResult:
    """Train the demo network with SGD and write the cockpit log.

    Args:
        quantities: The quantities to track.
        logpath: Log path without the ``.json`` suffix.
        steps: Number of training steps.
        batch_size: Mini-batch size.
        lr: SGD learning rate.
        seed: Seed for the model and the batch order.
        progress: Show a tqdm progress bar with live loss and gradient norm.

    Returns:
        The cockpit and the path of the written log.
    """
    from tqdm.auto import tqdm

    x, y = load_digits_tensors()
    model = make_demo_model(seed)
    loss_fn = extend(torch.nn.CrossEntropyLoss())
    individual_loss_fn = torch.nn.CrossEntropyLoss(reduction="none")
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    cockpit = Cockpit(model.parameters(), quantities=quantities)
    generator = torch.Generator().manual_seed(seed)

    bar = tqdm(range(steps), desc="cockpit demo", disable=not progress)
    for step in bar:
        index = torch.randint(0, x.shape[0], (batch_size,), generator=generator)
        inputs, targets = x[index], y[index]
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
        bar.set_postfix(_postfix(cockpit, step), refresh=False)
    path = cockpit.write(logpath)
    return DemoResult(cockpit, os.fspath(path))


def _postfix(cockpit: Cockpit, step: int) -> dict[str, str]:
    """Latest loss, Alpha and gradient norm for the progress bar."""
    history = cockpit.history
    postfix = {}
    if step in history and "Loss" in history[step]:
        postfix["loss"] = f"{history[step]['Loss']:.3f}"
    if step - 1 in history and "Alpha" in history[step - 1]:
        postfix["alpha"] = f"{history[step - 1]['Alpha']:+.2f}"
    if step in history and "GradNorm" in history[step]:
        norm = sum(v * v for v in history[step]["GradNorm"]) ** 0.5
        postfix["|g|"] = f"{norm:.3f}"
    return postfix
