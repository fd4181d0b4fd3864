"""Any differentiable model: first-order quantities against brute force (float64).

The models (``tests/utils/any_model.py``) mix layers BackPACK has rules for with
LayerNorm, RMSNorm, GroupNorm, MultiheadAttention, LSTM in the sequence-first
layout, GRU, raw parameters, custom modules and weight tying; the 1.0.2 training
loop runs unchanged and every value is compared with per-sample autograd loops.
"""

import math
import warnings

import numpy as np
import pytest
import torch

from cockpit import Cockpit
from cockpit import quantities as Q
from cockpit.engines.autograd import per_sample_gradients
from cockpit.engines.coverage import CoverageError
from cockpit.errors import CockpitWarning
from cockpit.utils.schedules import linear
from tests.utils.any_model import (
    ARCHITECTURES,
    _inplace_cnn,
    alpha_reference,
    first_order_reference,
    make_any_problem,
    per_sample,
)
from tests.utils.harness import run
from tests.utils.problems import make_problem

STEPS = 3
RTOL, ATOL = 1e-6, 1e-10
SCALARS = ["NormTest", "InnerTest", "OrthoTest", "MeanGSNR"]
PER_PARAMETER = ["GradNorm", "Variance"]
BINS, RANGE = 30, (-0.3, 0.3)
#: Models whose layers all have rules (cockpit's own for the normalisation layers).
BACKPACK_ONLY = {
    "resnet-bn-eval",
    "rmsnorm-mlp",
    "lstm-batch-first",
    "cnn-inplace-relu",
}


def close(actual, expected, what):
    torch.testing.assert_close(
        torch.as_tensor(actual, dtype=torch.float64),
        torch.as_tensor(expected, dtype=torch.float64),
        rtol=RTOL,
        atol=ATOL,
        msg=lambda m: f"{what}: {m}",
    )


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


def reference_histogram(G):
    """numpy's histogram of the clamped values, and how many lie at an edge."""
    values = np.clip(G.reshape(-1).numpy(), *RANGE)
    counts, edges = np.histogram(values, bins=BINS, range=RANGE)
    inner = edges[1:-1]
    near = np.abs(values[:, None] - inner[None, :]).min(axis=1) < 1e-9
    return counts, int(near.sum())


def quiet_per_sample(problem, record):
    with warnings.catch_warnings():  # torch's note on hooks of frozen inputs
        warnings.simplefilter("ignore", UserWarning)
        return per_sample(problem, record)


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_first_order_quantities_match_brute_force(arch):
    problem = make_any_problem(arch)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CockpitWarning)  # nothing to warn about
        warnings.filterwarnings("ignore", "Cockpit set inplace=False")  # but this
        # and the live diagnosis, which judges the run (random data on random
        # weights, where many gradient elements pass the histogram's edges)
        warnings.filterwarnings("ignore", "cockpit diagnosis")
        result = run(problem, first_order_quantities(), steps=STEPS)
    coverage = result.cockpit.coverage()
    assert coverage.problems() == []
    engines = {"backpack"} if arch in BACKPACK_ONLY else {"autograd", "backpack"}
    if arch == "tied-custom":  # the tied output layer: the ghost engine
        engines.add("ghost")
    assert set(coverage.engines()) == engines
    observed = {s: quiet_per_sample(problem, result.records[s]) for s in range(STEPS)}
    for step in range(STEPS):
        out, record = result.output[step], result.records[step]
        G, _ = observed[step]
        for name in SCALARS:
            close(out[name], first_order_reference(name, G, record.params), name)
        for name in PER_PARAMETER:
            want = torch.stack(first_order_reference(name, G, record.params))
            close(out[name], want, f"{name} step {step}")
        counts, at_edges = reference_histogram(G)
        got = np.array(out["GradHist1d"]["hist"])
        assert got.sum() == counts.sum()
        assert np.abs(got - counts).sum() <= 2 * at_edges, (got, counts)
    for step in range(STEPS - 1):
        start, end = result.records[step], result.records[step + 1]
        want = alpha_reference(
            observed[step], observed[step + 1], start.params, end.params
        )
        close(result.output[step]["Alpha"], want, f"Alpha step {step}")


def _routes(cockpit):
    return [row.route for row in cockpit.coverage().params]


def test_each_parameter_goes_to_the_engine_with_a_rule_for_it():
    problem = make_any_problem("transformer")
    names = [name for name, _ in problem.model.named_parameters()]
    cockpit = run(problem, [Q.Variance(linear(1))], steps=1).cockpit
    engines = {name: r.engine for name, r in zip(names, _routes(cockpit))}
    assert {n for n, e in engines.items() if e == "backpack"} == {
        "embed.weight",
        "norm1.weight",
        "norm1.bias",
        "norm2.weight",
        "norm2.bias",
        "mlp.0.weight",
        "mlp.0.bias",
        "mlp.2.weight",
        "mlp.2.bias",
        "head.weight",
        "head.bias",
    }
    reasons = {name: r.reason for name, r in zip(names, _routes(cockpit))}
    assert "no rule for MultiheadAttention" in reasons["attention.in_proj_weight"]
    assert "no rule for TransformerBlock" in reasons["position"]


def test_sequence_first_layouts_and_tying_are_detected():
    problem = make_any_problem("lstm-seq-first")  # T == N: only the probe can tell
    routes = _routes(run(problem, [Q.Variance(linear(1))], steps=1).cockpit)
    backpack = routes[0].declines[0].message  # BackPACK's LSTM rule
    assert "Batch axis must be first" in backpack
    assert "not the sample axis" in routes[4].reason  # Linear on [T, N, H]
    assert [r.engine for r in routes[6:]] == ["backpack", "backpack"]
    problem = make_any_problem("tied-custom")
    routes = _routes(run(problem, [Q.Variance(linear(1))], steps=1).cockpit)
    assert "tied: owned by Embedding.weight and Linear.weight" in routes[1].reason


def test_a_layer_called_twice_is_left_to_the_ghost_engine():
    torch.manual_seed(0)
    layer = torch.nn.Linear(3, 3).double()
    head = torch.nn.Linear(3, 2).double()

    class Twice(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer, self.head = layer, head

        def forward(self, x):
            return self.head(torch.tanh(self.layer(torch.tanh(self.layer(x)))))

    from backpack import extend

    model = extend(Twice())
    cockpit = Cockpit(model.parameters(), [Q.Variance(linear(1))])
    x, y = torch.randn(5, 3, dtype=torch.float64), torch.randint(0, 2, (5,))
    out = model(x)
    loss = extend(torch.nn.CrossEntropyLoss())(out, y)
    losses = torch.nn.functional.cross_entropy(out, y, reduction="none")
    with cockpit(0, info={"loss": loss, "individual_losses": losses}):
        loss.backward()
    routes = _routes(cockpit)
    assert routes[0].engine == "ghost" and "used 2 times" in routes[0].reason
    assert routes[2].engine == "backpack"
    G = []
    for i in range(5):
        grads = torch.autograd.grad(
            torch.nn.functional.cross_entropy(model(x[i : i + 1]), y[i : i + 1]),
            list(model.parameters()),
        )
        G.append([g.reshape(-1) for g in grads])
    want = [
        torch.stack([row[k] for row in G]).var(0, unbiased=False).sum()
        for k in range(4)
    ]
    close(cockpit.get_output()[0]["Variance"], torch.stack(want), "Variance")


def test_sequential_models_of_supported_layers_use_backpack_only():
    problem = make_problem("cnn", "ce", "sgd")
    cockpit = run(problem, [Q.Variance(linear(1)), Q.HessTrace(linear(1))], 1).cockpit
    assert cockpit.coverage().engines() == {"backpack": 4}
    assert cockpit.coverage().problems() == []


def test_curvature_without_backpack_rules_is_missing_warned_once_or_strict():
    problem = make_any_problem("rmsnorm-mlp")
    # the Hessian's diagonal (TICDiag takes no estimate; the GGN serves the others)
    hessian = "hutchinson"
    quantities = [Q.TICDiag(linear(1), curvature=hessian), Q.GradNorm(linear(1))]
    with pytest.warns(CockpitWarning, match=r"TICDiag has no value.*Fix") as record:
        result = run(problem, quantities, steps=2)
    assert len([w for w in record if "TICDiag" in str(w.message)]) == 1
    assert all("TICDiag" not in values for values in result.output.values())
    assert all("GradNorm" in values for values in result.output.values())
    problems = result.cockpit.coverage().problems()
    assert problems and all(p.startswith("TICDiag for") for p in problems)
    assert "not covered" in problems[0]
    with pytest.raises(CoverageError, match=r"strict=True.*TICDiag.*Fix"):
        run(
            make_any_problem("rmsnorm-mlp"),
            [Q.TICDiag(linear(1), curvature=hessian)],
            1,
            **_strict(),
        )


def _strict():
    return {
        "cockpit_cls": lambda params, quantities: Cockpit(
            params, quantities, strict=True
        )
    }


def test_per_sample_losses_without_graph_leave_the_quantity_missing():
    problem = make_any_problem("gru")
    cockpit = Cockpit(problem.params, [Q.Variance(linear(1)), Q.GradNorm(linear(1))])
    x, y = problem.make_batch(0)
    out = problem.model(x)
    loss = problem.loss_fn(out, y)
    losses = problem.individual_loss_fn(out, y).detach()
    with pytest.warns(CockpitWarning, match=r"Variance has no value.*not detached"):
        with cockpit(0, info={"loss": loss, "individual_losses": losses}):
            loss.backward()
    out = cockpit.get_output()[0]
    assert set(out) == {"GradNorm", "missing"} and set(out["missing"]) == {"Variance"}


def test_quantities_missing_for_one_reason_warn_once_each_in_one_warning():
    """Two quantities left out together: one warning names both; a later step
    with only one of them, or both again, warns no more."""
    problem = make_any_problem("gru")
    every_other = linear(2)
    cockpit = Cockpit(problem.params, [Q.Variance(linear(1)), Q.NormTest(every_other)])
    messages = []
    for step in range(4):
        problem.model.zero_grad()
        x, y = problem.make_batch(step)
        out = problem.model(x)
        loss = problem.loss_fn(out, y)
        losses = problem.individual_loss_fn(out, y).detach()
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            with cockpit(step, info={"loss": loss, "individual_losses": losses}):
                loss.backward()
        messages += [str(w.message) for w in record if w.category is CockpitWarning]
        assert set(cockpit.get_output()[step]["missing"]) == (
            {"Variance", "NormTest"} if step % 2 == 0 else {"Variance"}
        )
    assert len(messages) == 1, messages
    assert messages[0].startswith("Variance, NormTest have no value at step 0:")


def test_strict_passes_when_everything_is_exact():
    result = run(make_any_problem("gru"), first_order_quantities(), 2, **_strict())
    assert "NormTest" in result.output[0]


@pytest.mark.parametrize("chunk, max_elements", [(1, 10), (3, 1 << 20), (8, 50)])
def test_chunks_and_groups_give_the_same_per_sample_gradients(chunk, max_elements):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(3, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 2)
    ).double()
    x = torch.randn(5, 3, dtype=torch.float64)
    losses = model(x).square().sum(1)
    params = list(model.parameters())
    got = dict(per_sample_gradients(losses, params, chunk, max_elements))
    for i in range(5):
        want = torch.autograd.grad(losses[i], params, retain_graph=True)
        for k, g in enumerate(want):
            close(got[k][i], g, f"param {k} sample {i}")


def test_fused_attention_has_curvature_and_says_what_to_do_where_it_cannot(
    monkeypatch,
):
    """nn.MultiheadAttention's fused kernel has no double backward of its own.

    The cockpit's twice-differentiable attention (``cockpit.curvature.attention``)
    gives the
    same HessMaxEV as the math kernel; where a model calls a function bound before
    (simulated: PyTorch's own, put back), the value is missing with the fix.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from cockpit.curvature import attention

    problem = make_any_problem("transformer")
    x, y = problem.make_batch(0)  # one batch for every run (make_batch draws anew)

    def step(cockpit, problem, math):
        problem.model.zero_grad()  # as a training loop does
        if math:
            with sdpa_kernel(SDPBackend.MATH):
                out = problem.model(x)
        else:
            out = problem.model(x)
        loss = problem.loss_fn(out, y)
        losses = problem.individual_loss_fn(out, y)
        with cockpit(0, info={"loss": loss, "individual_losses": losses}):
            loss.backward(create_graph=cockpit.create_graph(0))

    cockpit = Cockpit(problem.params, [Q.HessMaxEV(linear(1)), Q.GradNorm(linear(1))])
    step(cockpit, problem, math=False)
    fused = cockpit.get_output()[0]["HessMaxEV"]
    cockpit = Cockpit(problem.params, [Q.HessMaxEV(linear(1))])
    step(cockpit, problem, math=True)
    assert math.isclose(fused, cockpit.get_output()[0]["HessMaxEV"], rel_tol=1e-4)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        attention._ORIGINAL)  # fmt: skip
    cockpit = Cockpit(problem.params, [Q.HessMaxEV(linear(1)), Q.GradNorm(linear(1))])
    with pytest.warns(CockpitWarning, match=r"no double backward.*SDPBackend.MATH"):
        step(cockpit, problem, math=False)
    out = cockpit.get_output()[0]
    assert (
        set(out) == {"GradNorm", "missing"}
        and "SDPBackend" in out["missing"]["HessMaxEV"]
    )
    # the coverage report, built before the backward pass, follows the log after it
    cockpit = Cockpit(problem.params, [Q.HessMaxEV(linear(1)), Q.Variance(linear(1))])
    with pytest.warns(CockpitWarning, match=r"no double backward"):
        step(cockpit, problem, math=False)
    rows = cockpit.coverage().params
    assert {str(row.quantities["Variance"]) for row in rows} <= {
        "exact (backpack)",
        "exact (autograd)",
    }
    (status,) = {str(row.quantities["HessMaxEV"]) for row in rows}
    assert status.startswith("not covered (PyTorch has no double backward")
    assert "sdpa_kernel(SDPBackend.MATH)" in status
    assert "HessMaxEV" in cockpit.get_output()[0]["missing"]


def test_an_extra_batch_grad_of_the_user_keeps_its_results_and_routing_follows():
    from backpack import extend
    from backpack.extensions import BatchGrad

    torch.manual_seed(0)
    model = extend(
        torch.nn.Sequential(
            torch.nn.Linear(3, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 2)
        ).double()
    )
    cockpit = Cockpit(model.parameters(), [Q.Variance(linear(1))])
    x, y = torch.randn(5, 3, dtype=torch.float64), torch.randint(0, 2, (5,))
    out = model(x)
    loss = extend(torch.nn.CrossEntropyLoss())(out, y)
    losses = torch.nn.functional.cross_entropy(out, y, reduction="none")
    with cockpit(0, BatchGrad(), info={"loss": loss, "individual_losses": losses}):
        loss.backward()
    engines = [row.route.engine for row in cockpit.coverage().params]
    assert engines == ["backpack"] * 2 + ["ghost"] * 2 + ["backpack"] * 2
    assert model[0].weight.grad_batch.shape == (5, 4, 3)  # the user's, kept
    G = torch.stack(
        [
            torch.cat(
                [
                    g.reshape(-1)
                    for g in torch.autograd.grad(
                        torch.nn.functional.cross_entropy(
                            model(x), y, reduction="none"
                        )[i],
                        list(model.parameters()),
                    )
                ]
            )
            for i in range(5)
        ]
    )
    blocks = torch.split(G, [p.numel() for p in model.parameters()], dim=1)
    want = torch.stack([(b - b.mean(0)).square().sum(1).mean() for b in blocks])
    close(cockpit.get_output()[0]["Variance"], want, "Variance")


def test_coverage_before_the_first_step_reads_the_structure():
    problem = make_any_problem("transformer")
    cockpit = Cockpit(
        problem.model.named_parameters(),
        [Q.Variance(linear(1)), Q.HessTrace(linear(1))],
    )
    coverage = cockpit.coverage()
    assert coverage.step is None
    by_name = {row.label.split("'")[1]: row for row in coverage.params}
    assert by_name["norm1.weight"].route.engine == "backpack"  # cockpit's rule
    assert by_name["attention.in_proj_weight"].route.engine == "autograd"
    hess_trace = str(by_name["position"].quantities["HessTrace"])
    assert hess_trace == (
        "estimated (the GGN of the cross-entropy where the loss is one (chosen at "
        "step 1), else Hutchinson, 16 Hessian-vector products)"
    )
    assert "attention.in_proj_weight" in str(coverage)


def test_without_per_sample_losses_a_shared_layer_is_never_left_to_backpack():
    from backpack import extend

    torch.manual_seed(0)
    layer, head = torch.nn.Linear(3, 3).double(), torch.nn.Linear(3, 2).double()
    model = extend(torch.nn.Sequential(layer, torch.nn.Tanh(), layer, head))
    cockpit = Cockpit(
        model.parameters(), [Q.Variance(linear(1)), Q.GradNorm(linear(1))]
    )
    x, y = torch.randn(5, 3, dtype=torch.float64), torch.randint(0, 2, (5,))
    loss = extend(torch.nn.CrossEntropyLoss())(model(x), y)
    with pytest.warns(
        CockpitWarning, match=r"Variance has no value.*individual_losses"
    ):
        with cockpit(0, info={"loss": loss}):
            loss.backward()
    out = cockpit.get_output()[0]
    assert set(out) == {"GradNorm", "missing"} and set(out["missing"]) == {"Variance"}
    declines = cockpit.coverage().params[0].route.declines
    assert "used 2 times" in declines[0].message  # BackPACK's
    assert "per-sample losses" in declines[1].message  # the ghost engine's


def test_coverage_of_a_step_like_the_one_before_is_reused_and_the_same(monkeypatch):
    """The per-step report is rebuilt only when routes, plan or statuses change;
    reused, it is the report a fresh build gives (HessTrace only at step 1)."""
    from cockpit.engines.routing import Router
    from cockpit.step import routing as step_routing

    built = []
    status_for = step_routing.status_for

    def counting(*args):
        built.append(1)
        return status_for(*args)

    monkeypatch.setattr(step_routing, "status_for", counting)

    class Recording(Cockpit):
        def end(self, error=None):
            super().end(error)
            self.reports.append((len(built), str(self.coverage())))
            built.clear()

    def reports():
        problem = make_any_problem("transformer")
        quantities = [
            Q.Variance(linear(1)),
            Q.GradNorm(linear(1)),
            Q.HessTrace(lambda step: step == 1),
        ]
        cls = type("Recording", (Recording,), {"reports": []})
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", CockpitWarning)
            return run(problem, quantities, steps=4, cockpit_cls=cls).cockpit.reports

    cached = reports()
    monkeypatch.setattr(  # no cache: every step builds its report
        Router,
        "coverage_cache",
        property(lambda self: None, lambda self, value: None),
        raising=False,
    )
    fresh = reports()
    assert [text for _, text in cached] == [text for _, text in fresh]
    assert "HessTrace" not in cached[0][1] and "HessTrace" in cached[1][1]
    assert all(count > 0 for count, _ in fresh)
    assert [count > 0 for count, _ in cached] == [True, True, True, False]


def test_in_place_activations_are_turned_off_once_and_curvature_is_exact():
    """An extended CNN with ``ReLU(inplace=True)`` would stop in its forward pass
    (BackPACK's hooks); the cockpit turns ``inplace`` off with one warning, and
    the curvature quantities match the dense float64 Hessian."""
    from tests.quantities.test_curvature_instruments import max_ev_twin, tic_twin
    from tests.utils import brute_force as bf

    problem = make_any_problem("cnn-inplace-relu")
    x, y = problem.make_batch(0)
    with pytest.raises(RuntimeError, match="BackwardHookFunction"):
        problem.model(x)  # what the user's forward pass did before
    quantities = [
        Q.HessTrace(linear(1)),
        Q.TICDiag(linear(1), curvature="diag_ggn_exact"),
        Q.TICTrace(linear(1), curvature="diag_ggn_exact"),
        Q.HessMaxEV(linear(1), rtol=1e-10, atol=1e-12),
    ]
    with pytest.warns(CockpitWarning) as caught:
        result = run(problem, quantities, steps=2)
    said = [str(w.message) for w in caught if "inplace=False" in str(w.message)]
    assert len(said) == 1 and "ReLU '1', LeakyReLU '3'" in said[0], said
    assert not any(getattr(m, "inplace", False) for m in problem.model.modules())
    assert result.cockpit.coverage().problems() == []
    for step in range(2):
        out, record = result.output[step], result.records[step]
        with warnings.catch_warnings():  # torch's note on hooks of frozen inputs
            warnings.simplefilter("ignore", UserWarning)
            hessian = bf.hessian(problem, record.params, record.x, record.y)
            diag, trace = tic_twin(problem, record, "diag_ggn_exact")
            max_ev = max_ev_twin(problem, record)
        traces = [d.sum() for d in bf.split_diagonal(hessian, record.params)]
        close(out["HessTrace"], torch.stack(traces), "HessTrace")
        close(out["TICDiag"], diag, "TICDiag")
        close(out["TICTrace"], trace, "TICTrace")
        close(out["HessMaxEV"], max_ev, "HessMaxEV")


def test_in_place_modules_outside_the_extended_model_are_left_alone():
    """Only extended modules are switched: a teacher network next to the tracked,
    extended student keeps its in-place activations."""
    from backpack import extend

    class Wrap(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.student = extend(_inplace_cnn())
            self.teacher = torch.nn.Sequential(
                torch.nn.Linear(3, 3), torch.nn.ReLU(inplace=True)
            )

    wrap = Wrap()
    with pytest.warns(CockpitWarning, match=r"inplace=False on 2 module\(s\)"):
        Cockpit(wrap.student.parameters(), [Q.GradNorm(linear(1))])
    assert not any(getattr(m, "inplace", False) for m in wrap.student.modules())
    assert wrap.teacher[1].inplace
    # only the layers extended (as the Hugging Face integration does): an in-place
    # activation beside them changes their hooked outputs, so it is switched too
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        extend(torch.nn.Linear(3, 4)), torch.nn.ReLU(inplace=True),
        extend(torch.nn.Linear(4, 2)),
    )  # fmt: skip
    with pytest.raises(RuntimeError, match="BackwardHookFunction"):
        model(torch.randn(5, 3))
    with pytest.warns(CockpitWarning, match=r"inplace=False on 1 module\(s\).*'1'"):
        Cockpit(model.parameters(), [Q.GradNorm(linear(1))])
    assert not model[1].inplace
    model(torch.randn(5, 3)).sum().backward()  # runs now
