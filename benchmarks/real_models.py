"""The realistic models of the speed goals, shared by the benchmarks.

* :func:`gpt2`: Hugging Face GPT-2 built from a config (no download): 6 layers,
  width 384, 6 heads, vocabulary 2048, sequence 128, about 11.5M parameters,
  attention ``"eager"`` (math) or the library default ``"sdpa"``. ``transformers``
  is a benchmark extra.
* :func:`resnet18`: the ResNet-18 layout (a 3x3 stem, four stages of two basic
  blocks, widths ``w, 2w, 4w, 8w``) on 32x32 images, BatchNorm in train mode by
  default, GroupNorm as the twin that mixes no samples. The residual is added in
  place (``out += identity``), as torchvision's ``BasicBlock`` does.

Each returns a :class:`Workload`: the model, a batch maker and the 1.0.2 loop's
losses (a mean-reduced loss for ``backward`` and the per-sample losses).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn


@dataclass
class Workload:
    """A model with its data and the losses of the 1.0.2 loop.

    Attributes:
        name: Short name for tables.
        model: The model, in train mode.
        batch: ``batch(n, seed) -> (inputs, targets)``; ``model(inputs)`` runs it.
        logits: ``model output -> tensor`` the losses read.
        loss_fn: Mean-reduced loss ``(logits, targets) -> scalar``.
        individual_loss_fn: ``(logits, targets) -> [N]``.
    """

    name: str
    model: nn.Module
    batch: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]
    logits: Callable[[object], torch.Tensor]
    loss_fn: nn.Module
    individual_loss_fn: nn.Module

    @property
    def parameters(self) -> int:
        """Number of trainable parameter entries (tied tensors counted once)."""
        return sum(p.numel() for p in self.model.parameters() if p.requires_grad)


class TokenLoss(nn.Module):
    """Next-token cross-entropy of ``[N, T, V]`` logits, averaged per sample."""

    def __init__(self, reduction: str = "mean"):
        super().__init__()
        self.reduction = reduction

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        per_token = nn.functional.cross_entropy(
            logits.flatten(0, 1), targets.flatten(), reduction="none"
        )
        per_sample = per_token.view(targets.shape).mean(1)
        return per_sample.mean() if self.reduction == "mean" else per_sample


def gpt2(
    layers: int = 6,
    width: int = 384,
    heads: int = 6,
    vocab: int = 2048,
    length: int = 128,
    attention: str = "eager",
    seed: int = 0,
) -> Workload:
    """GPT-2 language model of the issue's size (11.5M parameters by default)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=vocab,
        n_positions=length,
        n_embd=width,
        n_layer=layers,
        n_head=heads,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    config._attn_implementation = attention
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(config).train()

    def batch(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, vocab, (n, length + 1), generator=gen)
        return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()

    return Workload(
        "gpt2", model, batch, lambda out: out.logits, TokenLoss(), TokenLoss("none")
    )


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with normalisation and an in-place residual add."""

    def __init__(self, inputs: int, outputs: int, stride: int, norm, inplace: bool):
        super().__init__()
        self.conv1 = nn.Conv2d(inputs, outputs, 3, stride, 1, bias=False)
        self.bn1 = norm(outputs)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(outputs, outputs, 3, 1, 1, bias=False)
        self.bn2 = norm(outputs)
        self.inplace = inplace
        self.downsample = None
        if stride != 1 or inputs != outputs:
            self.downsample = nn.Sequential(
                nn.Conv2d(inputs, outputs, 1, stride, bias=False), norm(outputs)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.inplace:
            out += identity
        else:
            out = out + identity
        return self.relu(out)


class ResNet18(nn.Module):
    """ResNet-18 layout for 32x32 images: stem, 4 stages x 2 blocks, linear head."""

    def __init__(self, width=16, classes=10, norm: str = "batch", inplace=True):
        super().__init__()

        def make_norm(channels: int) -> nn.Module:
            if norm == "batch":
                return nn.BatchNorm2d(channels)
            return nn.GroupNorm(min(8, channels), channels)

        widths = [width, 2 * width, 4 * width, 8 * width]
        self.stem = nn.Sequential(
            nn.Conv2d(3, width, 3, 1, 1, bias=False), make_norm(width), nn.ReLU()
        )
        blocks, inputs = [], width
        for stage, outputs in enumerate(widths):
            for index in range(2):
                stride = 2 if stage > 0 and index == 0 else 1
                blocks.append(BasicBlock(inputs, outputs, stride, make_norm, inplace))
                inputs = outputs
        self.blocks = nn.Sequential(*blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(inputs, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.pool(self.blocks(self.stem(x))).flatten(1))


def resnet18(
    width: int = 16, norm: str = "batch", inplace: bool = True, seed: int = 0
) -> Workload:
    """ResNet-18 layout (BatchNorm, or ``norm="group"``) on 32x32 RGB images."""
    torch.manual_seed(seed)
    model = ResNet18(width, norm=norm, inplace=inplace).train()

    def batch(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        images = torch.randn(n, 3, 32, 32, generator=gen)
        return images, torch.randint(0, 10, (n,), generator=gen)

    return Workload(
        f"resnet18-{norm}",
        model,
        batch,
        lambda out: out,
        nn.CrossEntropyLoss(),
        nn.CrossEntropyLoss(reduction="none"),
    )
