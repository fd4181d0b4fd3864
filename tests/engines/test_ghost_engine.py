"""The ghost engine: per-sample statistics from layer inputs and output gradients.

Every value is checked against its definition: per-sample gradients from one plain
autograd backward pass per sample of a full forward pass (float64), and the
quantities recomputed from them (``tests/utils/any_model.py``), on Hugging Face
models built from small configs and on hand-written models with tied weights, a
layer called twice, a padding index, a broadcast position embedding and
normalisation layers.
"""

from __future__ import annotations

import functools
import gc
import warnings
import weakref

import numpy as np
import pytest
import torch

from cockpit import Cockpit
from cockpit import quantities as Q
from cockpit.engines import ghost
from cockpit.errors import CockpitWarning
from cockpit.per_sample import OuterProductGradients, OuterTerm
from cockpit.utils.schedules import linear
from tests.utils.any_model import alpha_reference, first_order_reference, per_sample
from tests.utils.harness import run
from tests.utils.problems import OPTIMIZERS, Problem

RTOL, ATOL = 1e-8, 1e-12
SCALARS = ["NormTest", "InnerTest", "OrthoTest", "MeanGSNR"]
PER_PARAMETER = ["GradNorm", "Variance"]
BINS, RANGE = 30, (-0.3, 0.3)
STEPS = 2


def close(actual, expected, what, rtol=RTOL):
    torch.testing.assert_close(
        torch.as_tensor(actual, dtype=torch.float64),
        torch.as_tensor(expected, dtype=torch.float64),
        rtol=rtol,
        atol=ATOL,
        msg=lambda m: f"{what}: {m}",
    )


# --- the factored representation ------------------------------------------------------
def _terms(seed=0, n=3):
    """Three uses of one ``[5, 4]`` weight: two dense, one indexed (an embedding)."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    return [
        OuterTerm(rand(n, 4, 5), rand(n, 4, 4)),
        OuterTerm(rand(n, 1, 5), rand(n, 1, 4)),
        OuterTerm(torch.randint(0, 5, (n, 6), generator=gen), rand(n, 6, 4), 5),
    ]


def _dense(terms):
    """``b_i`` by definition: the sum over terms and positions of outer products."""
    n = terms[0].cols.shape[0]
    out = torch.zeros(n, 5, 4, dtype=torch.float64)
    for term in terms:
        for i in range(n):
            for t in range(term.positions):
                rows = term.rows[i, t]
                if term.indexed:
                    rows = torch.nn.functional.one_hot(rows, 5).to(torch.float64)
                out[i] += torch.outer(rows, term.cols[i, t])
    return out


@pytest.mark.parametrize("subset", [[0], [2], [0, 1, 2]])
def test_statistics_from_the_factors_match_the_formed_gradients(subset):
    terms = [_terms()[k] for k in subset]
    b = _dense(terms)
    n, scale = b.shape[0], 3.0
    g = (b * scale).reshape(n, -1)
    direction = torch.randn(5, 4, dtype=torch.float64)
    individual = OuterProductGradients(terms, (5, 4), scale)
    close(individual.batch_l2(), (g * g).sum(1), "batch_l2")
    close(individual.gram(), g @ g.T, "gram")
    close(individual.project(direction), g @ direction.reshape(-1), "project")
    close(individual.mean(), g.mean(0).reshape(5, 4), "mean")
    close(
        individual.scaled_sum_grad_squared(), (g**2).sum(0).reshape(5, 4) / n**2, "sgs"
    )
    chunks = torch.cat(list(individual.chunks(20)))
    close(chunks, g.reshape(n, 5, 4), "chunks")
    assert not individual.dense  # nothing above kept the formed gradients
    individual.densify()
    close(individual.batch_l2(), (g * g).sum(1), "batch_l2 (dense)")
    close(individual.project(direction), g @ direction.reshape(-1), "project (dense)")
    total = b.sum(0)
    given = OuterProductGradients(terms, (5, 4), scale, total=total)
    close(given.mean(), total * scale / n, "mean from the given total")


def test_both_ways_of_norms_and_grams_are_taken_and_agree():
    gen = torch.Generator().manual_seed(1)
    long = OuterTerm(  # T^2 (R + C) > T R C: formed is cheaper
        torch.randn(2, 40, 3, generator=gen, dtype=torch.float64),
        torch.randn(2, 40, 2, generator=gen, dtype=torch.float64),
    )
    short = OuterTerm(  # factors cheaper
        torch.randn(2, 2, 30, generator=gen, dtype=torch.float64),
        torch.randn(2, 2, 20, generator=gen, dtype=torch.float64),
    )
    for term in (long, short):
        shape = (term.num_rows, term.cols.shape[-1])
        g = torch.stack([term.rows[i].T @ term.cols[i] for i in range(2)]).flatten(1)
        individual = OuterProductGradients([term], shape, 1.0)
        close(individual.batch_l2(), (g * g).sum(1), "batch_l2")
        close(individual.gram(), g @ g.T, "gram")
    assert long.dot_cost(long) > long.materialize_cost()
    assert short.dot_cost(short) < short.materialize_cost()


# --- models -------------------------------------------------------------------------
class Logits(torch.nn.Module):
    """A Hugging Face model called on token ids, returning its logits."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(input_ids=ids).logits


class Mixed(torch.nn.Module):
    """Every way the engine meets a parameter, in one model.

    A padding index, a position embedding broadcast over the samples, LayerNorm and
    RMSNorm, a layer called twice, a bias-free layer on plain ``[N, width]`` inputs,
    and an output layer tied to the token embedding and called twice (three uses
    of the table).
    """

    def __init__(self, vocab=7, width=6, length=5):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width, padding_idx=0)
        self.position = torch.nn.Embedding(length, width)
        self.norm = torch.nn.LayerNorm(width)
        self.shared = torch.nn.Linear(width, width)
        self.rms = torch.nn.RMSNorm(width)
        self.pool = torch.nn.Linear(width, width, bias=False)
        self.head = torch.nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        positions = self.position(torch.arange(tokens.shape[1])[None])
        h = self.embed(tokens) + positions
        h = h + torch.tanh(self.shared(self.norm(h)))
        h = self.rms(h + self.shared(torch.tanh(h)))
        per_token = self.head(h).mean(1)
        return per_token + self.head(torch.tanh(self.pool(h.mean(1))))


def _ce(outputs, targets):
    return torch.nn.functional.cross_entropy(outputs, targets, reduction="none")


def _sequence_ce(logits, targets):
    per_token = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), targets.flatten(), reduction="none"
    )
    return per_token.view(targets.shape).mean(1)


def _problem(name, model, make_batch, individual, n):
    return Problem(
        name=name,
        model=model.to(torch.float64),
        loss_fn=lambda out, y: individual(out, y).mean(),
        individual_loss_fn=individual,
        make_optimizer=OPTIMIZERS["momentum"],
        make_batch=make_batch,
        batch_size=n,
    )


def mixed_problem(n=4, seed=0):
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed + 1)

    def make_batch(step):
        tokens = torch.randint(0, 7, (n, 5), generator=gen)
        tokens[0, -1] = 0  # a padding token
        return tokens, torch.randint(0, 7, (n,), generator=gen)

    return _problem("mixed", Mixed(), make_batch, _ce, n)


def hf_problem(name, n=4, seed=0):
    pytest.importorskip("transformers")
    from tests.utils.hf_models import build

    case = build(name, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)

    def make_batch(step):
        inputs, targets = case.inputs(
            n, int(torch.randint(0, 1000, (1,), generator=gen))
        )
        return inputs["input_ids"], targets

    individual = _sequence_ce if name in ("gpt2", "llama") else _ce
    return _problem(name, Logits(case.model), make_batch, individual, n)


def first_order_quantities():
    every = linear(1)
    return [
        Q.GradNorm(every),
        Q.Variance(every),
        Q.NormTest(every),
        Q.InnerTest(every),
        Q.OrthoTest(every),
        Q.MeanGSNR(every),
        Q.GradHist1d(every, bins=BINS, range=RANGE),
        Q.Alpha(every),
    ]


def check_against_brute_force(problem, result, steps=STEPS):
    observed = {s: per_sample(problem, result.records[s]) for s in range(steps)}
    for step in range(steps):
        out, record = result.output[step], result.records[step]
        G, _ = observed[step]
        for name in SCALARS:
            if name in out:
                close(out[name], first_order_reference(name, G, record.params), name)
        for name in PER_PARAMETER:
            if name in out:
                want = torch.stack(first_order_reference(name, G, record.params))
                close(out[name], want, f"{name} step {step}")
        if "GradHist1d" in out:
            values = np.clip(G.reshape(-1).numpy(), *RANGE)
            counts, edges = np.histogram(values, bins=BINS, range=RANGE)
            near = np.abs(values[:, None] - edges[None, 1:-1]).min(axis=1) < 1e-9
            got = np.array(out["GradHist1d"]["hist"])
            assert got.sum() == counts.sum()
            assert np.abs(got - counts).sum() <= 2 * int(near.sum()), (got, counts)
    for step in range(steps - 1):
        if "Alpha" in result.output[step]:
            start, end = result.records[step], result.records[step + 1]
            want = alpha_reference(
                observed[step], observed[step + 1], start.params, end.params
            )
            close(result.output[step]["Alpha"], want, f"Alpha step {step}")


#: The engine's warnings are errors in these tests; the live diagnosis' are not its.
QUIET = functools.partial(Cockpit, diagnose=False)


def engines_of(cockpit):
    return [row.route.engine for row in cockpit.coverage().params]


@pytest.mark.parametrize("formed", ["at_once", "in_blocks"])
@pytest.mark.parametrize("name", ["mixed", "gpt2", "bert", "llama"])
def test_first_order_quantities_match_brute_force(name, formed, monkeypatch):
    """``in_blocks``: no parameter's per-sample gradients formed at once (as a
    layer beyond ``ghost.DENSE_MAX_ELEMENTS``): the histogram and MeanGSNR read
    blocks of samples."""
    densified = []
    original = OuterProductGradients.densify
    monkeypatch.setattr(
        OuterProductGradients,
        "densify",
        lambda self: densified.append(1) or original(self),
    )
    if formed == "in_blocks":
        monkeypatch.setattr(ghost, "DENSE_MAX_ELEMENTS", 0)
    problem = mixed_problem() if name == "mixed" else hf_problem(name)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CockpitWarning)
        result = run(problem, first_order_quantities(), steps=STEPS, cockpit_cls=QUIET)
    engines = engines_of(result.cockpit)
    assert result.cockpit.coverage().problems() == []
    assert set(engines) == {"ghost"}  # Llama's RMSNorm: checked w * f(x)
    assert bool(densified) == (formed == "at_once")
    check_against_brute_force(problem, result)


# --- what the engine declines -----------------------------------------------------
def _one_step(model, x, y, quantities, losses=True):
    cockpit = Cockpit(list(model.parameters()), quantities)
    out = model(x)
    loss = torch.nn.functional.cross_entropy(out, y)
    info = {"loss": loss}
    if losses:
        info["individual_losses"] = torch.nn.functional.cross_entropy(
            out, y, reduction="none"
        )
    with cockpit(0, info=info):
        loss.backward()
    return cockpit


class SequenceFirst(torch.nn.Module):
    """A Linear on ``[T, N, d]`` followed by a mean over time (T == N here)."""

    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Linear(3, 3)
        self.head = torch.nn.Linear(3, 2)

    def forward(self, x):  # x: [N, T, 3]
        h = torch.tanh(self.inner(x.transpose(0, 1)))  # [T, N, 3]
        return self.head(h.mean(0))


class ReadsWeight(torch.nn.Module):
    """A layer whose weight forward code also reads (a second, hidden use)."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(3, 2)

    def forward(self, x):
        return self.layer(x) + 0.1 * (x @ self.layer.weight.T)


class OffsetRMSNorm(torch.nn.Module):
    """Gemma's form ``(1 + w) * x_hat``: not ``w * f(x)``."""

    def __init__(self, width=3):
        super().__init__()
        self.weight = torch.nn.Parameter(0.1 * torch.randn(width))

    def forward(self, x):
        return (1 + self.weight) * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True))


class BeforeBatchNorm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(3, 4)
        self.norm = torch.nn.BatchNorm1d(4)
        self.head = torch.nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.norm(self.layer(x)))


def _declines(cockpit, index):
    return [d.message for d in cockpit.coverage().params[index].route.declines]


def test_layers_whose_samples_mix_or_whose_uses_hide_are_declined():
    torch.manual_seed(0)
    quantities = [Q.Variance(linear(1))]
    y = torch.randint(0, 2, (4,))
    model = SequenceFirst().double()
    cockpit = _one_step(model, torch.randn(4, 4, 3, dtype=torch.float64), y, quantities)
    assert engines_of(cockpit) == ["autograd", "autograd", "ghost", "ghost"]
    assert "not the sample axis" in _declines(cockpit, 0)[-1]
    x = torch.randn(4, 3, dtype=torch.float64)
    cockpit = _one_step(ReadsWeight().double(), x, y, quantities)
    assert engines_of(cockpit) == ["autograd", "ghost"]
    assert "used 2 times" in _declines(cockpit, 0)[-1]
    model = torch.nn.Sequential(OffsetRMSNorm(), torch.nn.Linear(3, 2)).double()
    cockpit = _one_step(model, x, y, quantities)
    assert engines_of(cockpit) == ["autograd", "ghost", "ghost"]
    assert "not its weight times a function" in _declines(cockpit, 0)[-1]
    with pytest.warns(CockpitWarning, match="batch norms"):
        cockpit = _one_step(BeforeBatchNorm().double(), x, y, quantities)
    assert engines_of(cockpit)[:2] == ["autograd", "autograd"]
    assert "samples mix through" in _declines(cockpit, 0)[-1]
    problem = mixed_problem()  # neither extended nor with per-sample losses
    with pytest.raises(RuntimeError, match="individual_losses"):
        _one_step(problem.model, *problem.make_batch(0), quantities, losses=False)


def test_variance_alone_forms_no_per_sample_gradient_and_nothing_stays(monkeypatch):
    formed = []
    original = OuterProductGradients.densify
    monkeypatch.setattr(
        OuterProductGradients,
        "densify",
        lambda self: formed.append(1) or original(self),
    )
    problem = mixed_problem()
    inputs = []
    problem.model.shared.register_forward_hook(
        lambda m, args, out: inputs.append(weakref.ref(args[0]))
    )
    result = run(problem, [Q.Variance(linear(1)), Q.NormTest(linear(1))], steps=2)
    assert formed == [] and set(engines_of(result.cockpit)) == {"ghost"}
    gc.collect()
    assert len(inputs) == 4 and all(ref() is None for ref in inputs)  # none kept
    run(mixed_problem(), [Q.GradHist1d(linear(1))], steps=1)
    assert formed  # the histogram reads the elements


def test_a_second_backward_pass_in_the_step_leaves_it_without_values():
    problem = mixed_problem()
    cockpit = Cockpit(problem.params, [Q.Variance(linear(1))])
    x, y = problem.make_batch(0)
    out = problem.model(x)
    losses = problem.individual_loss_fn(out, y)
    loss = losses.mean()
    with pytest.warns(CockpitWarning, match="several backward passes"):
        with cockpit(0, info={"loss": loss, "individual_losses": losses}):
            loss.backward(retain_graph=True)
            loss.backward()
    assert "Variance" in cockpit.get_output()[0]["missing"]


# --- a layer rule is an addition: it registers itself ---------------------------------
class Affine(torch.nn.Module):
    """``y = x * w + b`` elementwise over the last axis (no built-in rule has it)."""

    def __init__(self, width):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(width))
        self.bias = torch.nn.Parameter(torch.randn(width))

    def forward(self, x):
        return x * self.weight + self.bias


def test_a_registered_layer_rule_serves_its_module_exactly():
    from cockpit.engines import ghost

    @ghost.register_layer(Affine)
    class AffineLayer(ghost.Layer):
        params = ("weight", "bias")

        def term(self, module, attribute, x, delta):
            axes = tuple(range(1, delta.dim() - 1))
            if attribute == "weight":
                delta = delta * x
            return delta.sum(dim=axes) if axes else delta

    try:
        assert ghost.layer_of(Affine(3)) is ghost.LAYERS[Affine]
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(6, 5), Affine(5), torch.nn.Tanh(), torch.nn.Linear(5, 3)
        )
        gen = torch.Generator().manual_seed(1)

        def make_batch(step):
            x = torch.randn(4, 2, 6, generator=gen, dtype=torch.float64)
            return x, torch.randint(0, 3, (4,), generator=gen)

        def individual(out, y):
            return _ce(out.mean(1), y)

        problem = _problem("affine", model, make_batch, individual, 4)
        quantities = [Q.GradNorm(linear(1)), Q.Variance(linear(1))]
        result = run(problem, quantities, steps=STEPS, cockpit_cls=QUIET)
        assert engines_of(result.cockpit) == ["ghost"] * 6
        check_against_brute_force(problem, result)
    finally:
        del ghost.LAYERS[Affine]
    assert ghost.layer_of(Affine(3)) is None
