"""TICDiag, TICTrace and HessMaxEV against dense float64 brute-force twins.

TIC: per-sample gradients by autograd loops, curvature diagonals from the dense
Hessian / GGN (rtol 1e-6). HessMaxEV: ``torch.linalg.eigvalsh`` of the dense Hessian
(rtol 1e-3). Also: one curvature extension feeds every quantity that reads it, the
Lanczos solver spends fewer Hessian-vector products than power iteration, and no
double-backward graph survives a step.
"""

import gc
import math
import weakref

import numpy as np
import pytest
import torch
from backpack import CTX
from backpack.extensions import DiagGGNMC, DiagHessian, SumGradSquared

from cockpit import Cockpit
from cockpit import quantities as Q
from cockpit.quantities.base import Quantity
from cockpit.quantities.hess_max_ev import (
    _orthogonalise,
    lanczos_max_ev,
    power_max_ev,
)
from cockpit.utils.schedules import linear
from tests.quantities.test_histograms import (
    np_hist_1d,
    np_hist_2d,
    per_sample_gradients,
)
from tests.utils import brute_force as bf
from tests.utils import expected_warnings as expected
from tests.utils.harness import run
from tests.utils.problems import (
    PROBLEM_IDS,
    PROBLEMS,
    make_problem,
    tracked_steps,
)

pytestmark = [expected.TIC_HESSIAN_NOT_POSITIVE]

STEPS = 5
EPS = 1e-7


def close(actual, expected, rtol, what):
    torch.testing.assert_close(
        torch.as_tensor(actual, dtype=torch.float64),
        torch.as_tensor(expected, dtype=torch.float64),
        rtol=rtol,
        atol=0.0,
        msg=lambda m: f"{what}: {m}",
    )


# --- brute-force twins ----------------------------------------------------------------
def tic_twin(problem, record, curvature):
    grads = bf.individual_gradients(problem, record.params, record.x, record.y)
    moment = torch.cat([(g**2).mean(0).reshape(-1) for g in grads])  # M_d
    matrix = bf.hessian if curvature == "diag_h" else bf.ggn
    h = torch.diagonal(matrix(problem, record.params, record.x, record.y))
    diag = (moment / (h + EPS)).sum() if bool((h + EPS > 0).all()) else None
    trace = moment.sum() / (h.sum() + EPS) if h.sum() + EPS > 0 else None
    return diag, trace  # None where the TIC is undefined (curvature <= 0)


def max_ev_twin(problem, record):
    evals = torch.linalg.eigvalsh(
        bf.hessian(problem, record.params, record.x, record.y)
    )
    return evals[evals.abs().argmax()]


# --- TIC ------------------------------------------------------------------------------
@pytest.mark.parametrize("curvature", ["diag_h", "diag_ggn_exact"])
def test_tic(problem, schedule, curvature):
    quantities = [
        Q.TICDiag(schedule, curvature=curvature),
        Q.TICTrace(schedule, curvature=curvature),
    ]
    result = run(problem, quantities, steps=STEPS)
    assert sorted(result.output) == tracked_steps(schedule, STEPS)
    for step in tracked_steps(schedule, STEPS):
        diag, trace = tic_twin(problem, result.records[step], curvature)
        out = result.output[step]
        for key, twin in (("TICDiag", diag), ("TICTrace", trace)):
            if twin is None:  # negative curvature: recorded as missing, no number
                assert key not in out and "<= 0" in out["missing"][key]
            else:
                assert isinstance(out[key], float)
                close(out[key], twin, 1e-6, f"{key} {curvature} step {step}")
    if curvature == "diag_ggn_exact":  # never negative: always a value
        assert all("missing" not in result.output[s] for s in result.output)


def test_unknown_curvature_is_rejected_at_construction():
    for cls in (Q.TICDiag, Q.TICTrace):
        with pytest.raises(
            ValueError, match="'diag_h', 'diag_ggn_exact', 'diag_ggn_mc'"
        ):
            cls(linear(1), curvature="diag_hessian")
    with pytest.raises(ValueError, match="epsilon"):
        Q.TICDiag(linear(1), epsilon=-1.0)


def _active_extensions(problem, quantities, step=0):
    cockpit = Cockpit(problem.params, quantities)
    x, y = problem.make_batch(step)
    loss = problem.loss_fn(problem.model(x), y)
    with cockpit(step, info={"loss": loss, "batch_size": x.shape[0]}):
        active = list(CTX.get_active_exts())
        loss.backward()
    return active, cockpit.get_output()[step]


def test_one_diag_hessian_feeds_hess_trace_and_both_tics():
    problem = make_problem("cnn", "ce")
    quantities = [Q.HessTrace(linear(1)), Q.TICDiag(linear(1)), Q.TICTrace(linear(1))]
    active, together = _active_extensions(problem, quantities)
    assert sum(isinstance(e, DiagHessian) for e in active) == 1
    # alone, the second moment comes from SumGradSquared (no per-sample gradients)
    assert sorted(type(e).__name__ for e in active) == [
        "DiagHessian",
        "SumGradSquared",
    ]
    # the same values when the second moment comes from per-sample gradients
    fresh = make_problem("cnn", "ce")
    shared, out = _active_extensions(
        fresh, [Q.TICDiag(linear(1)), Q.TICTrace(linear(1)), Q.GradHist1d(linear(1))]
    )
    assert not any(isinstance(e, SumGradSquared) for e in shared)
    assert [e.savefield for e in shared if e.savefield == "grad_batch"]
    close(out["TICDiag"], together["TICDiag"], 1e-12, "TICDiag, other source")
    close(out["TICTrace"], together["TICTrace"], 1e-12, "TICTrace, other source")


def test_tic_with_monte_carlo_ggn():
    problem = make_problem("mlp", "ce")
    quantities = [
        Q.TICDiag(linear(1), curvature="diag_ggn_mc"),
        Q.TICTrace(linear(1), curvature="diag_ggn_mc"),
    ]
    active, out = _active_extensions(problem, quantities)
    assert [type(e) for e in active if not isinstance(e, SumGradSquared)] == [DiagGGNMC]
    assert np.isfinite(out["TICDiag"]) and out["TICTrace"] > 0


def test_tic_rejects_a_wrong_batch_size():
    problem = make_problem("mlp", "ce")
    cockpit = Cockpit(problem.params, [Q.TICDiag(linear(1)), Q.GradHist1d(linear(1))])
    x, y = problem.make_batch(0)
    loss = problem.loss_fn(problem.model(x), y)
    with pytest.raises(ValueError, match=r"batch_size.*hold 6 samples.*x.shape\[0\]"):
        with cockpit(0, info={"loss": loss, "batch_size": 5}):
            loss.backward()
    with pytest.raises(KeyError, match="batch_size"):
        with cockpit(1, info={"loss": loss}):
            pass


# --- HessMaxEV ------------------------------------------------------------------------
@pytest.mark.parametrize("use_power", [False, True], ids=["lanczos", "power"])
def test_hess_max_ev(problem, schedule, use_power):
    quantity = Q.HessMaxEV(schedule, use_power=use_power, max_iter=1000)
    result = run(problem, [quantity], steps=STEPS)
    assert sorted(result.output) == tracked_steps(schedule, STEPS)
    for step in tracked_steps(schedule, STEPS):
        value = result.output[step]["HessMaxEV"]
        assert isinstance(value, float)
        close(value, max_ev_twin(problem, result.records[step]), 1e-3, f"step {step}")
    assert all(p.grad.grad_fn is None for p in problem.params)


def test_hess_max_ev_needs_create_graph_and_says_how():
    problem = make_problem("mlp", "ce")
    cockpit = Cockpit(problem.params, [Q.HessMaxEV(linear(2))])
    assert cockpit.create_graph(0) and not cockpit.create_graph(1)
    x, y = problem.make_batch(0)
    loss = problem.loss_fn(problem.model(x), y)
    with pytest.raises(RuntimeError, match=r"create_graph=cockpit.create_graph\(0\)"):
        with cockpit(0, info={"loss": loss}):
            loss.backward()  # without create_graph


def _dense_hvp(problem, step=0):
    x, y = problem.make_batch(step)
    matrix = bf.hessian(problem, problem.params, x, y)
    evals = torch.linalg.eigvalsh(matrix)
    count = [0]

    def hvp(v):
        count[0] += 1
        return matrix @ v

    return hvp, count, evals[evals.abs().argmax()]


@pytest.mark.parametrize("spec", PROBLEMS, ids=PROBLEM_IDS)
def test_lanczos_needs_fewer_products_than_power_iteration(spec):
    """Same start, same stopping rule and tolerance: Lanczos wins on every problem."""
    hvp, count, exact = _dense_hvp(make_problem(*spec))
    dim = sum(p.numel() for p in make_problem(*spec).params)
    v0 = torch.randn(dim, generator=torch.Generator().manual_seed(0), dtype=exact.dtype)
    spent = {}
    for name, solver in (("lanczos", lanczos_max_ev), ("power", power_max_ev)):
        count[0] = 0
        result = solver(hvp, v0, rtol=1e-3, atol=1e-6, max_iter=1000)
        assert result.converged
        assert result.num_hvps == count[0]
        close(result.eigenvalue, exact, 1e-3, name)
        spent[name] = count[0]
    assert spent["lanczos"] < spent["power"], spent


def test_hvp_count_in_the_cockpit_and_warm_start(monkeypatch):
    """Count real autograd HVPs per step: Lanczos < power, warm start <= cold start."""
    calls = [0]
    original = torch.autograd.grad

    def counting_grad(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    spent = {}
    for name, kwargs in {
        "power": {"use_power": True, "max_iter": 1000},
        "lanczos-cold": {"warm_start": False},
        "lanczos-warm": {},
    }.items():
        problem = make_problem("cnn", "mse", "sgd")
        quantity = Q.HessMaxEV(linear(1), **kwargs)
        cockpit = Cockpit(problem.params, [quantity])
        optimizer = problem.optimizer()
        spent[name] = []
        for step in range(3):
            x, y = problem.make_batch(step)
            optimizer.zero_grad()
            loss = problem.loss_fn(problem.model(x), y)
            monkeypatch.setattr(torch.autograd, "grad", counting_grad)
            calls[0] = 0
            with cockpit(step, info={"loss": loss}):
                loss.backward(create_graph=cockpit.create_graph(step))
            monkeypatch.setattr(torch.autograd, "grad", original)
            assert calls[0] == quantity.last_num_hvps > 0
            spent[name].append(calls[0])
            optimizer.step()
    assert sum(spent["lanczos-warm"]) < sum(spent["power"]), spent
    assert sum(spent["lanczos-cold"]) < sum(spent["power"]), spent
    assert sum(spent["lanczos-warm"][1:]) <= sum(spent["lanczos-cold"][1:]), spent


def test_hess_max_ev_is_deterministic_and_leaves_global_rng_alone():
    values = []
    for _ in range(2):
        problem = make_problem("mlp", "mse")  # seeds the global RNG
        state = torch.get_rng_state()
        result = run(problem, [Q.HessMaxEV(linear(1), warm_start=False)], steps=2)
        assert torch.equal(torch.get_rng_state(), state)
        values.append([result.output[s]["HessMaxEV"] for s in range(2)])
    assert values[0] == values[1]


def test_hess_max_ev_warm_start_survives_a_checkpoint():
    """A quantity restored from state_dict continues with the same warm start."""

    def steps(quantity, problem, optimizer, start, stop):
        cockpit = Cockpit(problem.params, [quantity])
        for step in range(start, stop):
            x, y = problem.make_batch(step)
            optimizer.zero_grad()
            loss = problem.loss_fn(problem.model(x), y)
            with cockpit(step, info={"loss": loss}):
                loss.backward(create_graph=cockpit.create_graph(step))
            optimizer.step()
        return cockpit.get_output(), quantity.last_num_hvps

    problem = make_problem("mlp", "ce")
    optimizer = problem.optimizer()
    straight, hvps = steps(Q.HessMaxEV(linear(1)), problem, optimizer, 0, 3)

    problem = make_problem("mlp", "ce")
    optimizer = problem.optimizer()
    first = Q.HessMaxEV(linear(1))
    steps(first, problem, optimizer, 0, 2)
    resumed = Q.HessMaxEV(linear(1))
    resumed.load_state_dict(first.state_dict())
    output, resumed_hvps = steps(resumed, problem, optimizer, 2, 3)
    assert output[2] == straight[2] and resumed_hvps == hvps


def test_no_double_backward_graph_survives_a_step():
    """Every tensor the forward pass saved for backward is freed after the step."""
    problem = make_problem("cnn", "ce")
    quantity = Q.HessMaxEV(linear(1))
    cockpit = Cockpit(problem.params, [quantity, Q.TICDiag(linear(1))])
    alive = weakref.WeakSet()

    class Saved:
        def __init__(self, tensor):
            self.tensor = tensor

    def pack(tensor):
        # keep a detached alias: holding ``tensor`` itself (with its grad_fn) would
        # tie the holder into the graph in a cycle that the gc cannot see
        holder = Saved(tensor.detach())
        alive.add(holder)
        return holder

    def step(step, through_cockpit):
        x, y = problem.make_batch(step)
        for p in problem.params:
            p.grad = None
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda h: h.tensor):
            loss = problem.loss_fn(problem.model(x), y)
        if through_cockpit:
            with cockpit(step, info={"loss": loss, "batch_size": x.shape[0]}):
                loss.backward(create_graph=cockpit.create_graph(step))
        else:
            loss.backward(create_graph=True)
        del loss
        gc.collect()

    step(0, through_cockpit=True)
    assert len(alive) == 0, f"{len(alive)} saved tensors still referenced"
    assert 0 in cockpit.get_output()
    assert quantity._previous is not None and quantity._previous.grad_fn is None
    # control: a plain create_graph backward does keep the graph via .grad
    step(1, through_cockpit=False)
    assert len(alive) > 0
    for p in problem.params:
        p.grad = None
    gc.collect()
    assert len(alive) == 0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"rtol": 0, "atol": 0}, "rtol and atol"),
        ({"max_iter": 0}, "max_iter"),
    ],
)
def test_hess_max_ev_rejects_bad_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Q.HessMaxEV(linear(1), **kwargs)


# --- all together ---------------------------------------------------------------------
def every_exported_quantity(schedule):
    """One default instance of every exported quantity class that can be built."""
    made = []
    for name in Q.__all__:
        cls = getattr(Q, name)
        if not (isinstance(cls, type) and issubclass(cls, Quantity)):
            continue
        if cls.__module__ == "cockpit.quantities.base" or name.startswith("_"):
            continue
        try:
            made.append(cls(schedule))
        except TypeError:  # needs more than a schedule
            continue
    return made


TOGETHER = [("mlp", "ce", "sgd"), ("cnn", "mse", "sgd"), ("cnn", "ce", "sgd")]


@pytest.mark.parametrize("spec", TOGETHER, ids=["-".join(s) for s in TOGETHER])
def test_everything_together(spec, schedule):
    problem = make_problem(*spec)
    quantities = every_exported_quantity(schedule)
    quantities.append(
        Q.GradHist2d(schedule, bins=(5, 3), keep_individual=True, key="Hist2dSmall")
    )
    mine = {"GradHist1d", "GradHist2d", "TICDiag", "TICTrace", "HessMaxEV"}
    assert mine <= {q.key for q in quantities}
    result = run(problem, quantities, steps=STEPS)
    for step in tracked_steps(schedule, STEPS):
        out, record = result.output[step], result.records[step]
        grads = per_sample_gradients(problem, record)
        params = [p.reshape(-1).numpy() for p in record.params]
        values = np.concatenate([g.reshape(-1) for g in grads])
        assert out["GradHist1d"]["hist"] == np_hist_1d(values, 100, -2, 2)[0]
        bins, ranges = (40, 50), ((-1, 1), (-2, 2))
        assert out["GradHist2d"]["hist"] == np_hist_2d(grads, params, bins, ranges)[0]
        small = np_hist_2d(grads, params, (5, 3), ranges)[0]
        assert out["Hist2dSmall"]["hist"] == small
        for key, twin in zip(
            ("TICDiag", "TICTrace"), tic_twin(problem, record, "diag_h")
        ):
            if twin is None:  # negative Hessian entries: missing with the reason
                assert key not in out and key in out["missing"]
            else:
                close(out[key], twin, 1e-6, f"{key} step {step}")
        close(out["HessMaxEV"], max_ev_twin(problem, record), 1e-3, "HessMaxEV")


def _swapping_spectra(seed, dim=200):
    """Two Hessians on one eigenbasis whose two leading eigenvalues change places.

    Step 0: 1.00 (u1), 0.98 (u2), 0.96 (u3); step 1: 0.99 (u1), 1.02 (u2), 0.96 (u3);
    the rest of the spectrum in [-0.3, 0.5] at both steps.
    """
    generator = torch.Generator().manual_seed(seed)
    basis, _ = torch.linalg.qr(
        torch.randn(dim, dim, generator=generator, dtype=torch.float64)
    )
    bulk = torch.rand(dim - 3, generator=generator, dtype=torch.float64) * 0.8 - 0.3
    lead = ([1.0, 0.98, 0.96], [0.99, 1.02, 0.96])
    return [
        basis
        @ torch.diag(torch.cat([torch.tensor(top, dtype=torch.float64), bulk]))
        @ basis.T
        for top in lead
    ]


def _max_ev_on_quadratics(hessians, quantity):
    """HessMaxEV through the cockpit on ``0.5 w^T H_t w``, one Hessian per step."""
    w = torch.nn.Parameter(torch.zeros(hessians[0].shape[0], dtype=torch.float64))
    cockpit = Cockpit([w], [quantity])
    for step, hessian in enumerate(hessians):
        w.grad = None
        loss = 0.5 * w @ hessian @ w
        with cockpit(step, info={"loss": loss, "batch_size": 1}):
            loss.backward(create_graph=cockpit.create_graph(step))
    return [cockpit.get_output()[step]["HessMaxEV"] for step in range(len(hessians))]


@pytest.mark.filterwarnings("ignore::cockpit.errors.CockpitWarning")
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_warm_start_finds_leading_eigenvalues_that_changed_places(seed, monkeypatch):
    """The warm start spans several Ritz vectors, so a swap of the leading pair is seen.

    Control: from the previous eigenvector alone (one vector), Lanczos settles on that
    vector's new eigenvalue (0.99) long before the new leading one (1.02), which the
    start barely contains, shows up.
    """
    hessians = _swapping_spectra(seed)
    exact = [float(torch.linalg.eigvalsh(h)[-1]) for h in hessians]
    assert exact == pytest.approx([1.0, 1.02], abs=1e-12)
    values = _max_ev_on_quadratics(hessians, Q.HessMaxEV(linear(1)))
    for value, want in zip(values, exact, strict=True):
        close(value, want, 1e-3, "HessMaxEV")
    monkeypatch.setattr(Q.HessMaxEV, "WARM_START_VECTORS", 1)
    control = _max_ev_on_quadratics(hessians, Q.HessMaxEV(linear(1)))
    assert control[1] == pytest.approx(0.99, rel=1e-3)


def test_lanczos_returns_orthonormal_leading_ritz_vectors_first_the_answer():
    hessians = _swapping_spectra(3, dim=60)
    v0 = torch.randn(
        60, generator=torch.Generator().manual_seed(0), dtype=torch.float64
    )
    result = lanczos_max_ev(lambda v: hessians[0] @ v, v0, num_vectors=3)
    rows = result.ritz_vectors
    assert rows.shape == (3, 60) and torch.equal(rows[0], result.eigenvector)
    torch.testing.assert_close(rows @ rows.T, torch.eye(3, dtype=torch.float64))
    rayleigh = ((rows @ hessians[0]) * rows).sum(1)
    assert rayleigh[0] == pytest.approx(result.eigenvalue, rel=1e-12)
    assert rayleigh[0] >= rayleigh[1].abs() and rayleigh[0] >= rayleigh[2].abs()
    # never more rows than Lanczos steps; at least one vector is asked for
    tiny = lanczos_max_ev(lambda v: 2.0 * v, v0, num_vectors=5)
    assert tiny.num_hvps == 1 and tiny.ritz_vectors.shape == (1, 60)
    with pytest.raises(ValueError, match="num_vectors must be at least 1"):
        lanczos_max_ev(lambda v: v, v0, num_vectors=0)


def test_orthogonalise_repeats_its_pass_only_where_it_cancelled():
    """One Gram-Schmidt pass leaves rounding of the removed part behind: relative
    to what remains that is large only if most of ``w`` lay in the basis, and then
    the pass is repeated (float32, where one pass would leave ~1e-4)."""
    generator = torch.Generator().manual_seed(3)
    basis = torch.linalg.qr(torch.randn(5000, 12, generator=generator))[0].T
    inside = 1000.0 * (torch.randn(12, generator=generator) @ basis)
    outside = torch.randn(5000, generator=generator)
    outside -= basis.T @ (basis @ outside)
    outside -= basis.T @ (basis @ outside)
    calls, addmv = [], torch.addmv

    def mv(*args, **kwargs):
        calls.append(1)
        return addmv(*args, **kwargs)

    for w, passes in ((inside + outside, 2), (outside + 1e-3 * inside, 1)):
        calls.clear()
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(torch, "addmv", mv)
            result, norm, _ = _orthogonalise(w.clone(), [basis[:5], basis[5:]])
        assert len(calls) == 2 * passes  # one per block and pass
        assert norm == pytest.approx(float(result.norm()))
        assert float((basis @ result).abs().max()) <= 50 * 1.2e-7 * norm
    one_pass = (inside + outside) - basis.T @ (basis @ (inside + outside))
    assert float((basis @ one_pass).abs().max()) > 50 * 1.2e-7 * one_pass.norm()


def test_lanczos_names_a_product_that_is_not_finite():
    v0 = torch.ones(5, dtype=torch.float64)

    def hvp(v):
        return torch.full_like(v, math.inf)

    with pytest.raises(FloatingPointError, match="product 1 is not finite"):
        lanczos_max_ev(hvp, v0)


def test_lanczos_basis_stays_orthonormal_in_float32():
    """Sixty products on a clustered spectrum in float32: the vectors Lanczos hands
    to the product stay orthonormal to a few hundred ulps."""
    generator = torch.Generator().manual_seed(4)
    spectrum = torch.rand(20000, generator=generator) ** 3
    spectrum[:4] = torch.tensor([1.0, 0.999, 0.99, 0.98])
    seen = []

    def hvp(v):
        seen.append(v.clone())
        return spectrum * v

    v0 = torch.randn(20000, generator=generator)
    result = lanczos_max_ev(hvp, v0, rtol=1e-9, atol=0.0, max_iter=60)
    assert result.num_hvps == 60
    rows = torch.stack(seen).double()
    gram = rows @ rows.T - torch.eye(60, dtype=torch.float64)
    assert float(gram.abs().max()) < 300 * 1.2e-7
    assert result.eigenvalue == pytest.approx(1.0, abs=2e-3)


def test_warm_start_state_is_one_unit_vector_and_a_foreign_one_is_ignored():
    """Between steps HessMaxEV keeps one flat unit vector (the direction of the sum
    of the leading Ritz vectors), as a checkpoint from before did; a vector of
    another size (another model) falls back to a random start."""
    hessians = _swapping_spectra(0, dim=50)
    quantity = Q.HessMaxEV(linear(1))
    _max_ev_on_quadratics(hessians[:1], quantity)
    kept = quantity.state_dict()["previous"]
    assert kept.shape == (50,) and float(kept.norm()) == pytest.approx(1.0)
    cold = Q.HessMaxEV(linear(1))._start_vector(7, 50)
    foreign = Q.HessMaxEV(linear(1))
    foreign.load_state_dict({"previous": torch.ones(49, dtype=torch.float64)})
    assert torch.equal(foreign._start_vector(7, 50), cold)
    warm = Q.HessMaxEV(linear(1))
    warm.load_state_dict(quantity.state_dict())
    assert not torch.equal(warm._start_vector(7, 50), cold)


def test_lanczos_basis_grows_with_the_products_spent(monkeypatch):
    """The basis is allocated 8 vectors at first and doubled when full (a new block
    as large as the ones before), so memory follows the products spent (not
    ``max_iter``); the answer is the dense one."""
    generator = torch.Generator().manual_seed(5)
    basis, _ = torch.linalg.qr(torch.randn(300, 300, generator=generator).double())
    spectrum = torch.linspace(-1.0, 1.0, 300, dtype=torch.float64) ** 3
    spectrum[-1] = 1.02  # a small gap: many products
    matrix = basis @ torch.diag(spectrum) @ basis.T
    rows = []
    original = torch.empty

    def empty(*shape, **kwargs):
        out = original(*shape, **kwargs)
        if out.dim() == 2 and out.shape[1] == 300:  # a Lanczos basis
            rows.append(out.shape[0])
        return out

    monkeypatch.setattr(torch, "empty", empty)
    v0 = torch.randn(300, generator=generator, dtype=torch.float64)
    result = lanczos_max_ev(lambda v: matrix @ v, v0, max_iter=200)
    monkeypatch.setattr(torch, "empty", original)
    assert result.converged and result.num_hvps > 16, result.num_hvps
    close(result.eigenvalue, 1.02, 1e-3, "largest eigenvalue")
    # blocks of 8, 8, 16, 32, ... rows: the capacity doubles, nothing is copied
    assert rows == [8] + [8 * 2**k for k in range(len(rows) - 1)], rows
    assert sum(rows) >= result.num_hvps > sum(rows) // 2, (rows, result.num_hvps)
