"""The Monte-Carlo GGN of ``cockpit/curvature/ggn.py`` against the dense float64 GGN.

The GGN is formed from its definition, ``sum_r c_r J_r^T (diag p_r - p_r p_r^T) J_r``
with the full Jacobian ``J_r`` of the logits (``torch.func.jacrev``) and the row
weights of a mean cross-entropy (``c_r = 1 / rows``, label smoothing included),
independently of how the estimator reads its loss.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call, jacrev

from cockpit.curvature.ggn import NotCrossEntropy, exact_ggn, monte_carlo_ggn


class TokenModel(nn.Module):
    """Embedding, a tanh layer and a head: logits ``[batch, length, vocab]``."""

    def __init__(self, vocab=5, width=4):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.hidden = nn.Linear(width, width)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens):
        return self.head(torch.tanh(self.hidden(self.embed(tokens))))


def _setup(kind):
    torch.manual_seed(3)
    if kind == "mlp":
        model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 4)).double()
        x, y = torch.randn(6, 3, dtype=torch.float64), torch.randint(0, 4, (6,))

        def loss_of(logits):
            return nn.functional.cross_entropy(logits, y)

        return model, x, loss_of, 0.0
    model = TokenModel().double()
    x, y = torch.randint(0, 5, (2, 3)), torch.randint(0, 5, (2, 3))

    def loss_of(logits):  # a sequence loss with the classes in dimension 1
        return nn.functional.cross_entropy(
            logits.transpose(1, 2), y, label_smoothing=0.1
        )

    return model, x, loss_of, 0.1


def _dense_ggn(model, x):
    """The GGN of the mean cross-entropy over all rows, from its definition."""
    names = [n for n, _ in model.named_parameters()]
    values = [p.detach() for _, p in model.named_parameters()]

    def logits(*flat):
        return functional_call(model, dict(zip(names, flat, strict=True)), (x,))

    out = logits(*values)
    classes = out.shape[-1]
    jac = jacrev(logits, argnums=tuple(range(len(values))))(*values)
    rows = out.numel() // classes
    J = torch.cat([j.reshape(rows, classes, -1) for j in jac], dim=2)
    p = out.reshape(rows, classes).softmax(-1)
    middle = torch.diag_embed(p) - p.unsqueeze(2) * p.unsqueeze(1)
    return torch.einsum("rcd,rce,ref->df", J, middle, J) / rows


@pytest.mark.parametrize("kind", ["mlp", "tokens"])
def test_monte_carlo_ggn_against_the_dense_ggn(kind):
    model, x, loss_of, _ = _setup(kind)
    params = list(model.parameters())
    exact = _dense_ggn(model, x)
    diag_exact = exact.diagonal()
    sizes = [p.numel() for p in params]
    block_exact = torch.stack([b.sum() for b in diag_exact.split(sizes)])

    # one estimate with many draws: each block's trace and the sum within 4 reported
    # standard errors (the spread of the draws' traces)
    many = 200
    est = monte_carlo_ggn(
        loss_of(model(x)), params, many, torch.Generator().manual_seed(9), chunk=40
    )
    se_blocks = est.traces.std(0) / many**0.5
    assert ((est.traces.mean(0) - block_exact).abs() <= 4 * se_blocks).all()
    se_sum = est.traces.sum(1).std() / many**0.5
    assert (est.traces.sum(1).mean() - diag_exact.sum()).abs() <= 4 * se_sum
    assert se_sum < 0.1 * diag_exact.sum()  # and the test can tell a wrong sum

    repeats, samples = 60, 4
    diagonals, totals, reported = [], [], []
    for seed in range(repeats):
        loss = loss_of(model(x))
        gen = torch.Generator().manual_seed(seed)
        est = monte_carlo_ggn(loss, params, samples, gen)
        assert est.traces.shape == (samples, len(params))
        diag = torch.cat([d.reshape(-1) for d in est.diagonals])
        # each draw's block traces average to the diagonal's block sums
        assert torch.allclose(
            est.traces.mean(0), torch.stack([b.sum() for b in diag.split(sizes)])
        )
        diagonals.append(diag)
        totals.append(est.traces.sum(1).mean())
        reported.append(est.traces.sum(1).std() / samples**0.5)
    diagonals, totals = torch.stack(diagonals), torch.stack(totals)
    reported = torch.stack(reported)

    # unbiased: the mean over repetitions within 4 standard errors, entry by entry
    mean, spread = diagonals.mean(0), diagonals.std(0) / repeats**0.5
    assert ((mean - diag_exact).abs() <= 4 * spread + 1e-12).all()
    assert (totals.mean() - diag_exact.sum()).abs() <= 4 * totals.std() / repeats**0.5
    # the reported standard error is the spread of repeated estimates
    ratio = float(reported.pow(2).mean().sqrt() / totals.std())
    assert 0.75 < ratio < 1.33, ratio


def test_a_loss_that_is_not_a_cross_entropy_is_refused():
    model, x, loss_of, _ = _setup("mlp")
    params = list(model.parameters())
    gen = torch.Generator().manual_seed(0)
    out = model(x)
    with pytest.raises(NotCrossEntropy, match="log_softmax"):
        monte_carlo_ggn((out**2).mean(), params, 2, gen)
    with pytest.raises(NotCrossEntropy, match="penalty"):
        penalty = loss_of(out) + sum((p**2).sum() for p in params)
        monte_carlo_ggn(penalty, params, 2, gen)
    with pytest.raises(NotCrossEntropy, match="not linear"):
        log_p = out.log_softmax(1)
        monte_carlo_ggn((log_p**2).mean(), params, 2, gen)


@pytest.mark.parametrize("kind", ["mlp", "tokens"])
def test_exact_ggn_equals_the_dense_ggn(kind):
    """One product per row and class: the GGN's diagonal exactly (label smoothing
    and all), as a single row of block traces."""
    model, x, loss_of, _ = _setup(kind)
    params = list(model.parameters())
    diag_exact = _dense_ggn(model, x).diagonal()
    est = exact_ggn(loss_of(model(x)), params, chunk=5)
    got = torch.cat([d.reshape(-1) for d in est.diagonals])
    torch.testing.assert_close(got, diag_exact, rtol=1e-10, atol=1e-14)
    sizes = [p.numel() for p in params]
    blocks = torch.stack([b.sum() for b in diag_exact.split(sizes)])
    torch.testing.assert_close(est.traces, blocks.unsqueeze(0), rtol=1e-10, atol=0)
    rows = x.shape[0] * (x.shape[1] if kind == "tokens" else 1)
    assert est.products == rows * model(x).shape[-1]
