"""First-order instruments against brute-force float64 twins from their definitions.

Every quantity (Alpha, CABS, EarlyStopping, NormTest, InnerTest, OrthoTest,
MeanGSNR) is run alone and together with all other exported quantities in one
cockpit, on several problems and two schedules, and compared with a recomputation
from per-sample autograd gradients (``tests/utils/brute_force.py``).
"""

import io
import warnings

import numpy as np
import pytest
import torch

from cockpit import Cockpit
from cockpit import quantities as Q
from cockpit.quantities import functional as F
from cockpit.quantities.base import Quantity
from cockpit.utils.schedules import linear
from tests.utils import brute_force as bf
from tests.utils import expected_warnings as expected
from tests.utils.harness import run
from tests.utils.problems import PROBLEM_IDS, PROBLEMS, make_problem

pytestmark = [expected.TIC_HESSIAN_NOT_POSITIVE]

STEPS = 4
RTOL, ATOL = 1e-6, 1e-10
EPSILON = 1e-5  # default epsilon of EarlyStopping and MeanGSNR

MINE = ["Alpha", "CABS", "EarlyStopping", "NormTest", "InnerTest", "OrthoTest"]
MINE += ["MeanGSNR"]
SGD_ONLY = {"CABS", "EarlyStopping"}
# CABS and EarlyStopping are only defined for plain SGD: their own problem list
SGD_PROBLEMS = [("mlp", "ce", "sgd"), ("cnn", "mse", "sgd"), ("cnn", "ce", "sgd")]
# HessMaxEV (create_graph, many Hessian-vector products) is slow; it joins the
# shared cockpit in test_together_with_create_graph_quantities only
SLOW = {"HessMaxEV"}


def close(actual, expected, what=""):
    actual = torch.as_tensor(actual, dtype=torch.float64)
    expected = torch.as_tensor(expected, dtype=torch.float64)
    torch.testing.assert_close(
        actual, expected, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}"
    )


# --- brute force -------------------------------------------------------------------
_PER_SAMPLE = {}  # id(record) -> (record, result): recomputed once per record


def per_sample(problem, rec):
    """Per-sample gradients ``[N, D]`` and per-sample losses ``[N]`` at a record."""
    cached = _PER_SAMPLE.get(id(rec))
    if cached is not None and cached[0] is rec:
        return cached[1]
    grads = bf.individual_gradients(problem, rec.params, rec.x, rec.y)
    flat = torch.cat([g.flatten(start_dim=1) for g in grads], dim=1)
    losses = bf.individual_losses(problem, rec.params, rec.x, rec.y).detach()
    if len(_PER_SAMPLE) > 64:
        _PER_SAMPLE.clear()
    _PER_SAMPLE[id(rec)] = (rec, (flat, losses))
    return flat, losses


def reference_single(name, problem, rec):
    """The value of a single-step quantity at one record, from its definition."""
    G, losses = per_sample(problem, rec)
    n, dim = G.shape
    g = G.mean(0)
    g_sq = g @ g
    if name == "NormTest":
        return (((G - g) ** 2).sum() / (n * (n - 1) * g_sq)).sqrt()
    if name == "InnerTest":
        return (((G @ g - g_sq) ** 2).sum() / (n * (n - 1) * g_sq**2)).sqrt()
    if name == "OrthoTest":
        orthogonal = G - (G @ g / g_sq)[:, None] * g[None, :]
        return ((orthogonal**2).sum() / (n * (n - 1) * g_sq)).sqrt()
    if name == "CABS":
        biased = ((G - g) ** 2).mean(0)
        return rec.lr * biased.sum() / losses.mean()
    if name == "EarlyStopping":
        unbiased = ((G - g) ** 2).sum(0) / (n - 1)
        return 1 - n / dim * (g**2 / (unbiased + EPSILON)).sum()
    if name == "MeanGSNR":
        biased = (G**2).mean(0) - g**2
        return (g**2 / (biased + EPSILON)).mean()
    raise KeyError(name)


def reference_alpha(problem, start, end):
    """Alpha from its definition, along the actual update theta_{t+1} - theta_t."""
    d = bf.flatten(end.params) - bf.flatten(start.params)
    tau = d.norm()
    u = d / tau
    y, variances = [], []
    observations = [per_sample(problem, rec) for rec in (start, end)]
    for _, losses in observations:
        y.append(losses.mean())
        variances.append(losses.var(unbiased=True))
    for G, _ in observations:
        slopes = G @ u
        y.append(slopes.mean())
        variances.append(slopes.var(unbiased=True))
    tau = float(tau)
    phi = np.array(
        [[1, 0, 0], [1, tau, tau**2], [0, 1, 0], [0, 1, 2 * tau]], dtype=np.float64
    )
    sqrt_w = 1 / np.sqrt(np.array([float(v) for v in variances]))
    coeff, *_ = np.linalg.lstsq(
        sqrt_w[:, None] * phi, sqrt_w * np.array([float(v) for v in y]), rcond=None
    )
    _, w1, w2 = coeff
    assert w2 != 0 and w1 != 0  # the guarded corner cases are tested separately
    if w2 < 0:
        return -1.0
    minimiser = -w1 / (2 * w2)
    return tau / minimiser - 1


def check_against_reference(name, problem, result, schedule, steps=STEPS):
    """Compare every stored value of quantity ``name`` with the brute force."""
    tracked = [s for s in range(steps) if schedule(s)]
    if name == "Alpha":
        tracked = [s for s in tracked if s + 1 < steps]
    stored = sorted(s for s in result.output if name in result.output[s])
    assert stored == tracked, (name, stored, tracked)
    for step in tracked:
        rec = result.records[step]
        if name == "Alpha":
            expected = reference_alpha(problem, rec, result.records[step + 1])
        else:
            expected = reference_single(name, problem, rec)
        close(result.output[step][name], expected, f"{name} step {step}")


def exported_quantities(schedule, optimizer, exclude=()):
    """One instance of every exported quantity that supports ``optimizer``."""
    made = []
    for name in Q.__all__:
        cls = getattr(Q, name)
        if not (isinstance(cls, type) and issubclass(cls, Quantity)):
            continue
        if cls.__module__ == "cockpit.quantities.base" or name in exclude:
            continue
        if name in SGD_ONLY and optimizer != "sgd":
            continue
        made.append(cls(schedule))
    return made


def _problems_for(name):
    return SGD_PROBLEMS if name in SGD_ONLY else PROBLEMS[:3]


ALONE = [(name, spec) for name in MINE for spec in _problems_for(name)]


# --- alone and together ------------------------------------------------------------
@pytest.mark.parametrize(
    "name,spec", ALONE, ids=[f"{n}-{'-'.join(s)}" for n, s in ALONE]
)
def test_alone_matches_brute_force(name, spec, schedule):
    problem = make_problem(*spec)
    result = run(problem, [getattr(Q, name)(schedule)], steps=STEPS)
    check_against_reference(name, problem, result, schedule)


TOGETHER = PROBLEMS + [("cnn", "ce", "sgd")]


@pytest.mark.parametrize("spec", TOGETHER, ids=PROBLEM_IDS + ["cnn-ce-sgd"])
def test_together_with_all_quantities_matches_brute_force(spec, schedule, device):
    problem = make_problem(*spec, device=device)
    quantities = exported_quantities(schedule, spec[2], exclude=SLOW)
    keys = {q.key for q in quantities}
    assert set(MINE) - SGD_ONLY <= keys
    result = run(problem, quantities, steps=STEPS)
    for name in sorted(keys & set(MINE)):
        check_against_reference(name, problem, result, schedule)


@pytest.mark.parametrize("spec", [("mlp", "ce", "sgd"), ("cnn", "mse", "adam")])
def test_together_with_create_graph_quantities(spec):
    """With HessMaxEV the backward runs with create_graph; values are unchanged."""
    schedule = linear(2, offset=1)  # {1, 3}
    problem = make_problem(*spec)
    quantities = exported_quantities(schedule, spec[2])
    assert "HessMaxEV" in {q.key for q in quantities}
    result = run(problem, quantities, steps=STEPS)
    for name in MINE:
        if name in SGD_ONLY and spec[2] != "sgd":
            continue
        check_against_reference(name, problem, result, schedule)
    # no stored tensor keeps an autograd graph (it would keep the graph alive)
    for q in result.cockpit.quantities:
        if q.key == "Alpha":
            for state in q._pending.values():
                assert all(d.grad_fn is None for d in state["direction"])


# --- Alpha -------------------------------------------------------------------------
@pytest.mark.parametrize("optimizer", ["sgd", "momentum"])
def test_alpha_from_the_first_step(optimizer):
    """SGD, and momentum on its first step (update = multiple of g), from step 0."""
    schedule = linear(1)
    problem = make_problem("cnn", "ce", optimizer)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        warnings.filterwarnings("ignore", "Full backward hook")
        result = run(problem, [Q.Alpha(schedule)], steps=STEPS)
    check_against_reference("Alpha", problem, result, schedule)


@pytest.mark.parametrize("optimizer", ["adam", "momentum"])
def test_alpha_with_stateful_optimizer_from_the_first_step(optimizer):
    """The optimizer is read before the backward pass, so step 0 has a value too."""
    problem = make_problem("mlp", "mse", optimizer)
    result = run(problem, [Q.Alpha(linear(1))], steps=STEPS)
    for step in (0, 1, 2):
        expected = reference_alpha(
            problem, result.records[step], result.records[step + 1]
        )
        close(result.output[step]["Alpha"], expected, f"Alpha step {step}")


@pytest.mark.parametrize("optimizer", ["sgd", "momentum"])
def test_alpha_resumes_from_state_dict(optimizer):
    """A run restarted from Alpha's state_dict finishes the pending start exactly."""
    schedule = linear(1, offset=1)
    steps = 5
    reference = run(make_problem("mlp", "ce", optimizer), [Q.Alpha(schedule)], steps)

    problem = make_problem("mlp", "ce", optimizer)
    opt = problem.optimizer()
    alpha = Q.Alpha(schedule)
    cockpit = Cockpit(problem.params, [alpha])
    outputs = {}
    for step in range(steps):
        if step == 3:  # restart: new quantity and cockpit, state from a file
            buffer = io.BytesIO()
            torch.save(alpha.state_dict(), buffer)
            buffer.seek(0)
            alpha = Q.Alpha(schedule)
            alpha.load_state_dict(torch.load(buffer))
            outputs.update(cockpit.get_output())
            cockpit = Cockpit(problem.params, [alpha])
        x, y = problem.make_batch(step)
        opt.zero_grad()
        out = problem.model(x)
        loss = problem.loss_fn(out, y)
        info = {
            "loss": loss,
            "individual_losses": problem.individual_loss_fn(out, y),
            "optimizer": opt,
            "batch_size": x.shape[0],
        }
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with cockpit(step, info=info):
                loss.backward()
        skipped = [w for w in caught if "Alpha has no value" in str(w.message)]
        assert skipped == []  # no start is lost, not even right after the restart
        opt.step()
    outputs.update(cockpit.get_output())
    expected = {s: v["Alpha"] for s, v in reference.output.items()}
    assert sorted(expected) == list(range(1, steps - 1))
    alphas = {s: v["Alpha"] for s, v in outputs.items() if "Alpha" in v}
    assert alphas == pytest.approx(expected)  # other steps: only learning_rates


def test_alpha_is_minus_one_when_the_step_does_not_move():
    problem = make_problem("mlp", "ce", "sgd")
    problem.make_optimizer = lambda params: torch.optim.SGD(params, lr=0.0)
    result = run(problem, [Q.Alpha(linear(1))], steps=3)
    assert {s: v["Alpha"] for s, v in result.output.items()} == {0: -1.0, 1: -1.0}


def test_alpha_zero_variance_warns_once():
    """Batch size 1: all variances are zero, floored to 1e-10 with one warning."""
    problem = make_problem("mlp", "ce", "sgd", batch_size=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = run(problem, [Q.Alpha(linear(1))], steps=4)
    zero = [w for w in caught if "zero variance" in str(w.message)]
    assert len(zero) == 1, [str(w.message) for w in caught]
    assert "1e-10" in str(zero[0].message)
    values = [v["Alpha"] for v in result.output.values()]
    assert len(values) == 3 and all(np.isfinite(values))


def test_alpha_rejects_individual_losses_of_the_wrong_size():
    problem = make_problem("mlp", "ce", "sgd")
    opt = problem.optimizer()
    cockpit = Cockpit(problem.params, [Q.Alpha(linear(1))])
    x, y = problem.make_batch(0)
    out = problem.model(x)
    loss = problem.loss_fn(out, y)
    info = {"loss": loss, "individual_losses": loss[None], "optimizer": opt}
    with pytest.raises(ValueError, match=r"individual_losses.*\[6\].*reduction='none'"):
        with cockpit(0, info=info):
            loss.backward()


def test_alpha_needs_the_optimizer():
    problem = make_problem("mlp", "ce", "sgd")
    cockpit = Cockpit(problem.params, [Q.Alpha(linear(1))])
    x, y = problem.make_batch(0)
    out = problem.model(x)
    loss = problem.loss_fn(out, y)
    info = {"loss": loss, "individual_losses": problem.individual_loss_fn(out, y)}
    with pytest.raises(KeyError, match=r"Alpha needs info\['optimizer'\]"):
        with cockpit(0, info=info):
            loss.backward()


def test_alpha_fit_guards():
    variances = (1.0, 1.0, 1.0, 1.0)
    # tau = 0: did not move (no fit, no division)
    assert F.alpha_from_fit(0.0, None) == -1.0
    # singular system: no estimate
    singular = F.fit_quadratic(0.0, (1.0, 1.0), (0.0, 0.0), variances)
    assert singular is None and F.alpha_from_fit(1.0, singular) is None
    # exact parabola q(x) = (x - 1)^2 sampled at 0 and tau = 2: lands on the mirror
    fit = F.fit_quadratic(2.0, (1.0, 1.0), (-2.0, 2.0), variances)
    close(fit, [1.0, -2.0, 1.0], "fit")
    assert F.alpha_from_fit(2.0, fit) == pytest.approx(1.0)
    # linear (w2 = 0) and concave (w2 < 0): no minimum ahead -> -1
    assert F.alpha_from_fit(1.0, torch.tensor([0.0, -1.0, 0.0])) == -1.0
    assert F.alpha_from_fit(1.0, torch.tensor([0.0, -1.0, -2.0])) == -1.0
    # start in the minimum (w1 = 0): alpha undefined, nothing stored
    assert F.alpha_from_fit(1.0, torch.tensor([0.0, 0.0, 1.0])) is None
    floored, replaced = F.floor_variances((0.0, 2.0, 0.0, 1e-12))
    assert floored == (1e-10, 2.0, 1e-10, 1e-12) and replaced


# --- plain SGD only ----------------------------------------------------------------
BAD_OPTIMIZERS = {
    "momentum": (
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
        r"momentum=0\.9 in param group 0",
    ),
    "adam": (lambda ps: torch.optim.Adam(ps), r"the optimizer is Adam, not torch"),
    "weight-decay-group-1": (
        lambda ps: torch.optim.SGD(
            [{"params": ps[:2]}, {"params": ps[2:], "weight_decay": 0.1}], lr=0.1
        ),
        r"weight_decay=0\.1 in param group 1",
    ),
    "nesterov": (
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.5, nesterov=True),
        r"momentum=0\.5 in param group 0",
    ),
}


@pytest.mark.parametrize("name", sorted(SGD_ONLY))
@pytest.mark.parametrize("bad", list(BAD_OPTIMIZERS))
def test_sgd_only_quantities_reject_other_optimizers(name, bad):
    make, setting = BAD_OPTIMIZERS[bad]
    problem = make_problem("mlp", "ce", "sgd")
    problem.make_optimizer = make
    fix = r".*Fix: train with plain torch\.optim\.SGD"
    with pytest.raises(ValueError, match=rf"{name} is only defined.*{setting}{fix}"):
        run(problem, [getattr(Q, name)(linear(1))], steps=1)


def test_cabs_needs_a_single_learning_rate():
    problem = make_problem("mlp", "ce", "sgd")
    problem.make_optimizer = lambda ps: torch.optim.SGD(
        [{"params": ps[:2], "lr": 0.1}, {"params": ps[2:], "lr": 0.01}], lr=0.1
    )
    match = r"different learning rates \(lr=0\.1 in param group 0, lr=0\.01 in param"
    with pytest.raises(ValueError, match=match):
        run(problem, [Q.CABS(linear(1))], steps=1)
    # EarlyStopping has no learning rate in its formula: several are fine
    run(problem, [Q.EarlyStopping(linear(1))], steps=1)


def test_epsilon_argument():
    schedule = linear(1)
    problem = make_problem("mlp", "mse", "sgd")
    quantities = [
        Q.MeanGSNR(schedule, epsilon=1.0, key="GSNR1"),
        Q.EarlyStopping(schedule, epsilon=1.0, key="ES1"),
    ]
    result = run(problem, quantities, steps=1)
    G, _ = per_sample(problem, result.records[0])
    n, dim = G.shape
    g = G.mean(0)
    biased = ((G - g) ** 2).mean(0)
    close(result.output[0]["GSNR1"], (g**2 / (biased + 1.0)).mean(), "GSNR eps 1")
    unbiased = biased * n / (n - 1)
    expected = 1 - n / dim * (g**2 / (unbiased + 1.0)).sum()
    close(result.output[0]["ES1"], expected, "ES eps 1")
