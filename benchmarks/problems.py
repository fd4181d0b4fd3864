"""The two benchmark problems: an MNIST-sized MLP and the CIFAR-10-sized 3c3d CNN.

Both run on random data (no downloads) in float32 with a mean-reduced cross-entropy
loss, batch size 128 by default.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from backpack import extend

#: Names accepted by :func:`make`.
PROBLEMS = ("mlp", "3c3d")


def _mlp() -> tuple[torch.nn.Module, tuple[int, ...]]:
    """784-128-10 with a ReLU, as in the issue."""
    model = torch.nn.Sequential(
        torch.nn.Flatten(),
        torch.nn.Linear(784, 128),
        torch.nn.ReLU(),
        torch.nn.Linear(128, 10),
    )
    return model, (784,)


def _3c3d() -> tuple[torch.nn.Module, tuple[int, ...]]:
    """Three convolutions and three dense layers on 3x32x32 inputs.

    Conv(3,64,5)-MaxPool(3,2)-Conv(64,96,3)-MaxPool(3,2)-Conv(96,128,3,pad 1)-
    MaxPool(3,2)-Linear(512)-Linear(256)-Linear(10), ReLU after every convolution and
    hidden dense layer. Without pooling padding the feature map before the dense layers
    is 128x2x2 = 512 values.
    """
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 64, 5),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(3, 2),
        torch.nn.Conv2d(64, 96, 3),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(3, 2),
        torch.nn.Conv2d(96, 128, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(3, 2),
        torch.nn.Flatten(),
        torch.nn.Linear(512, 512),
        torch.nn.ReLU(),
        torch.nn.Linear(512, 256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 10),
    )
    return model, (3, 32, 32)


_BUILDERS = {"mlp": _mlp, "3c3d": _3c3d}


@dataclass
class Bench:
    """A benchmark problem: a plain model, an extended twin, and fixed batches.

    Attributes:
        name: ``"mlp"`` or ``"3c3d"``.
        plain: The model as a user would train it without cockpit (not extended).
        extended: A copy with identical weights, ``backpack.extend``-ed.
        loss_fn: Mean-reduced cross-entropy, extended.
        batches: A few ``(x, y)`` batches of random data, cycled through.
    """

    name: str
    plain: torch.nn.Module
    extended: torch.nn.Module
    loss_fn: torch.nn.Module
    batches: list[tuple[torch.Tensor, torch.Tensor]]

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Return the batch for ``step``."""
        return self.batches[step % len(self.batches)]

    def num_params(self) -> int:
        """Return the number of trainable parameters."""
        return sum(p.numel() for p in self.plain.parameters())


def make(
    name: str,
    batch_size: int = 128,
    num_batches: int = 4,
    seed: int = 0,
    need_plain: bool = True,
    need_extended: bool = True,
) -> Bench:
    """Build a benchmark problem.

    Args:
        name: One of :data:`PROBLEMS`.
        batch_size: Samples per batch.
        num_batches: How many distinct random batches to cycle through.
        seed: Seed for weights and data.
        need_plain: Build the plain model (skip it for memory runs of cockpit alone).
        need_extended: Build the extended twin (skip it for plain memory runs).

    Returns:
        The problem.

    Raises:
        ValueError: For an unknown name.
    """
    if name not in _BUILDERS:
        raise ValueError(f"Unknown problem {name!r}; choose from {PROBLEMS}.")
    torch.manual_seed(seed)
    model, in_shape = _BUILDERS[name]()
    generator = torch.Generator().manual_seed(seed + 1)
    batches = [
        (
            torch.randn(batch_size, *in_shape, generator=generator),
            torch.randint(0, 10, (batch_size,), generator=generator),
        )
        for _ in range(num_batches)
    ]
    plain = copy.deepcopy(model) if need_plain else None
    extended = extend(model) if need_extended else None
    return Bench(
        name=name,
        plain=plain,
        extended=extended,
        loss_fn=extend(torch.nn.CrossEntropyLoss()),
        batches=batches,
    )
