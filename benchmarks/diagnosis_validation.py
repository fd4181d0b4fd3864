"""Validation of cockpit's diagnosis, live and final, on healthy runs and injected bugs.

Every run is an ordinary cockpit training loop (``configuration("economy")``, the
cockpit's live diagnosis on, as a user gets it), the learning rate logged with
``Cockpit.log`` every 10 steps. For each run the benchmark keeps

* **live**: the finding ids the live diagnosis announced while training (with the
  step at which each was announced; ``nonfinite`` counts although the cockpit, not
  the diagnosis, prints its warning);
* **final**: the ids :func:`cockpit.diagnosis.diagnose` reports at ``warning`` or
  ``error`` for the whole history (what ``cockpit report`` says).

A healthy run has a **false warning** if anything is announced live, and a **false
alarm** if the final report holds anything. A run with an injected bug is
**detected** (live, final) if its expected id is there. A live announcement whose id
the final report does not hold is a **retraction**: the live diagnosis said what the
report takes back. Other ids reported for a bug run are listed, not counted.

Two disjoint sets:

* **tuning**: the thresholds and checks of :mod:`cockpit.diagnosis` were chosen
  looking at these runs only (seeds 0 and 1): scikit-learn's digits with an MLP, the
  quickstart example's teacher task and network, the ResNet example with GroupNorm,
  the Hugging Face example's tiny BERT; SGD, Adam, AdamW; constant learning rate,
  cosine decay, warm-up; batches of 2 to 64; tracking every step and on a
  logarithmic schedule.
* **held-out**: run once the checks were frozen (seeds 10 and 11): other networks
  (a tanh MLP on synthetic data, a CNN on digits, the Lightning example's network,
  the ResNet example with BatchNorm, the character-level transformer example), the
  examples of the tuning set with other optimizers, schedules and batch sizes
  (RMSprop, SGD with Nesterov momentum, step decay, a longer warm-up, batches of
  8 to 128, every fifth step tracked), and other injected bugs.

Run (about 9 CPU minutes, one thread)::

    python -m benchmarks.diagnosis_validation --out benchmarks/results/diagnosis.md \
        --json benchmarks/results/diagnosis.json

The checks were first frozen on the tuning set and the held-out set run once
(``diagnosis_tuning.json``, ``diagnosis_held_out.json``: the two parts, kept).
The committed ``diagnosis.md`` / ``diagnosis.json`` are the logs of one run of both
sets (``--cache DIR``) diagnosed again after ``inputs_misscaled`` was changed on
the tuning runs (``--replay DIR``); each run's log is also checked there: the
dashboards' Diagnosis panel must equal the report (the table's last line).

``--sets tuning`` runs one set; ``--families mlp-digits,quickstart`` and ``--seeds
0`` make shorter runs; ``--json FILE`` keeps the raw record of every run (ids,
steps, severities) and ``--render FILE`` rewrites the table from it without
training; ``--cache DIR`` keeps every run's log, and ``--replay DIR`` diagnoses
those logs again (live by feeding the steps to a fresh
:class:`~cockpit.diagnosis.LiveDiagnosis` in order, as the cockpit does) without
training: how the checks were tuned.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from backpack import extend

from benchmarks import driver
from cockpit import Cockpit
from cockpit.diagnosis import LiveDiagnosis, diagnose
from cockpit.utils.configuration import configuration
from cockpit.utils.schedules import linear, logarithmic

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = str(driver.RESULTS / "diagnosis.md")
SEEDS = {"tuning": (0, 1), "held-out": (10, 11)}


# --- data ----------------------------------------------------------------------------
def digits(scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Digits (8x8): standardised features, or raw pixels scaled to ``[0, scale]``."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.as_tensor(data.data, dtype=torch.float32)
    if scale is None:
        x = (x - x.mean(0)) / (x.std(0) + 1e-6)
    else:
        x = x / 16.0 * scale
    return x, torch.as_tensor(data.target, dtype=torch.long)


def digit_images(scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Digits as ``[N, 1, 8, 8]`` images in ``[0, scale]`` (the ResNet example's)."""
    x, y = digits(scale=scale)
    return x.view(-1, 1, 8, 8), y


def synthetic(raw: bool = False, n: int = 2048) -> tuple[torch.Tensor, torch.Tensor]:
    """A warped Gaussian mixture: 24 features, 6 classes (always the same data).

    Standardised unless ``raw``: then the features are in "physical units" (scales
    between 10 and 1000 and offsets), as data straight from a table.
    """
    g = torch.Generator().manual_seed(1234)
    classes, dim = 6, 24
    means = 1.5 * torch.randn(classes, dim, generator=g)
    y = torch.randint(0, classes, (n,), generator=g)
    z = means[y] + torch.randn(n, dim, generator=g)
    x = z + 0.5 * torch.sin(z @ torch.randn(dim, dim, generator=g) / math.sqrt(dim))
    x = (x - x.mean(0)) / x.std(0)
    if raw:
        scales = 10 ** (1 + 2 * torch.rand(dim, generator=g))
        x = x * scales + 3 * scales
    return x, y


def noisy_labels(y: torch.Tensor, share: float, seed: int) -> torch.Tensor:
    """Replace ``share`` of the labels by uniformly random ones."""
    g = torch.Generator().manual_seed(seed + 999)
    flip = torch.rand(len(y), generator=g) < share
    y = y.clone()
    y[flip] = torch.randint(0, int(y.max()) + 1, (int(flip.sum()),), generator=g)
    return y


def example(name: str):
    """Import ``examples/<name>.py`` (the examples are scripts, not a package)."""
    path = os.path.join(ROOT, "examples", f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"_example_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- models --------------------------------------------------------------------------
def mlp(
    widths: list[int],
    activation: type[torch.nn.Module],
    seed: int,
    gain: float | None = None,
) -> torch.nn.Module:
    """An MLP; ``gain`` draws weights from N(0, gain^2 / fan_in), biases 0."""
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = []
    for i, (fan_in, fan_out) in enumerate(zip(widths[:-1], widths[1:])):
        layer = torch.nn.Linear(fan_in, fan_out)
        if gain is not None:
            torch.nn.init.normal_(layer.weight, std=gain / math.sqrt(fan_in))
            torch.nn.init.zeros_(layer.bias)
        layers.append(layer)
        if i < len(widths) - 2:
            layers.append(activation())
    return torch.nn.Sequential(*layers)


def cnn(seed: int) -> torch.nn.Module:
    """Two convolutions with max pooling and a linear classifier, for 8x8 digits."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(8, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Flatten(), torch.nn.Linear(64, 10),
    )  # fmt: skip


def extend_layers(model: torch.nn.Module) -> torch.nn.Module:
    """``extend`` every module that owns parameters (as the integrations do: BERT
    has children named ``output``, which extending the containers would clash
    with); the cockpit serves what BackPACK cannot."""
    for module in model.modules():
        if next(module.parameters(recurse=False), None) is not None:
            extend(module)
    return model


def _call(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x)


# --- one run -------------------------------------------------------------------------
@dataclass
class Setup:
    """What one run trains.

    Attributes:
        model: The network (extended for BackPACK).
        x: Inputs (samples along the first axis).
        y: Targets.
        optimizer: Made from the model's parameters.
        batch: Batch size.
        lr_at: ``step -> learning-rate factor`` (multiplies the base rates) or
            ``None`` for a constant rate.
        forward: ``(model, inputs) -> logits`` (``[N, C]`` or ``[N, T, C]``).
        track: The quantities' track schedule.
    """

    model: torch.nn.Module
    x: torch.Tensor
    y: torch.Tensor
    optimizer: torch.optim.Optimizer
    batch: int = 32
    lr_at: Callable[[int], float] | None = None
    forward: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor] = _call
    track: Callable[[int], bool] = field(default_factory=lambda: linear(1))


def warmup_then_linear(warmup: int, steps: int) -> Callable[[int], float]:
    """Linear warm-up from 0 over ``warmup`` steps, then linear decay to 0."""
    return lambda t: (t + 1) / warmup if t < warmup else (steps - t) / (steps - warmup)


def cosine(steps: int) -> Callable[[int], float]:
    """Cosine decay from 1 to 0 over ``steps``."""
    return lambda t: 0.5 * (1 + math.cos(math.pi * t / steps))


def step_decay(every: int, gamma: float = 0.5) -> Callable[[int], float]:
    """Multiply by ``gamma`` every ``every`` steps."""
    return lambda t: gamma ** (t // every)


class Announced:
    """The ids the live diagnosis announced, with the training step of each."""

    def __init__(self):
        self.first: dict[str, int] = {}

    def note(self, cockpit: Cockpit, step: int) -> None:
        for finding in cockpit.diagnosis.findings:
            self.first.setdefault(finding.id, step)


def train(setup: Setup, steps: int, seed: int) -> tuple[Cockpit, dict[str, int]]:
    """Train with the economy configuration and the live diagnosis.

    Returns:
        The cockpit and ``{id: step announced}`` of the live diagnosis.
    """
    quantities = configuration("economy", track_schedule=setup.track)
    cockpit = Cockpit(setup.model.named_parameters(), quantities=quantities)
    loss_fn = extend(torch.nn.CrossEntropyLoss())
    individual = torch.nn.CrossEntropyLoss(reduction="none")
    generator = torch.Generator().manual_seed(seed)
    optimizer = setup.optimizer
    base = [group["lr"] for group in optimizer.param_groups]
    announced = Announced()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # counted from cockpit.diagnosis instead
        for step in range(steps):
            if setup.lr_at is not None:
                for group, lr in zip(optimizer.param_groups, base):
                    group["lr"] = lr * setup.lr_at(step)
            index = torch.randint(0, len(setup.x), (setup.batch,), generator=generator)
            targets = setup.y[index]
            optimizer.zero_grad()
            logits = setup.forward(setup.model, setup.x[index])
            flat = logits.flatten(0, -2) if logits.dim() > 2 else logits
            loss = loss_fn(flat, targets.flatten())
            losses = individual(flat, targets.flatten()).view(len(index), -1).mean(1)
            info = {"batch_size": len(index), "individual_losses": losses,
                    "loss": loss, "optimizer": optimizer}  # fmt: skip
            with cockpit(step, info=info):
                loss.backward(create_graph=cockpit.create_graph(step))
            optimizer.step()
            if step % 10 == 0 or step == steps - 1:
                lr = optimizer.param_groups[0]["lr"]
                cockpit.log(step, 0, None, None, None, None, None, None, lr)
            announced.note(cockpit, step)
    return cockpit, announced.first


# --- the runs ------------------------------------------------------------------------
@dataclass(frozen=True)
class Spec:
    """One kind of run (trained once per seed).

    Attributes:
        which: ``"tuning"`` or ``"held-out"``.
        family: The network and data.
        scenario: ``"healthy"`` or the injected bug.
        expected: The finding id a bug must produce (``None``: healthy).
        setting: Optimizer, learning rate, schedule, batch (for the table).
        make: ``seed -> Setup``.
        steps: Training steps.
    """

    which: str
    family: str
    scenario: str
    expected: str | None
    setting: str
    make: Callable[[int], Setup]
    steps: int = 150

    @property
    def name(self) -> str:
        """A short unique name."""
        return f"{self.which}/{self.family}/{self.scenario}/{self.setting}"


def _sgd(model, lr, momentum=0.0, nesterov=False):
    return torch.optim.SGD(
        model.parameters(), lr=lr, momentum=momentum, nesterov=nesterov
    )


def _mlp_digits(seed, lr=0.1, opt="sgd", batch=32, scale=None, widths=None,
                act=torch.nn.ReLU, gain=None, lr_at=None, track=None):  # fmt: skip
    x, y = digits(scale)
    model = extend(mlp(widths or [64, 32, 10], act, seed, gain))
    optimizer = {
        "sgd": lambda: _sgd(model, lr),
        "adam": lambda: torch.optim.Adam(model.parameters(), lr=lr),
        "adamw": lambda: torch.optim.AdamW(model.parameters(), lr=lr),
        "momentum": lambda: _sgd(model, lr, momentum=0.9),
    }[opt]()
    return Setup(model, x, y, optimizer, batch, lr_at, track=track or linear(1))


def _quickstart(seed, lr=0.2, opt="sgd", batch=64, lr_at=None, track=None):
    x, y = example("quickstart").make_data(seed=seed)
    torch.manual_seed(seed)
    model = extend(mlp([20, 32, 5], torch.nn.ReLU, seed))
    optimizer = {
        "sgd": lambda: _sgd(model, lr),
        "adam": lambda: torch.optim.Adam(model.parameters(), lr=lr),
        "nesterov": lambda: _sgd(model, lr, momentum=0.9, nesterov=True),
        "rmsprop": lambda: torch.optim.RMSprop(model.parameters(), lr=lr),
    }[opt]()
    return Setup(model, x, y, optimizer, batch, lr_at, track=track or linear(1))


def _resnet(seed, norm="group", lr=0.01, batch=32, scale=1.0, lr_at=None):
    x, y = digit_images(scale)
    torch.manual_seed(seed)
    model = extend(example("resnet_digits").ResNet(norm=norm))
    optimizer = _sgd(model, lr, momentum=0.9)
    return Setup(model, x, y, optimizer, batch, lr_at)


def _bert(seed, lr=3e-3, batch=32, lr_at=None, steps=120):
    module = example("huggingface_tiny_bert")
    data = module.ContainsToken()
    torch.manual_seed(seed)
    model = extend_layers(module.tiny_bert())
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    lr_at = lr_at or warmup_then_linear(max(1, steps // 10), steps)
    return Setup(model, data.ids, data.labels, optimizer, batch, lr_at,
                 forward=lambda m, ids: m(input_ids=ids).logits)  # fmt: skip


def _synthetic(seed, lr=0.1, opt="sgd", batch=32, raw=False, widths=None,
               act=torch.nn.Tanh, gain=None, label_noise=0.0):  # fmt: skip
    x, y = synthetic(raw=raw)
    if label_noise:
        y = noisy_labels(y, label_noise, seed)
    model = extend(mlp(widths or [24, 64, 64, 6], act, seed, gain))
    optimizer = {
        "sgd": lambda: _sgd(model, lr),
        "adam": lambda: torch.optim.Adam(model.parameters(), lr=lr),
    }[opt]()
    return Setup(model, x, y, optimizer, batch)


def _cnn(seed, lr=1e-3, opt="rmsprop", batch=128, scale=1.0, label_noise=0.0,
         lr_at=None):  # fmt: skip
    x, y = digit_images(scale)
    if label_noise:
        y = noisy_labels(y, label_noise, seed)
    model = extend(cnn(seed))
    optimizer = {
        "rmsprop": lambda: torch.optim.RMSprop(model.parameters(), lr=lr),
        "sgd": lambda: _sgd(model, lr),
        "momentum": lambda: _sgd(model, lr, momentum=0.9),
    }[opt]()
    return Setup(model, x, y, optimizer, batch, lr_at)


def _lightning_net(seed, lr=0.1, batch=64, lr_at=None, track=None):
    """The Lightning example's network and optimizer (SGD, momentum 0.9, step
    decay), in the plain loop."""
    x, y = digits()
    model = extend(mlp([64, 32, 32, 10], torch.nn.ReLU, seed))
    optimizer = _sgd(model, lr, momentum=0.9)
    return Setup(model, x, y, optimizer, batch, lr_at or step_decay(50),
                 track=track or linear(1))  # fmt: skip


def _char_lm(seed, lr=3e-3, batch=16, block=32, lr_at=None):
    """The character-level transformer example: next-character prediction."""
    module = example("char_transformer")
    text = module.load_text()
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text])
    starts = torch.arange(0, len(data) - block - 1, 7)
    x = torch.stack([data[s : s + block] for s in starts])
    y = torch.stack([data[s + 1 : s + block + 1] for s in starts])
    torch.manual_seed(seed)
    model = extend(module.CharTransformer(len(chars), block=block))
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    return Setup(model, x, y, optimizer, batch, lr_at)


def _specs() -> list[Spec]:
    T, H = "tuning", "held-out"
    log_track = logarithmic(0, math.log10(150), 60)  # dense at first, sparse later
    return [
        # --- tuning: healthy ----------------------------------------------------------
        Spec(T, "mlp-digits", "healthy", None, "SGD lr 0.1, batch 32",
             lambda s: _mlp_digits(s)),
        Spec(T, "mlp-digits", "healthy", None, "Adam lr 1e-3, batch 32",
             lambda s: _mlp_digits(s, 1e-3, "adam")),
        Spec(T, "mlp-digits", "healthy", None,
             "SGD momentum 0.9 lr 0.05, cosine decay, batch 64",
             lambda s: _mlp_digits(s, 0.05, "momentum", 64, lr_at=cosine(150))),
        Spec(T, "mlp-digits", "healthy", None,
             "AdamW lr 3e-3, warm-up 15 then linear decay, batch 16",
             lambda s: _mlp_digits(s, 3e-3, "adamw", 16,
                                   lr_at=warmup_then_linear(15, 150))),
        Spec(T, "mlp-digits", "healthy", None,
             "SGD lr 0.1, batch 32, tracked on a logarithmic schedule",
             lambda s: _mlp_digits(s, track=log_track)),
        Spec(T, "quickstart", "healthy", None, "the example: SGD lr 0.2, batch 64",
             lambda s: _quickstart(s)),
        Spec(T, "quickstart", "healthy", None, "Adam lr 1e-3, batch 64",
             lambda s: _quickstart(s, 1e-3, "adam")),
        Spec(T, "resnet-groupnorm", "healthy", None,
             "the example: SGD momentum 0.9 lr 0.01, batch 32",
             lambda s: _resnet(s)),
        Spec(T, "bert-tiny", "healthy", None,
             "the example: AdamW lr 3e-3, warm-up 12 then linear decay, batch 32",
             lambda s: _bert(s), steps=120),
        # --- tuning: bugs -------------------------------------------------------------
        Spec(T, "mlp-digits", "lr-too-large", "step_size_too_large", "SGD lr 3",
             lambda s: _mlp_digits(s, 3.0)),
        Spec(T, "quickstart", "lr-too-large", "step_size_too_large", "SGD lr 5",
             lambda s: _quickstart(s, 5.0)),
        Spec(T, "bert-tiny", "lr-too-large", "step_size_too_large",
             "AdamW lr 0.3, warm-up 12 then linear decay",
             lambda s: _bert(s, 0.3), steps=120),
        Spec(T, "mlp-digits", "lr-too-small", "step_size_too_small", "SGD lr 1e-4",
             lambda s: _mlp_digits(s, 1e-4)),
        Spec(T, "quickstart", "lr-too-small", "step_size_too_small", "Adam lr 1e-6",
             lambda s: _quickstart(s, 1e-6, "adam")),
        Spec(T, "mlp-digits", "unnormalised-inputs", "inputs_misscaled",
             "raw pixels in [0, 255], SGD lr 0.1",
             lambda s: _mlp_digits(s, scale=255.0)),
        Spec(T, "resnet-groupnorm", "unnormalised-inputs", "inputs_misscaled",
             "pixels in [0, 255]", lambda s: _resnet(s, scale=255.0)),
        Spec(T, "mlp-digits", "vanishing", "vanishing_gradients",
             "8 sigmoid layers of width 32, SGD lr 0.1",
             lambda s: _mlp_digits(s, widths=[64] + [32] * 7 + [10],
                                   act=torch.nn.Sigmoid)),
        Spec(T, "mlp-digits", "exploding", "exploding_gradients",
             "12 linear layers, N(0, 1.3^2/fan_in) init, SGD lr 0.03",
             lambda s: _mlp_digits(s, 0.03, widths=[64] + [32] * 11 + [10],
                                   act=torch.nn.Identity, gain=1.3)),
        Spec(T, "mlp-digits", "gradient-noise", "gradient_noise_dominates",
             "batch size 2, SGD lr 0.1", lambda s: _mlp_digits(s, batch=2)),
        # --- held-out: healthy --------------------------------------------------------
        Spec(H, "synthetic-tanh", "healthy", None, "SGD lr 0.1, batch 32",
             lambda s: _synthetic(s)),
        Spec(H, "synthetic-tanh", "healthy", None, "Adam lr 3e-3, batch 32",
             lambda s: _synthetic(s, 3e-3, "adam")),
        Spec(H, "cnn-digits", "healthy", None, "RMSprop lr 1e-3, batch 128",
             lambda s: _cnn(s)),
        Spec(H, "cnn-digits", "healthy", None,
             "SGD momentum 0.9 lr 0.02, warm-up 30 then linear decay, batch 8",
             lambda s: _cnn(s, 0.02, "momentum", 8,
                            lr_at=warmup_then_linear(30, 150))),
        Spec(H, "lightning-digits", "healthy", None,
             "the example: SGD momentum 0.9 lr 0.1, step decay, batch 64",
             lambda s: _lightning_net(s)),
        Spec(H, "lightning-digits", "healthy", None,
             "the example, every fifth step tracked",
             lambda s: _lightning_net(s, track=linear(5))),
        Spec(H, "quickstart", "healthy", None,
             "SGD Nesterov 0.9 lr 0.05, step decay, batch 128",
             lambda s: _quickstart(s, 0.05, "nesterov", 128, step_decay(40))),
        Spec(H, "quickstart", "healthy", None, "RMSprop lr 3e-3, batch 16",
             lambda s: _quickstart(s, 3e-3, "rmsprop", 16)),
        Spec(H, "resnet-batchnorm", "healthy", None,
             "the example: BatchNorm, SGD momentum 0.9 lr 0.01, batch 32",
             lambda s: _resnet(s, "batch"), steps=120),
        Spec(H, "char-transformer", "healthy", None,
             "the example: Adam lr 3e-3, batch 16", lambda s: _char_lm(s)),
        Spec(H, "bert-tiny", "healthy", None,
             "AdamW lr 1e-3, cosine decay, batch 16",
             lambda s: _bert(s, 1e-3, 16, lr_at=cosine(120)), steps=120),
        # --- held-out: bugs -----------------------------------------------------------
        Spec(H, "synthetic-tanh", "lr-too-large", "step_size_too_large", "SGD lr 5",
             lambda s: _synthetic(s, 5.0)),
        Spec(H, "cnn-digits", "lr-too-large", "step_size_too_large", "SGD lr 2",
             lambda s: _cnn(s, 2.0, "sgd", 32)),
        Spec(H, "char-transformer", "lr-too-large", "step_size_too_large",
             "Adam lr 0.1", lambda s: _char_lm(s, 0.1)),
        Spec(H, "synthetic-tanh", "lr-too-small", "step_size_too_small",
             "SGD lr 3e-5", lambda s: _synthetic(s, 3e-5)),
        Spec(H, "lightning-digits", "lr-too-small", "step_size_too_small",
             "SGD momentum 0.9 lr 1e-5, step decay",
             lambda s: _lightning_net(s, 1e-5)),
        Spec(H, "synthetic-tanh", "unnormalised-inputs", "inputs_misscaled",
             "features in raw units (scales 10-1000), Adam lr 1e-3",
             lambda s: _synthetic(s, 1e-3, "adam", raw=True)),
        Spec(H, "cnn-digits", "unnormalised-inputs", "inputs_misscaled",
             "pixels in [0, 255], RMSprop lr 1e-3",
             lambda s: _cnn(s, scale=255.0)),
        Spec(H, "synthetic-tanh", "vanishing", "vanishing_gradients",
             "10 sigmoid layers of width 48, N(0, 1/fan_in) init, SGD lr 0.05",
             lambda s: _synthetic(s, 0.05, widths=[24] + [48] * 9 + [6],
                                  act=torch.nn.Sigmoid, gain=1.0)),
        Spec(H, "synthetic-tanh", "exploding", "exploding_gradients",
             "10 ReLU layers, N(0, 2.6^2/fan_in) init, SGD lr 0.01",
             lambda s: _synthetic(s, 0.01, widths=[24] + [32] * 9 + [6],
                                  act=torch.nn.ReLU, gain=2.6)),
        Spec(H, "cnn-digits", "gradient-noise", "gradient_noise_dominates",
             "batch size 2 and 30 % random labels, SGD lr 0.05",
             lambda s: _cnn(s, 0.05, "sgd", 2, label_noise=0.3)),
    ]  # fmt: skip


SPECS = _specs()


# --- evaluation ----------------------------------------------------------------------
def reported(findings) -> dict[str, str]:
    """``{id: severity}`` of the findings at warning or error."""
    return {f.id: f.severity for f in findings if f.severity != "info"}


def replay_live(history) -> dict[str, int]:
    """What a fresh live diagnosis announces when fed the history step by step."""
    live = LiveDiagnosis(warn=False)
    first: dict[str, int] = {}
    for step, values in history.items():
        live.on_record(step, values)
        for finding in live.findings:
            first.setdefault(finding.id, step)
    return first


def run_one(spec: Spec, seed: int, cache: str | None) -> dict[str, Any]:
    """Train one run; return its record."""
    start = time.process_time()
    cockpit, live = train(spec.make(seed), spec.steps, seed)
    seconds = time.process_time() - start
    record = _record(spec, seed, live, reported(diagnose(cockpit.history)), seconds)
    if cache:
        cockpit.write(os.path.join(cache, _file(spec, seed)))
        with open(os.path.join(cache, _file(spec, seed) + ".live"), "w") as handle:
            json.dump(live, handle)
        record["panel"] = panel_disagreement(
            os.path.join(cache, _file(spec, seed) + ".json")
        )
    return record


def panel_disagreement(path: str) -> list[str]:
    """How the dashboards' Diagnosis panel differs from ``cockpit report`` on a log.

    The report is :func:`cockpit.diagnosis.diagnose` of the file; the panel is what
    ``cockpit plot`` draws (the log read for plotting) and what the CLI's live view
    draws (the log opened as it grows). Each finding is compared by id, severity
    and steps. Returns one line per reader that differs (empty: they agree).
    """
    from cockpit.plotting.data import read_log
    from cockpit.plotting.drawers import diagnosis_findings

    def described(findings) -> list:
        return [(f.id, f.severity, tuple(f.steps)) for f in findings or []]

    report = described(diagnose(path))
    differs = []
    for name, read in (("plot", read_log), ("live view", _latest)):
        panel = described(diagnosis_findings(read(path)))
        if panel != report:
            differs.append(f"{name}: panel {panel} != report {report}")
    return differs


def _latest(path: str):
    from cockpit.log.files import open_log

    return open_log(path, latest=True)


def _file(spec: Spec, seed: int) -> str:
    keep = "".join(c if c.isalnum() else "_" for c in spec.name)
    return f"{keep}__{seed}"


def _record(spec, seed, live, final, seconds=None) -> dict[str, Any]:
    return {
        "set": spec.which,
        "family": spec.family,
        "scenario": spec.scenario,
        "setting": spec.setting,
        "expected": spec.expected,
        "seed": seed,
        "live": live,
        "final": final,
        "cpu_seconds": None if seconds is None else round(seconds, 1),
    }


def replay_one(spec: Spec, seed: int, cache: str) -> dict[str, Any] | None:
    """Diagnose a cached run again (live by replay); ``None`` if not cached."""
    from cockpit.log.files import open_log

    path = os.path.join(cache, _file(spec, seed) + ".json")
    if not os.path.exists(path):
        return None
    history = open_log(path)
    record = _record(spec, seed, replay_live(history), reported(diagnose(history)))
    record["panel"] = panel_disagreement(path)
    return record


# --- tables --------------------------------------------------------------------------
def _group(records):
    groups: dict[tuple, list] = {}
    for r in records:
        key = (r["set"], r["family"], r["scenario"], r["setting"], r["expected"])
        groups.setdefault(key, []).append(r)
    return groups


def _retracted(record: dict[str, Any]) -> bool:
    """Whether the live diagnosis announced an id the final report does not hold."""
    return bool(set(record["live"]) - set(record["final"]))


def table(records: list[dict[str, Any]]) -> str:
    """Markdown tables: every kind of run, then the rates per set."""
    lines = [
        "| set | network | scenario | setting | expected | live | final | "
        "retracted | also reported (final) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for (which, family, scenario, setting, expected), runs in _group(records).items():
        n = len(runs)
        if expected is None:
            live = f"{sum(bool(r['live']) for r in runs)}/{n} false"
            final = f"{sum(bool(r['final']) for r in runs)}/{n} false"
            said = sorted({i for r in runs for i in [*r["live"], *r["final"]]})
            also = ", ".join(f"`{i}`" for i in said) or "-"
        else:
            live = f"{sum(expected in r['live'] for r in runs)}/{n}"
            final = f"{sum(expected in r['final'] for r in runs)}/{n}"
            counts: dict[str, int] = {}
            for r in runs:
                for i in sorted(set(r["final"]) - {expected}):
                    counts[i] = counts.get(i, 0) + 1
            also = ", ".join(f"`{k}` {v}/{n}" for k, v in counts.items()) or "-"
        retracted = sum(_retracted(r) for r in runs)
        what = f"`{expected}`" if expected else "none (healthy)"
        lines.append(
            f"| {which} | {family} | {scenario} | {setting} | {what} | {live} | "
            f"{final} | {retracted}/{n} | {also} |"
        )
    lines += [
        "",
        "| set | healthy runs: false warnings live | false alarms final | "
        "bugs detected live | bugs detected final | runs with a retraction |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for which in dict.fromkeys(r["set"] for r in records):
        mine = [r for r in records if r["set"] == which]
        healthy = [r for r in mine if r["expected"] is None]
        bugs = [r for r in mine if r["expected"] is not None]

        def rate(k, n):
            return f"{k}/{n} = {k / max(n, 1):.0%}"

        lines.append(
            f"| {which} | {rate(sum(bool(r['live']) for r in healthy), len(healthy))} "
            f"| {rate(sum(bool(r['final']) for r in healthy), len(healthy))} "
            f"| {rate(sum(r['expected'] in r['live'] for r in bugs), len(bugs))} "
            f"| {rate(sum(r['expected'] in r['final'] for r in bugs), len(bugs))} "
            f"| {rate(sum(_retracted(r) for r in mine), len(mine))} |"
        )
    return "\n".join(lines)


def machine() -> str:
    """CPU model, commit and versions, for the results file."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        commit = subprocess.run(
            ["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    return f"commit {commit}, {cpu}, torch {torch.__version__}, one thread"


def render(
    records: list[dict[str, Any]], command: str, where: str | None = None
) -> str:
    """The results file: how it was made, then the tables."""
    cpu = [r["cpu_seconds"] for r in records if r.get("cpu_seconds") is not None]
    spent = f", {sum(cpu) / 60:.0f} CPU minutes of training" if cpu else ""
    return (
        "# Diagnosis validation\n\n"
        f"Written by `{command}` ({where or machine()}{spent}). Every run is the plain "
        'cockpit loop with `configuration("economy")` and the live diagnosis on; '
        "**live** counts what the live diagnosis announced while training, "
        "**final** what `cockpit report` finds in the whole log (warning or "
        "error). A healthy run counts if anything is said; a bug run if its "
        "expected id is; a run has a **retraction** if the live diagnosis "
        "announced an id the final report does not hold. The checks were chosen "
        "on the **tuning** runs only; the **held-out** runs (other networks, "
        "optimizers, schedules, batch sizes and bugs, other seeds) were run "
        "afterwards, once.\n\n" + table(records) + "\n" + panel_summary(records)
    )


def panel_summary(records: list[dict[str, Any]]) -> str:
    """The dashboards' Diagnosis panel against the report, on the logs compared."""
    checked = [r for r in records if "panel" in r]
    if not checked:
        return ""
    differ = [r for r in checked if r["panel"]]
    lines = [
        f"\n**The dashboards' Diagnosis panel equals `cockpit report`** (ids, "
        f"severities, steps; `cockpit plot`'s reading of the log and the live "
        f"view's) on {len(checked) - len(differ)} of {len(checked)} logs.\n"
    ]
    for r in differ:
        lines.append(
            f"- {r['family']} {r['scenario']} seed {r['seed']}: "
            + "; ".join(r["panel"])
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> str:
    """Run the validation (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sets", nargs="+", default=list(SEEDS))
    parser.add_argument("--families", default="", help="comma-separated subset")
    parser.add_argument("--seeds", default="", help="comma-separated, for all sets")
    parser.add_argument("--out", default=RESULTS, help="Markdown file to write")
    parser.add_argument("--json", help="also write the raw records here")
    parser.add_argument(
        "--render", nargs="+", help="rewrite --out from --json files (merged)"
    )
    parser.add_argument("--cache", help="keep every run's log in this folder")
    parser.add_argument("--replay", help="diagnose the logs of a --cache folder")
    args = parser.parse_args(argv)
    command = "python -m benchmarks.diagnosis_validation " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    if args.render:
        records, commands, machines = [], [], []
        for path in args.render:
            with open(path, encoding="utf-8") as handle:
                saved = json.load(handle)
            records += saved["records"]
            commands.append(saved["command"])
            machines.append(saved.get("machine", "machine not recorded"))
        where = "; ".join(dict.fromkeys(machines))
        text = render(records, "` and `".join(commands), where)
    else:
        torch.set_num_threads(1)
        families = set(filter(None, args.families.split(",")))
        chosen = [
            s
            for s in SPECS
            if s.which in args.sets and (not families or s.family in families)
        ]
        records = []
        if args.cache:
            os.makedirs(args.cache, exist_ok=True)
        for spec in chosen:
            seeds = SEEDS[spec.which]
            if args.seeds:
                seeds = tuple(int(s) for s in args.seeds.split(","))
            for seed in seeds:
                if args.replay:
                    record = replay_one(spec, seed, args.replay)
                    if record is None:
                        continue
                else:
                    record = run_one(spec, seed, args.cache)
                records.append(record)
                print(
                    f"{spec.name} seed {seed}: live {sorted(record['live'])} "
                    f"final {sorted(record['final'])}",
                    flush=True,
                )
        text = render(records, command)
        if args.json:
            with open(args.json, "w", encoding="utf-8") as handle:
                saved = {"command": command, "machine": machine(), "records": records}
                json.dump(saved, handle, indent=1)
    print("\n" + text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as handle:
            handle.write(text)
        print(f"written to {args.out}")
    return text


if __name__ == "__main__":
    main()
