"""Issue 37: every value that is defined is recorded, within the dtype's bound.

Each quantity of :mod:`cockpit.quantities.defined` on a small ReLU net and on a
Hugging Face BERT built from a config, against a float64 brute force written
here: the per-sample gradients by a plain autograd loop (one backward pass per
sample, in the model's dtype), every statistic from its definition in float64.
Cases: the 1.0.2 suite's toy problem (whose MeanGSNR and EarlyStopping were
refused), per-sample gradients equal to within float32's rounding, batch size 1,
gradients exactly zero, and gradients near float32's and bfloat16's largest
values. A value is within the bound its docstring states, or missing with a
reason this test shows is forced (the definition itself has no value).
"""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
from backpack import extend

from cockpit import Cockpit
from cockpit import quantities as Q
from cockpit.errors import CockpitWarning
from cockpit.utils.schedules import linear
from tests.utils import hf_models

KEYS = ["NormTest", "InnerTest", "OrthoTest", "Variance", "MeanGSNR",
        "EarlyStopping", "CABS"]  # fmt: skip
LR, EPSILON, ULPS = 0.1, 1e-5, 32
EPS32 = torch.finfo(torch.float32).eps


def _per_sample(model, forward, individual, targets):
    """``g_i`` of every sample by autograd, one backward pass each, float64.

    ``forward()`` gives the batch's logits, ``individual`` the per-sample losses;
    sample ``i``'s gradient is that of its own loss (a model without batch
    coupling), in the model's dtype.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    logits = forward()
    losses = individual(getattr(logits, "logits", logits), targets)
    rows = []
    for i in range(targets.shape[0]):
        grads = torch.autograd.grad(
            losses[i], params, retain_graph=True, allow_unused=True
        )
        grads = [torch.zeros_like(p) if g is None else g for g, p in zip(grads, params)]
        rows.append([g.detach().double().flatten() for g in grads])
    return [torch.stack([row[p] for row in rows]) for p in range(len(params))]


def _definitions(per_sample, loss):
    """Every statistic from its definition (float64); nan/inf where it has none."""
    G = torch.cat(per_sample, dim=1)
    n, d = G.shape
    g = G.mean(0)
    q = g @ g
    c = G - g
    v = (c**2).sum(0) / n
    s2 = (c**2).sum(0) / (n - 1) if n > 1 else torch.full_like(g, math.nan)
    along = (G @ g / q)[:, None] * g
    return {
        "NormTest": ((c**2).sum() / (n * (n - 1) * q)).sqrt(),
        "InnerTest": (((c @ g) ** 2).sum() / (n * (n - 1) * q**2)).sqrt(),
        "OrthoTest": (((G - along) ** 2).sum() / (n * (n - 1) * q)).sqrt(),
        "Variance": [(p - p.mean(0)).square().sum(1).mean() for p in per_sample],
        "MeanGSNR": (g**2 / (v + EPSILON)).mean() if n > 1 else torch.tensor(math.nan),
        "EarlyStopping": 1 - n / d * (g**2 / (s2 + EPSILON)).sum(),
        "CABS": LR * v.sum() / loss,
    }


def _bounds(per_sample, loss, eps):
    """The absolute error each docstring allows (``eps`` of the sums' dtype).

    NormTest, Variance and CABS: ``ULPS eps`` of the larger of the two sums whose
    difference is the spread; the gradient tests: the square root of that over
    their divisor; MeanGSNR and EarlyStopping (centred, two-pass): relative
    ``ULPS eps`` of each term, plus the spread's own rounding.
    """
    G = torch.cat(per_sample, dim=1)
    n = G.shape[0]
    g = G.mean(0)
    q = g @ g
    norms = G.norm(dim=1)
    big = ULPS * eps * (norms**2 + norms * g.norm() + q).sum()
    want = _definitions(per_sample, loss)
    denominator = n * max(n - 1, 1) * q
    gsnr = (g**2 / ((G - g) ** 2).mean(0).add(EPSILON)).mean()
    return {
        "NormTest": (big / denominator).sqrt(),
        "InnerTest": (big / denominator).sqrt() * norms.max() / g.norm(),
        "OrthoTest": (big / denominator).sqrt(),
        # two float32 computations of one g_i (BackPACK's, autograd's) agree to
        # about eps ||g_i|| of the whole model: a parameter whose gradient is
        # zero by structure (an attention key's bias) has variance of that size
        "Variance": [
            ULPS * eps * (p.square().sum(1).mean() + p.mean(0).square().sum())
            + (ULPS * eps * norms.max()) ** 2
            for p in per_sample
        ],
        "MeanGSNR": ULPS * eps * gsnr + 1e-30,
        "EarlyStopping": ULPS * eps * n * gsnr * 2 + 1e-30,
        "CABS": LR * big / n / loss,
        "want": want,
    }


def _check(values, bounds):
    want = bounds.pop("want")
    for key in KEYS:
        got = torch.as_tensor(values[key], dtype=torch.float64)
        ref = torch.as_tensor(want[key], dtype=torch.float64)
        allowed = torch.as_tensor(bounds[key], dtype=torch.float64) + 1e-4 * ref.abs()
        assert ((got - ref).abs() <= allowed).all(), (key, got, ref, allowed)


def _mlp(dtype):
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(5, 6), torch.nn.ReLU(), torch.nn.Linear(6, 3)
    ).to(dtype)


def _track(model, forward, loss_fn, targets, individual):
    """One tracked step with every quantity; values and CockpitWarnings."""
    quantities = [getattr(Q, key)(linear(1)) for key in KEYS]
    params = [p for p in model.parameters() if p.requires_grad]
    cockpit = Cockpit(params, quantities)
    opt = torch.optim.SGD(params, lr=LR)
    logits = forward()
    logits = getattr(logits, "logits", logits)
    loss = loss_fn(logits, targets)
    info = {"loss": loss, "batch_size": targets.shape[0], "optimizer": opt,
            "individual_losses": individual(logits, targets)}  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with cockpit(0, info=info):
            loss.backward()
    ours = [str(w.message) for w in caught if issubclass(w.category, CockpitWarning)]
    cockpit.close()
    return cockpit.get_output()[0], float(loss.detach()), ours


def _mlp_step(dtype, x, y, mse=False):
    reference = _mlp(dtype)
    model = extend(copy.deepcopy(reference))
    if mse:
        loss_fn, individual = torch.nn.MSELoss(), lambda o, t: ((o - t) ** 2).mean(1)
    else:
        loss_fn = torch.nn.CrossEntropyLoss()
        individual = torch.nn.CrossEntropyLoss(reduction="none")
    values, loss, ours = _track(model, lambda: model(x), extend(loss_fn), y, individual)
    per_sample = _per_sample(reference, lambda: reference(x), individual, y)
    return values, loss, ours, per_sample


def _nearly_equal(n, dtype, spread):
    torch.manual_seed(1)
    x = torch.randn(1, 5).repeat(n, 1)
    x = (x + spread * torch.randn(n, 5)).to(dtype)
    return x, torch.randint(0, 3, (1,)).repeat(n)


@pytest.mark.parametrize("seed", range(3))
def test_1_0_2_toy_problem_has_every_value(seed):
    """1.0.2's test_mean_gsnr / test_early_stopping problem: its toy net (ReLU,
    float32, batch 5, inputs in [0.1, 1.1)) trained for 5 SGD steps; MeanGSNR and
    EarlyStopping have a value at every step, equal to their definitions."""
    torch.manual_seed(seed)
    reference = torch.nn.Sequential(
        torch.nn.Flatten(), torch.nn.Linear(25, 4), torch.nn.ReLU(),
        torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 3),
    )  # fmt: skip
    model = extend(copy.deepcopy(reference))
    individual = torch.nn.CrossEntropyLoss(reduction="none")
    loss_fn = extend(torch.nn.CrossEntropyLoss())
    quantities = [Q.MeanGSNR(linear(1)), Q.EarlyStopping(linear(1))]
    cockpit = Cockpit(model.parameters(), quantities)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(5):
        x, y = torch.rand(5, 1, 5, 5) + 0.1, torch.randint(0, 3, (5,))
        opt.zero_grad()
        logits = model(x)
        loss = loss_fn(logits, y)
        info = {"loss": loss, "batch_size": 5, "optimizer": opt,
                "individual_losses": torch.nn.functional.cross_entropy(
                    logits, y, reduction="none")}  # fmt: skip
        with cockpit(step, info=info):
            loss.backward()
        per_sample = _per_sample(
            reference,
            lambda x=x: reference(x),
            individual,
            y,
        )
        want = _definitions(per_sample, float(loss.detach()))
        values = cockpit.get_output()[step]
        for key in ["MeanGSNR", "EarlyStopping"]:
            assert key in values, (step, values.get("missing"))
            assert math.isclose(values[key], want[key], rel_tol=1e-4, abs_tol=1e-6)
        opt.step()
        with torch.no_grad():
            for mine, theirs in zip(reference.parameters(), model.parameters()):
                mine.copy_(theirs)
    cockpit.close()


@pytest.mark.parametrize("spread", [0.0, 1e-7, 1e-3], ids=["equal", "1e-7", "1e-3"])
def test_mlp_float32_nearly_equal_samples(spread):
    """Per-sample gradients equal, or equal to within float32's rounding (inputs
    differing by 1e-7), or close: every value is defined and within its bound."""
    x, y = _nearly_equal(6, torch.float32, spread)
    values, loss, ours, per_sample = _mlp_step(torch.float32, x, y)
    assert "missing" not in values and not ours, (values.get("missing"), ours)
    _check(values, _bounds(per_sample, loss, EPS32))


@pytest.mark.parametrize("spread", [0.0, 1e-6, 1.0], ids=["equal", "1e-6", "random"])
def test_bert_float32(spread):
    """A Hugging Face BERT from a config: samples whose embeddings differ by
    ``spread`` (one token sequence, perturbed) and random token sequences."""
    case = hf_models.build("bert", dtype=torch.float32)
    reference = case.model
    if spread != 1.0:  # the embeddings are the inputs
        reference.bert.embeddings.word_embeddings.weight.requires_grad_(False)
    model = extend(copy.deepcopy(reference))
    n = 4
    kwargs, targets = case.inputs(n, 0)
    if spread != 1.0:
        ids, targets = kwargs["input_ids"][:1].repeat(n, 1), targets[:1].repeat(n)
        base = reference.bert.embeddings.word_embeddings(ids).detach()
        torch.manual_seed(5)
        kwargs = {"inputs_embeds": base + spread * torch.randn_like(base)}
    loss_fn = torch.nn.CrossEntropyLoss()
    individual = torch.nn.CrossEntropyLoss(reduction="none")
    values, loss, ours = _track(
        model, lambda: model(**kwargs), extend(loss_fn), targets, individual
    )
    per_sample = _per_sample(
        reference, lambda: reference(**kwargs), individual, targets
    )
    assert "missing" not in values and not ours, (values.get("missing"), ours)
    _check(values, _bounds(per_sample, loss, EPS32))


def _forced_missing(values, ours, keys, reason):
    for key in keys:
        assert key not in values, (key, values[key])
        assert values["missing"][key].startswith(reason), values["missing"][key]
        said = [m for m in ours if m.startswith(f"{key} has no value")]
        assert len(said) == 1 and "Fix" in said[0], (key, ours)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_batch_size_one_is_forced(dtype):
    """N = 1: each definition divides by N - 1 = 0 or is a spread of one sample
    (the brute force has no value); each quantity is missing, saying so."""
    x, y = torch.randn(1, 5).to(dtype), torch.tensor([1])
    values, loss, ours, per_sample = _mlp_step(dtype, x, y)
    want = _definitions(per_sample, loss)
    for key in ["NormTest", "InnerTest", "OrthoTest", "EarlyStopping"]:
        assert not math.isfinite(float(want[key])), key
    _forced_missing(values, ours, KEYS, "it needs at least 2 samples")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_zero_gradients(dtype):
    """Targets equal to the outputs (MSE): every g_i is exactly 0. The tests that
    divide by ||g|| (and CABS by the loss) have no value by their definitions
    (0/0 in the brute force); the variance and the signal-to-noise ratio of
    zeros are 0, EarlyStopping 1."""
    torch.manual_seed(2)
    x = torch.randn(6, 5).to(dtype)
    y = _mlp(dtype)(x).detach()
    values, loss, ours, per_sample = _mlp_step(dtype, x, y, mse=True)
    want = _definitions(per_sample, loss)
    assert loss == 0 and all((p == 0).all() for p in per_sample)
    for key in ["NormTest", "InnerTest", "OrthoTest", "CABS"]:
        assert math.isnan(float(want[key])), key
    _forced_missing(
        values, ours, ["NormTest", "InnerTest", "OrthoTest"], "the mini-batch grad"
    )
    assert values["missing"]["CABS"].startswith("the loss is zero")
    assert values["Variance"] == [0.0] * 4
    assert values["MeanGSNR"] == 0.0 and values["EarlyStopping"] == 1.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_near_the_dtype_largest_values(dtype):
    """Targets near 1e15 (MSE): the gradients are near 1e15 and ||g||^4 is far
    beyond float32's and bfloat16's range; every value is defined and within its
    bound (bfloat16 per-sample gradients are rounded to 8 bits, so the bound is
    that of bfloat16's precision)."""
    torch.manual_seed(3)
    x = torch.randn(6, 5).to(dtype)
    y = (1e15 * torch.randn(6, 3)).to(dtype)
    values, loss, ours, per_sample = _mlp_step(dtype, x, y, mse=True)
    assert "missing" not in values and not ours, (values.get("missing"), ours)
    eps = torch.finfo(dtype).eps
    bounds = _bounds(per_sample, loss, eps)
    if dtype == torch.bfloat16:  # the autograd loop rounds differently
        bounds = {k: v if k == "want" else _scaled(v, 8) for k, v in bounds.items()}
    _check(values, bounds)


def _scaled(bound, factor):
    if isinstance(bound, list):
        return [b * factor for b in bound]
    return bound * factor


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_squared_norms_beyond_the_dtype_are_forced(dtype):
    """One input times 2.5e10: the loss and .grad are finite, but that sample's
    squared gradient norm is not representable in float32 (the brute force's
    float32 value is inf); every quantity that reads it is missing, saying so."""
    torch.manual_seed(4)
    x = torch.randn(6, 5)
    x[0] *= 2.5e10
    x = x.to(dtype)
    y = torch.randn(6, 3).to(dtype)
    values, loss, ours, per_sample = _mlp_step(dtype, x, y, mse=True)
    assert math.isfinite(loss)
    squared = torch.cat(per_sample, dim=1)[0].float().square().sum()
    assert squared == math.inf
    _forced_missing(values, ours, KEYS, "the squared gradient norms are non-finite")
