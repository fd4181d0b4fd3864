"""ParamView statistics and cockpit's BackPACK extensions against references."""

import pytest
import torch
from backpack import CTX, backpack, extend
from backpack.extensions import BatchGrad, DiagGGNExact, DiagGGNMC, DiagHessian

from cockpit import Cockpit
from cockpit.engines.backpack.api import extensions_for, merge_extensions
from cockpit.engines.backpack.rules import (
    PerSampleGradients,
    lean_diag_ggn_exact,
    lean_diag_ggn_mc,
    lean_diag_hessian,
)
from cockpit.needs import Need
from cockpit.per_sample import (
    DenseGradients,
    FactoredLinearGradients,
    LinearFactors,
)
from cockpit.quantities import PerParameter
from cockpit.quantities.base import Quantity
from cockpit.utils.schedules import linear
from tests.utils import brute_force as bf
from tests.utils import expected_warnings as expected
from tests.utils.harness import run
from tests.utils.problems import PROBLEM_IDS, PROBLEMS, Problem, make_problem

pytestmark = [expected.CREATE_GRAPH_CYCLE]

RTOL, ATOL = 1e-6, 1e-10
STEPS = 2


class Probe(Quantity):
    """Records every ParamView statistic of every parameter at every step."""

    def __init__(self, schedule, individual_first: bool, key=None):
        super().__init__(schedule, key=key)
        self.individual_first = individual_first
        self.records = {}
        self.directions = {}
        self.kinds = {}

    needs = frozenset({Need.INDIVIDUAL_GRADIENTS})

    def accumulate(self, global_step, view):
        self.kinds[view.index] = type(view._results.individual)
        direction = torch.randn(
            view.param.shape,
            dtype=view.param.dtype,
            generator=torch.Generator().manual_seed(view.index),
        )
        self.directions[view.index] = direction
        stats = {}
        if self.individual_first:
            stats["individual"] = view.individual_gradients().clone()
        # tiny blocks: several per parameter on every problem
        blocks = list(view.individual_gradient_chunks(max_elements=7))
        stats["blocks"] = [b.clone() for b in blocks]
        stats["batch_size"] = view.batch_size
        stats["mean"] = view.mean_gradient().clone()
        stats["batch_l2"] = view.batch_l2().clone()
        stats["gram"] = view.gram().clone()
        stats["sgs"] = view.sum_grad_squared().clone()
        stats["scaled_sgs"] = view.scaled_sum_grad_squared().clone()
        stats["project"] = view.project(direction).clone()
        if not self.individual_first:
            stats["individual"] = view.individual_gradients().clone()
        self.records.setdefault(global_step, {})[view.index] = stats

    def track_step(self, global_step, ctx):
        return []


def sequence_problem() -> Problem:
    """Linear layers applied to ``[N, L, in]`` inputs (extra axis between N and in)."""
    torch.manual_seed(3)
    n, length = 5, 3
    model = extend(
        torch.nn.Sequential(
            torch.nn.Linear(4, 6),
            torch.nn.Sigmoid(),
            torch.nn.Linear(6, 2),
            torch.nn.Flatten(),
        ).double()
    )
    generator = torch.Generator().manual_seed(4)

    def make_batch(step):
        x = torch.randn(n, length, 4, generator=generator, dtype=torch.float64)
        y = torch.randn(n, length * 2, generator=generator, dtype=torch.float64)
        return x, y

    return Problem(
        name="sequence-mse",
        model=model,
        loss_fn=extend(torch.nn.MSELoss()),
        individual_loss_fn=lambda out, y: ((out - y) ** 2).flatten(1).mean(1),
        make_optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
        make_batch=make_batch,
        batch_size=n,
    )


def conv_variety_problem() -> Problem:
    """Strided, dilated, padded and grouped convolutions (the last one falls back)."""
    torch.manual_seed(5)
    n = 4
    model = extend(
        torch.nn.Sequential(
            torch.nn.Conv2d(2, 4, 3, stride=2, padding=1),
            torch.nn.ReLU(),
            torch.nn.Conv2d(4, 4, 2, dilation=2, padding=(1, 0), bias=False),
            torch.nn.Sigmoid(),
            torch.nn.Conv2d(4, 2, 1, groups=2),
            torch.nn.Flatten(),
        ).double()
    )
    generator = torch.Generator().manual_seed(6)

    def make_batch(step):
        x = torch.randn(n, 2, 7, 6, generator=generator, dtype=torch.float64)
        y = torch.randint(0, 8, (n,), generator=generator)
        return x, y

    return Problem(
        name="conv-variety-ce",
        model=model,
        loss_fn=extend(torch.nn.CrossEntropyLoss()),
        individual_loss_fn=lambda out, y: torch.nn.functional.cross_entropy(
            out, y, reduction="none"
        ),
        make_optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
        make_batch=make_batch,
        batch_size=n,
    )


SPECIAL = {"sequence": sequence_problem, "conv-variety": conv_variety_problem}


def close(actual, expected, what):
    torch.testing.assert_close(
        actual, expected, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}"
    )


def check_against_brute_force(problem, probe, result):
    for step, per_param in probe.records.items():
        rec = result.records[step]
        individual = bf.individual_gradients(problem, rec.params, rec.x, rec.y)
        assert sorted(per_param) == list(range(len(individual)))
        for i, g in enumerate(individual):
            stats = per_param[i]
            what = f"step {step} param {i}"
            n = g.shape[0]
            flat = g.flatten(1)
            assert stats["batch_size"] == n
            close(stats["individual"], g, f"{what} individual")
            blocks = stats["blocks"]
            assert len(blocks) == -(-n // max(1, 7 // g[0].numel())), what
            assert torch.equal(torch.cat(blocks), stats["individual"]), what
            close(stats["mean"], g.mean(0), f"{what} mean")
            close(stats["batch_l2"], (flat**2).sum(1), f"{what} batch_l2")
            close(stats["gram"], flat @ flat.T, f"{what} gram")
            close(stats["sgs"], (g**2).sum(0), f"{what} sum_grad_squared")
            close(stats["scaled_sgs"], (g**2).sum(0) / n**2, f"{what} scaled sgs")
            expected = flat @ probe.directions[i].reshape(-1)
            close(stats["project"], expected, f"{what} project")


@pytest.mark.parametrize("individual_first", [False, True], ids=["stats", "indiv"])
@pytest.mark.parametrize(
    "setting",
    PROBLEMS[:3] + [(name,) for name in SPECIAL],
    ids=PROBLEM_IDS[:3] + list(SPECIAL),
)
def test_view_statistics(setting, individual_first):
    if setting[0] in SPECIAL:
        problem = SPECIAL[setting[0]]()
    else:
        problem = make_problem(*setting)
    probe = Probe(linear(1), individual_first)
    result = run(problem, [probe], steps=STEPS)
    assert len(probe.records) == STEPS
    check_against_brute_force(problem, probe, result)
    # Linear weights arrive as factors, everything else as tensors
    linear_weights = {
        i
        for i, p in enumerate(problem.params)
        if any(
            p is m.weight
            for m in problem.model.modules()
            if type(m).__name__ == "Linear"
        )
    }
    assert linear_weights or setting[0] == "conv-variety"
    for i, kind in probe.kinds.items():
        assert (kind is FactoredLinearGradients) == (i in linear_weights), (i, kind)


@pytest.mark.parametrize("pairwise_factored", [False, True])
def test_linear_factors_both_branches(monkeypatch, pairwise_factored):
    """The factored and the materialising branch of every statistic agree."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 3, 5, generator=gen, dtype=torch.float64)
    delta = torch.randn(4, 3, 2, generator=gen, dtype=torch.float64)
    factors = LinearFactors(x, delta)
    b = torch.einsum("nlo,nli->noi", delta, x)
    flat = b.flatten(1)
    monkeypatch.setattr(
        LinearFactors,
        "_materialize_is_cheaper",
        lambda self, pairwise: not pairwise_factored,
    )
    close(factors.materialize(), b, "materialize")
    close(factors.materialize(scale=4.0), 4 * b, "materialize scaled")
    close(factors.sum(), b.sum(0), "sum")
    close(factors.batch_l2(), (flat**2).sum(1), "batch_l2")
    close(factors.gram(), flat @ flat.T, "gram")
    close(factors.sum_grad_squared(), (b**2).sum(0), "sum_grad_squared")
    direction = torch.randn(2, 5, generator=gen, dtype=torch.float64)
    close(factors.project(direction), flat @ direction.reshape(-1), "project")
    assert factors.shape == b.shape


def test_user_batch_grad_serves_the_cockpit():
    """A user's own BatchGrad() replaces the cockpit's extension; its output stays."""
    assert PerSampleGradients.served_by(BatchGrad())
    assert not PerSampleGradients.served_by(BatchGrad(subsampling=[0]))
    ours = extensions_for({Need.GRAM})
    assert [type(e) for e in ours] == [PerSampleGradients]
    user = BatchGrad()
    assert merge_extensions([user], ours) == [user]
    # a quantity asking for BatchGrad itself also replaces ours
    theirs = BatchGrad()
    assert merge_extensions([], ours + [theirs]) == [theirs]
    with pytest.raises(ValueError, match="Conflicting"):
        merge_extensions([BatchGrad(subsampling=[0])], ours)

    problem = make_problem("cnn", "ce")
    probe = Probe(linear(1), individual_first=False)
    cockpit = Cockpit(problem.params, [probe])
    x, y = problem.make_batch(0)
    loss = problem.loss_fn(problem.model(x), y)
    with cockpit(0, BatchGrad(), info={}):
        assert [type(e) for e in CTX.get_active_exts()] == [BatchGrad]
        loss.backward()
    assert all(isinstance(p.grad_batch, torch.Tensor) for p in problem.params)
    assert set(probe.kinds.values()) == {DenseGradients}
    individual = bf.individual_gradients(problem, problem.params, x, y)
    for i, g in enumerate(individual):
        close(probe.records[0][i]["gram"], g.flatten(1) @ g.flatten(1).T, f"gram {i}")


@pytest.mark.parametrize(
    "make_lean,original",
    [
        (lean_diag_hessian, DiagHessian),
        (lean_diag_ggn_exact, DiagGGNExact),
        (lean_diag_ggn_mc, DiagGGNMC),
    ],
    ids=["diag_h", "diag_ggn_exact", "diag_ggn_mc"],
)
@pytest.mark.parametrize("setting", ["cnn", "conv-variety"])
def test_lean_curvature_matches_backpack(make_lean, original, setting):
    """The memory-lean Conv2d rule gives BackPACK's curvature diagonals."""
    if setting == "cnn":
        problem = make_problem("cnn", "ce")
    else:
        problem = conv_variety_problem()
    x, y = problem.make_batch(0)
    results = []
    for extension in (make_lean(), original()):
        assert type(extension) is original
        torch.manual_seed(7)  # the same Monte-Carlo sample for both
        loss = problem.loss_fn(problem.model(x), y)
        with backpack(extension):
            loss.backward()
        results.append([getattr(p, extension.savefield) for p in problem.params])
        for p in problem.params:
            delattr(p, extension.savefield)
            p.grad = None
    for lean, reference in zip(*results):
        torch.testing.assert_close(lean, reference, rtol=1e-10, atol=1e-12)
    # a user's own extension of the same kind merges with the lean one
    user = original()
    assert merge_extensions([user], [make_lean()]) == [user]


class GraphProbe(Quantity):
    """Records whether what the view shows carries an autograd graph."""

    def __init__(self, schedule):
        super().__init__(schedule)
        self.seen = []
        self.grams = {}

    needs = frozenset({Need.INDIVIDUAL_GRADIENTS, Need.DIAG_H})
    Accumulator = PerParameter

    def accumulate(self, global_step, view):
        stats = [view.individual_gradients(), view.gram(), view.batch_l2()]
        stats.append(view.curvature("diag_h"))
        stats.append(view.param * 2)  # quantity code reading the parameter
        self.seen.append([t.requires_grad for t in stats])
        self.acc.entries[view.index] = view.gram().clone()
        self.grams[view.index] = self.acc.entries[view.index]

    def track_step(self, global_step, ctx):
        return []


@pytest.mark.parametrize("create_graph", [False, True])
def test_no_graph_through_cockpit_results(create_graph):
    """Under create_graph=True (HessMaxEV) the statistics record no graph."""
    problem = make_problem("cnn", "ce")
    probe = GraphProbe(linear(1))
    cockpit = Cockpit(problem.params, [probe])
    x, y = problem.make_batch(0)
    loss = problem.loss_fn(problem.model(x), y)
    with cockpit(0, info={}):
        loss.backward(create_graph=create_graph)
    assert probe.seen and not any(any(flags) for flags in probe.seen)
    individual = bf.individual_gradients(problem, problem.params, x, y)
    for i, g in enumerate(individual):
        close(probe.grams[i], g.flatten(1) @ g.flatten(1).T, f"gram {i}")
