"""A tiny character-level transformer language model, tracked by cockpit.

The model has everything BackPACK alone cannot handle: an embedding tied to the
output layer, a learned positional parameter, pre-LayerNorm attention
(``nn.MultiheadAttention``) and residual connections. The training loop is the
ordinary cockpit loop; cockpit picks an engine per parameter (BackPACK where it has
a rule, autograd elsewhere), estimates the curvature trace with the Monte-Carlo GGN
of the cross-entropy in place of the Hessian (BackPACK's exact diagonal needs a rule
for every layer; ``cockpit/curvature/source.py``), and ``coverage()`` says who
computed what. The text is the source of Python's own ``textwrap`` module.

HessMaxEV needs second derivatives, which the fused attention kernel on CPU does not
have: the forward pass runs inside ``sdpa_kernel(SDPBackend.MATH)``.

Run: ``python examples/char_transformer.py [--steps 200] [--out char_lm_output]``.
Writes ``<out>/log.json`` and ``<out>/dashboard.png``; prints the coverage report.
"""

from __future__ import annotations

import argparse
import os
import textwrap
import warnings
from pathlib import Path

import torch
from backpack import extend
from torch.nn.attention import SDPBackend, sdpa_kernel
from tqdm import tqdm

from cockpit import Cockpit, CockpitPlotter
from cockpit import quantities as Q
from cockpit.utils.configuration import configuration
from cockpit.utils.schedules import linear


class CharTransformer(torch.nn.Module):
    """Embedding (tied to the output), positions, one pre-LayerNorm block."""

    def __init__(self, vocab: int, width: int = 32, block: int = 32, heads: int = 2):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.position = torch.nn.Parameter(0.02 * torch.randn(block, width))
        self.norm1 = torch.nn.LayerNorm(width)
        self.attention = torch.nn.MultiheadAttention(width, heads, batch_first=True)
        self.norm2 = torch.nn.LayerNorm(width)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(width, 4 * width),
            torch.nn.GELU(),
            torch.nn.Linear(4 * width, width),
        )
        self.norm3 = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, vocab)
        self.head.weight = self.embed.weight  # weight tying
        mask = torch.triu(torch.ones(block, block, dtype=torch.bool), diagonal=1)
        self.register_buffer("mask", mask)

    def forward(self, tokens):
        length = tokens.shape[1]
        h = self.embed(tokens) + self.position[:length]
        q = self.norm1(h)
        mask = self.mask[:length, :length]
        h = h + self.attention(q, q, q, attn_mask=mask, need_weights=False)[0]
        h = h + self.mlp(self.norm2(h))
        return self.head(self.norm3(h))


def load_text() -> str:
    """Text that ships with Python: the source of the ``textwrap`` module."""
    return Path(textwrap.__file__).read_text(encoding="utf-8")


def main(
    steps: int = 200, out: str = "char_lm_output", seed: int = 0, block: int = 32
) -> dict[str, str]:
    """Train the model, track it, save the log and the dashboard.

    Args:
        steps: Training steps (a test runs a handful).
        out: Output folder.
        seed: Random seed.
        block: Characters per training sequence.

    Returns:
        Paths of the log and the dashboard, and the coverage summary.
    """
    torch.manual_seed(seed)
    text = load_text()
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text])
    vocab = len(chars)
    model = extend(CharTransformer(vocab, block=block))
    loss_fn = extend(torch.nn.CrossEntropyLoss())
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    quantities = configuration("economy") + [
        Q.HessTrace(linear(10)),
        Q.HessMaxEV(linear(20)),
    ]
    cockpit = Cockpit(model.named_parameters(), quantities=quantities)
    generator = torch.Generator().manual_seed(seed)
    batch_size = 16

    # a progress bar on a terminal (disable=None), none in a log file or a test
    for step in tqdm(range(steps), desc="char_transformer", unit="step", disable=None):
        starts = torch.randint(
            0, len(data) - block - 1, (batch_size,), generator=generator
        )
        inputs = torch.stack([data[s : s + block] for s in starts])
        targets = torch.stack([data[s + 1 : s + block + 1] for s in starts])
        optimizer.zero_grad()
        with sdpa_kernel(SDPBackend.MATH):  # second derivatives for HessMaxEV
            logits = model(inputs)
        loss = loss_fn(logits.reshape(-1, vocab), targets.reshape(-1))
        losses = torch.nn.functional.cross_entropy(
            logits.transpose(1, 2), targets, reduction="none"
        ).mean(1)  # one loss per sequence
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
            cockpit.log(step, 0, loss.item(), None, None, None, None, None, 3e-3)

    logpath = cockpit.write(os.path.join(out, "log"))
    plotter = CockpitPlotter()
    plotter.plot(logpath, show_plot=False, plot_title="Character-level transformer")
    (dashboard,) = plotter.save(os.path.join(out, "dashboard.png"))
    return {
        "log": logpath,
        "dashboard": dashboard,
        "coverage": cockpit.coverage().summary(),
    }


if __name__ == "__main__":
    warnings.filterwarnings("ignore", "Full backward hook is firing")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--out", default="char_lm_output")
    args = parser.parse_args()
    for name, value in main(args.steps, args.out).items():
        print(f"{name}: {value}")
