"""Models BackPACK has no complete set of rules for, and brute-force references.

Every model is tiny and float64. The references differentiate each sample's loss of
a full forward pass (``d l_i / d theta`` by definition, whatever the batch layout),
one sample at a time with plain autograd; nothing from ``cockpit`` is imported.
"""

from __future__ import annotations

import numpy as np
import torch
from backpack import extend
from torch.func import functional_call

from tests.utils.problems import DTYPE, OPTIMIZERS, Problem


class TransformerBlock(torch.nn.Module):
    """Pre-LayerNorm transformer block on tokens, with a raw positional parameter."""

    def __init__(self, vocab=7, width=8, length=5, classes=3):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.position = torch.nn.Parameter(0.1 * torch.randn(length, width))
        self.norm1 = torch.nn.LayerNorm(width)
        self.attention = torch.nn.MultiheadAttention(width, 2, batch_first=True)
        self.norm2 = torch.nn.LayerNorm(width)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(width, 16), torch.nn.GELU(), torch.nn.Linear(16, width)
        )
        self.head = torch.nn.Linear(width, classes)

    def forward(self, tokens):
        h = self.embed(tokens) + self.position
        q = self.norm1(h)
        h = h + self.attention(q, q, q, need_weights=False)[0]
        h = h + self.mlp(self.norm2(h))
        return self.head(h.mean(1))


class ResidualBlock(torch.nn.Module):
    """Conv - BatchNorm - ReLU - Conv - GroupNorm with a skip connection."""

    def __init__(self, channels=4, classes=3):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(2, channels, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(channels)
        self.conv2 = torch.nn.Conv2d(channels, channels, 3, padding=1)
        self.gn = torch.nn.GroupNorm(2, channels)
        self.head = torch.nn.Linear(channels, classes)

    def forward(self, x):
        h = torch.relu(self.bn(self.conv1(x)))
        h = torch.relu(h + self.gn(self.conv2(h)))
        return self.head(h.mean(dim=(2, 3)))


class SequenceFirstLSTM(torch.nn.Module):
    """LSTM with ``batch_first=False``; a Linear on ``[T, N, H]`` (T may equal N)."""

    def __init__(self, features=3, hidden=5, classes=3):
        super().__init__()
        self.lstm = torch.nn.LSTM(features, hidden)
        self.per_step = torch.nn.Linear(hidden, hidden)
        self.head = torch.nn.Linear(hidden, classes)

    def forward(self, x):  # x: [N, T, features], the LSTM sees [T, N, features]
        out, _ = self.lstm(x.transpose(0, 1))
        return self.head(torch.tanh(self.per_step(out)).mean(0))


class BatchFirstLSTM(torch.nn.Module):
    """LSTM with ``batch_first=True`` (BackPACK's rule) and a Linear head."""

    def __init__(self, features=3, hidden=4, classes=3):
        super().__init__()
        self.lstm = torch.nn.LSTM(features, hidden, batch_first=True)
        self.head = torch.nn.Linear(hidden, classes)

    def forward(self, x):
        return self.head(self.lstm(x)[0][:, -1])


class TiedCustom(torch.nn.Module):
    """A raw scale, a custom gate and an output layer tied to the embedding."""

    def __init__(self, vocab=6, width=4):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.scale = torch.nn.Parameter(torch.ones(width))
        self.gate = Gate(width)
        self.out = torch.nn.Linear(width, vocab)
        self.out.weight = self.embed.weight  # weight tying

    def forward(self, tokens):
        h = self.embed(tokens).mean(1) * self.scale
        return self.out(self.gate(h))


class Gate(torch.nn.Module):
    """A custom layer: ``x * sigmoid(x @ w)`` with a raw parameter ``w``."""

    def __init__(self, width):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(width, width) / width)

    def forward(self, x):
        return x * torch.sigmoid(x @ self.w)


class GRUClassifier(torch.nn.Module):
    """A GRU (no BackPACK rule), batch first, and a Linear head."""

    def __init__(self, features=3, hidden=4, classes=3):
        super().__init__()
        self.gru = torch.nn.GRU(features, hidden, batch_first=True)
        self.head = torch.nn.Linear(hidden, classes)

    def forward(self, x):
        return self.head(self.gru(x)[0][:, -1])


def _rmsnorm_mlp():
    return torch.nn.Sequential(
        torch.nn.Linear(4, 6),
        torch.nn.RMSNorm(6),
        torch.nn.Tanh(),
        torch.nn.Linear(6, 3),
    )


def _inplace_cnn(classes=3):
    """A CNN whose activations change their input in place (``inplace=True``)."""
    return torch.nn.Sequential(
        torch.nn.Conv2d(2, 3, 3, padding=1),
        torch.nn.ReLU(inplace=True),
        torch.nn.Conv2d(3, 3, 3),
        torch.nn.LeakyReLU(0.1, inplace=True),
        torch.nn.Flatten(),
        torch.nn.Linear(27, classes),
    )


def _ce(outputs, targets):
    return torch.nn.functional.cross_entropy(outputs, targets, reduction="none")


#: name -> (model factory, input maker (generator, N) -> x, eval mode)
ARCHITECTURES = {
    "transformer": (
        TransformerBlock,
        lambda gen, n: torch.randint(0, 7, (n, 5), generator=gen),
        False,
    ),
    "resnet-bn-eval": (
        ResidualBlock,
        lambda gen, n: torch.randn(n, 2, 5, 5, generator=gen, dtype=DTYPE),
        True,
    ),
    "lstm-seq-first": (
        SequenceFirstLSTM,
        lambda gen, n: torch.randn(n, n, 3, generator=gen, dtype=DTYPE),  # T = N
        False,
    ),
    "lstm-seq-first-t3": (
        SequenceFirstLSTM,
        lambda gen, n: torch.randn(n, 3, 3, generator=gen, dtype=DTYPE),  # T != N
        False,
    ),
    "lstm-batch-first": (
        BatchFirstLSTM,
        lambda gen, n: torch.randn(n, 3, 3, generator=gen, dtype=DTYPE),
        False,
    ),
    "tied-custom": (
        TiedCustom,
        lambda gen, n: torch.randint(0, 6, (n, 3), generator=gen),
        False,
    ),
    "rmsnorm-mlp": (
        _rmsnorm_mlp,
        lambda gen, n: torch.randn(n, 4, generator=gen, dtype=DTYPE),
        False,
    ),
    "cnn-inplace-relu": (
        _inplace_cnn,
        lambda gen, n: torch.randn(n, 2, 5, 5, generator=gen, dtype=DTYPE),
        False,
    ),
    "gru": (
        GRUClassifier,
        lambda gen, n: torch.randn(n, 4, 3, generator=gen, dtype=DTYPE),
        False,
    ),
}


def make_any_problem(arch: str, batch_size: int = 4, seed: int = 0) -> Problem:
    """A :class:`Problem` for ``arch`` (CE loss, plain SGD)."""
    factory, make_input, eval_mode = ARCHITECTURES[arch]
    torch.manual_seed(seed)
    model = extend(factory().to(DTYPE))
    if eval_mode:
        with torch.no_grad():  # give BatchNorm non-trivial running statistics
            for module in model.modules():
                if isinstance(module, torch.nn.BatchNorm2d):
                    module.running_mean.uniform_(-0.5, 0.5)
                    module.running_var.uniform_(0.5, 2.0)
        model.eval()
    classes = 6 if arch == "tied-custom" else 3
    generator = torch.Generator().manual_seed(seed + 1)

    def make_batch(step):
        x = make_input(generator, batch_size)
        y = torch.randint(0, classes, (batch_size,), generator=generator)
        return x, y

    return Problem(
        name=arch,
        model=model,
        loss_fn=extend(torch.nn.CrossEntropyLoss()),
        individual_loss_fn=_ce,
        make_optimizer=OPTIMIZERS["sgd"],
        make_batch=make_batch,
        batch_size=batch_size,
    )


# --- brute force ---------------------------------------------------------------------
def _losses(problem, params, x, y):
    names = [n for n, p in problem.model.named_parameters() if p.requires_grad]
    outputs = functional_call(problem.model, dict(zip(names, params)), (x,))
    return problem.individual_loss_fn(outputs, y)


def per_sample(problem, record):
    """``(G, losses)``: per-sample gradients ``[N, D]`` (all parameters) and losses.

    ``G[i] = d l_i / d theta`` from a full forward pass, one backward per sample.
    """
    leaves = [p.detach().clone().requires_grad_(True) for p in record.params]
    losses = _losses(problem, leaves, record.x, record.y)
    rows = []
    for i in range(losses.shape[0]):
        grads = torch.autograd.grad(losses[i], leaves, retain_graph=True)
        rows.append(torch.cat([g.reshape(-1) for g in grads]))
    return torch.stack(rows), losses.detach()


def split(flat_rows, params):
    """Split ``[N, D]`` rows into per-parameter ``[N, D_p]`` blocks."""
    return torch.split(flat_rows, [p.numel() for p in params], dim=1)


def first_order_reference(name, G, params):
    """A first-order quantity from per-sample gradients ``G`` ``[N, D]``."""
    n = G.shape[0]
    g = G.mean(0)
    g_sq = g @ g
    if name == "GradNorm":
        return [block.mean(0).norm() for block in split(G, params)]
    if name == "Variance":
        return [
            ((block - block.mean(0)) ** 2).sum(1).mean() for block in split(G, params)
        ]
    if name == "NormTest":
        return (((G - g) ** 2).sum() / (n * (n - 1) * g_sq)).sqrt()
    if name == "InnerTest":
        return (((G @ g - g_sq) ** 2).sum() / (n * (n - 1) * g_sq**2)).sqrt()
    if name == "OrthoTest":
        rest = G - (G @ g / g_sq)[:, None] * g[None, :]
        return ((rest**2).sum() / (n * (n - 1) * g_sq)).sqrt()
    if name == "MeanGSNR":
        variance = (G**2).mean(0) - g**2
        return (g**2 / (variance + 1e-5)).mean()
    raise KeyError(name)


def alpha_reference(start, end, start_params, end_params):
    """Alpha from its definition: a weighted quadratic fit along the actual step.

    Args:
        start: ``(G, losses)`` at the start step.
        end: ``(G, losses)`` at the next step.
        start_params: Parameters at the start step.
        end_params: Parameters at the next step.
    """
    step = torch.cat([(b - a).reshape(-1) for a, b in zip(start_params, end_params)])
    tau = float(step.norm())
    unit = step / tau
    targets, variances = [], []
    for _, losses in (start, end):
        targets.append(float(losses.mean()))
        variances.append(float(losses.var()))
    for G, _ in (start, end):
        slopes = G @ unit
        targets.append(float(slopes.mean()))
        variances.append(float(slopes.var()))
    design = np.array([[1, 0, 0], [1, tau, tau**2], [0, 1, 0], [0, 1, 2 * tau]])
    weights = 1 / np.sqrt(np.array(variances))
    (_, w1, w2), *_ = np.linalg.lstsq(
        weights[:, None] * design, weights * np.array(targets), rcond=None
    )
    if w2 < 0:
        return -1.0
    return tau / (-w1 / (2 * w2)) - 1
