"""Layers with tied weights keep nothing for BackPACK between forward and backward.

BackPACK serves no tied parameter (another engine does), so ``backpack.extend``'s
forward hook, which stores a layer's input and output on the module until its
backward hook runs, only kept a language model head's logits (``N x T x V``
numbers) alive for nothing. Cockpit takes BackPACK's hooks off such layers; the
per-sample results stay those of their definition.
"""

from __future__ import annotations

import pytest
import torch
from backpack import extend

from cockpit import Cockpit
from cockpit import quantities as Q
from cockpit.utils.schedules import linear


def _stored(module) -> list[str]:
    return [n for n in vars(module) if n == "output" or n.startswith("input")]


class TiedHead(torch.nn.Module):
    """A token embedding, a LayerNorm and an output layer tied to the embedding."""

    def __init__(self, vocab=7, width=5):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.norm = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        return self.head(torch.tanh(self.norm(self.embed(tokens)))).mean(1)


def _per_sample_norms(model, tokens, targets):
    """``||g_i||^2`` per sample and parameter, one backward pass per sample."""
    rows = []
    for i in range(tokens.shape[0]):
        loss = torch.nn.functional.cross_entropy(
            model(tokens[i : i + 1]), targets[i : i + 1]
        )
        grads = torch.autograd.grad(loss, list(model.parameters()))
        rows.append([float((g**2).sum()) for g in grads])
    return torch.tensor(rows, dtype=torch.float64)


def test_tied_layers_store_nothing_and_results_stay_exact():
    torch.manual_seed(0)
    model = extend(TiedHead().double())
    tokens = torch.randint(0, 7, (4, 3))
    targets = torch.randint(0, 7, (4,))
    cockpit = Cockpit(model.parameters(), [Q.Variance(linear(1))])
    outputs = model(tokens)
    assert _stored(model.head) == [] and _stored(model.embed) == []
    assert "output" in _stored(model.norm)  # BackPACK serves the LayerNorm
    losses = torch.nn.functional.cross_entropy(outputs, targets, reduction="none")
    loss = losses.mean()
    with cockpit(0, info={"loss": loss, "individual_losses": losses}):
        loss.backward()
    engines = dict(cockpit.coverage().engines())
    assert engines == {"backpack": 2, "ghost": 1}
    norms = _per_sample_norms(model, tokens, targets)
    mean = norms.new_tensor([float((p.grad**2).sum()) for p in model.parameters()])
    expected = norms.mean(0) - mean  # (1/N) sum_i ||g_i||^2 - ||g||^2, per tensor
    got = torch.as_tensor(cockpit.get_output()[0]["Variance"], dtype=torch.float64)
    torch.testing.assert_close(got, expected)


def test_gpt2_head_and_token_embedding_keep_no_logits():
    pytest.importorskip("transformers")
    from tests.utils.hf_models import build

    case = build("gpt2")
    model = extend(case.model)
    # kept: a dropped cockpit gives the model back as it was (BackPACK's hooks too)
    cockpit = Cockpit(model.parameters(), [Q.Variance(linear(1))])
    kwargs, _ = case.batch(4, 0)
    model(**kwargs)
    assert _stored(model.lm_head) == []
    assert _stored(model.transformer.wte) == []
    assert "output" in _stored(model.transformer.ln_f)
    cockpit.close()
