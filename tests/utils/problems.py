"""Small, deterministic training problems in float64 for brute-force comparisons.

A :class:`Problem` bundles an extended model, a mean-reduced loss, a per-sample loss
and a fresh optimizer, plus a data generator. Per-sample losses are reduced over every
non-batch axis, so ``mean(individual_losses) == loss`` for both CE and MSE.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from backpack import extend

from cockpit.utils.schedules import linear, logarithmic

DTYPE = torch.float64


@dataclass
class Problem:
    name: str
    model: torch.nn.Module
    loss_fn: torch.nn.Module
    individual_loss_fn: Callable
    make_optimizer: Callable
    make_batch: Callable  # step -> (x, y)
    batch_size: int

    @property
    def params(self):
        return [p for p in self.model.parameters() if p.requires_grad]

    def optimizer(self):
        return self.make_optimizer(self.params)


def _ce_individual(outputs, targets):
    return torch.nn.functional.cross_entropy(outputs, targets, reduction="none")


def _mse_individual(outputs, targets):
    return ((outputs - targets) ** 2).flatten(1).mean(1)


OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1),
    "momentum": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params, lr=0.01),
}


def make_problem(
    arch: str,
    loss: str,
    optimizer: str = "sgd",
    batch_size: int = 6,
    seed: int = 0,
    device: torch.device | str = "cpu",
) -> Problem:
    """Build a problem: ``arch`` in {"mlp", "cnn"}, ``loss`` in {"ce", "mse"}.

    On another ``device`` the model and batches are those of the CPU, moved there
    (the same values on every device).
    """
    torch.manual_seed(seed)
    out_dim = 3
    if arch == "mlp":
        in_shape = (5,)
        model = torch.nn.Sequential(
            torch.nn.Linear(5, 4), torch.nn.Sigmoid(), torch.nn.Linear(4, out_dim)
        )
    elif arch == "cnn":
        in_shape = (2, 5, 5)
        model = torch.nn.Sequential(
            torch.nn.Conv2d(2, 3, kernel_size=3),
            torch.nn.ReLU(),
            torch.nn.Flatten(),
            torch.nn.Linear(27, out_dim),
        )
    else:
        raise ValueError(arch)
    model = extend(model.to(DTYPE).to(device))
    if loss == "ce":
        loss_fn = extend(torch.nn.CrossEntropyLoss())
        individual = _ce_individual
    elif loss == "mse":
        loss_fn = extend(torch.nn.MSELoss())
        individual = _mse_individual
    else:
        raise ValueError(loss)
    generator = torch.Generator().manual_seed(seed + 1)

    def make_batch(step: int):
        x = torch.randn(batch_size, *in_shape, generator=generator, dtype=DTYPE)
        if loss == "ce":
            y = torch.randint(0, out_dim, (batch_size,), generator=generator)
        else:
            y = torch.randn(batch_size, out_dim, generator=generator, dtype=DTYPE)
        return x.to(device), y.to(device)

    return Problem(
        name=f"{arch}-{loss}-{optimizer}",
        model=model,
        loss_fn=loss_fn,
        individual_loss_fn=individual,
        make_optimizer=OPTIMIZERS[optimizer],
        make_batch=make_batch,
        batch_size=batch_size,
    )


#: The problems every brute-force test runs on (MLP and CNN; CE and MSE; SGD and Adam).
PROBLEMS = [
    ("mlp", "ce", "sgd"),
    ("cnn", "mse", "adam"),
    ("cnn", "ce", "momentum"),
    ("mlp", "mse", "sgd"),
]
PROBLEM_IDS = ["-".join(p) for p in PROBLEMS]

#: The two schedules every brute-force test runs with.
SCHEDULES = {
    "every-step-from-1": lambda: linear(1, offset=1),
    "log": lambda: logarithmic(0, 1, steps=4, init=False),  # {1, 2, 4, 10}
}


def tracked_steps(schedule, steps: int) -> list[int]:
    """The steps below ``steps`` at which ``schedule`` tracks."""
    return [s for s in range(steps) if schedule(s)]
