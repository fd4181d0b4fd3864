"""A hand-written causal transformer for the curvature tests and benchmarks.

Forward code BackPACK has never seen: a raw position parameter, an output layer
tied to the embedding, and ``F.scaled_dot_product_attention`` (the fused kernel by
default) called in ``forward``. Small enough (426 parameters) for a dense float64
Hessian.
"""

from __future__ import annotations

import torch

from tests.utils import hf_models


class TinyGPT(torch.nn.Module):
    """A one-block causal transformer (see the module)."""

    def __init__(self, vocab=7, width=6, heads=2, length=5):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.position = torch.nn.Parameter(0.3 * torch.randn(length, width))
        self.norm1 = torch.nn.LayerNorm(width)
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.proj = torch.nn.Linear(width, width)
        self.norm2 = torch.nn.LayerNorm(width)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(width, 2 * width), torch.nn.GELU(),
            torch.nn.Linear(2 * width, width),
        )  # fmt: skip
        self.heads = heads

    def forward(self, input_ids):
        n, t = input_ids.shape
        x = self.embed(input_ids) + self.position[:t]
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        q, k, v = (z.view(n, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(n, t, -1))
        x = x + self.mlp(self.norm2(x))
        return x @ self.embed.weight.T  # tied output layer


def tiny_gpt() -> hf_models.Case:
    """The model (seeded by the caller) with its batches and sequence losses."""

    def inputs(n, seed):
        gen = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, 7, (n, 5), generator=gen)
        return {"input_ids": ids}, torch.roll(ids, -1, dims=1)

    return hf_models.Case(
        "tiny-gpt", TinyGPT(), inputs, lambda out: out,
        hf_models.SequenceLoss(), hf_models.SequenceLoss("none"),
    )  # fmt: skip
