"""Half precision (issue 11): bfloat16/float16 parameters and torch.autocast.

Every value is either right or missing with a reason that names the fix:

* statistics are computed in float32 from the per-sample gradients the model's own
  (half-precision) backward pass gives: checked against float64 statistics of the
  same per-sample gradients, with float32 error bounds derived per statistic;
* the per-sample gradients are those of one-sample-at-a-time autograd on the same
  forward graph (the brute force), to within a few roundings of the low dtype;
* curvature values are within a few units of the low dtype's roundoff of the
  float64 truth of the same (half-precision-valued) model;
* under autocast BackPACK's rules are left out (mixed dtypes): autograd computes
  the per-sample gradients, HessTrace is estimated, TICDiag is missing and its
  reason names the fix.

``u`` is the unit roundoff of the low dtype: ``2**-8`` (bfloat16), ``2**-11``
(float16); float32's is ``2**-24``.
"""

from __future__ import annotations

import copy
import math
import types
import warnings

import pytest
import torch
from backpack import extend

from cockpit import Cockpit
from cockpit import quantities as Q
from cockpit.context import StepInfo
from cockpit.errors import CockpitWarning
from cockpit.needs import Need
from cockpit.quantities.base import SingleStepQuantity
from cockpit.step.checks import StepHealth, reduction_problem, step_health
from cockpit.utils.configuration import configuration
from cockpit.utils.schedules import linear
from tests.utils import brute_force as bf

N = 8
LOW = {"bf16": torch.bfloat16, "fp16": torch.float16}
#: (how the model runs, low dtype)
MODES = {
    "bf16-params": ("params", torch.bfloat16),
    "fp16-params": ("params", torch.float16),
    "autocast-bf16": ("autocast", torch.bfloat16),
    "autocast-fp16": ("autocast", torch.float16),
}
FLOAT32_U = 2.0**-24


def roundoff(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps / 2


class ScaledMLP(torch.nn.Module):
    """A raw ``nn.Parameter`` in forward code: the autograd engine serves it."""

    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(5, 8)
        self.scale = torch.nn.Parameter(1 + 0.1 * torch.randn(8))
        self.head = torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.first(x) * self.scale))


def _mlp():
    return torch.nn.Sequential(
        torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)
    )


MODELS = {"mlp": _mlp, "scaled": ScaledMLP}


def _ce(outputs, targets):
    return torch.nn.functional.cross_entropy(outputs, targets, reduction="none")


class Setup:
    """A tiny classifier run in a half-precision mode, one batch."""

    def __init__(self, mode: str, arch: str = "mlp", spread: float = 1.0, seed=0):
        self.kind, self.low = MODES[mode]
        torch.manual_seed(seed)
        model = MODELS[arch]()
        if self.kind == "params":
            model = model.to(self.low)
        self.model = extend(model)
        self.loss_fn = extend(torch.nn.CrossEntropyLoss())
        dtype = next(model.parameters()).dtype
        centre = torch.randn(1, 5)
        self.x = (centre + spread * torch.randn(N, 5)).to(dtype)
        labels = torch.randint(0, 3, (N,))
        self.y = labels if spread >= 1 else labels[:1].expand(N)  # nearly equal
        self.optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    @property
    def params(self):
        return list(self.model.parameters())

    def forward(self):
        with torch.autocast("cpu", dtype=self.low, enabled=self.kind == "autocast"):
            outputs = self.model(self.x)
            losses = _ce(outputs, self.y)
            loss = self.loss_fn(outputs, self.y)
        return losses, loss

    def step(self, cockpit, step=0, update=False):
        losses, loss = self.forward()
        self.optimizer.zero_grad()
        info = {
            "batch_size": N,
            "individual_losses": losses,
            "loss": loss,
            "optimizer": self.optimizer,
        }
        with cockpit(step, info=info):
            loss.backward(create_graph=cockpit.create_graph(step))
        if update:
            self.optimizer.step()

    def per_sample_reference(self):
        """``[N, D]`` float64: one autograd backward per sample, same forward."""
        losses, _ = self.forward()
        rows = []
        for i in range(N):
            grads = torch.autograd.grad(losses[i], self.params, retain_graph=True)
            rows.append(torch.cat([g.reshape(-1).double() for g in grads]))
        return torch.stack(rows)

    def float64_twin(self):
        """The model in float64 with the same values (bf16 values are exact)."""
        model = copy.deepcopy(self.model).double()
        return types.SimpleNamespace(model=model, individual_loss_fn=_ce)


class Capture(SingleStepQuantity):
    """Keeps the per-sample gradients the quantities see (and curvature)."""

    def __init__(self, curvature=None):
        super().__init__(linear(1))
        self.needs = frozenset({Need.INDIVIDUAL_GRADIENTS})
        if curvature is not None:
            self.needs |= {Need(curvature)}
        self.curvature = curvature
        self.seen, self.diagonals = {}, {}

    def accumulate(self, global_step, view):
        self.seen[view.index] = view.individual_gradients().detach().clone()
        if self.curvature is not None:
            self.diagonals[view.index] = view.curvature(self.curvature).clone()

    def flat(self):
        return torch.cat(
            [self.seen[i].flatten(1).double() for i in sorted(self.seen)], dim=1
        )

    def _compute(self, global_step, ctx):
        return None


# --- float32 error bounds of the statistics (first order, Higham's gamma) -----------
def gamma(G: torch.Tensor) -> float:
    """Bound on the relative error of float32 sums of the ``D + N`` terms involved
    (each Gram entry is a sum of ``D`` products, then ``N`` of them are summed),
    doubled for the second-order terms and the final square root."""
    return 2 * (G.shape[1] + G.shape[0] + 4) * FLOAT32_U


def statistics_with_bounds(G: torch.Tensor):
    """NormTest, InnerTest, OrthoTest of ``G`` ``[N, D]`` (float64) and bounds.

    Each bound is the first-order error of cockpit's float32 formula: a Gram
    entry ``g_i . g_j`` carries at most ``gamma R_i R_j`` (``R_i = ||g_i||``), the
    mean ``g`` and ``||g||^2`` their averages; the bound propagates these through the
    uncentred formula, whose cancellation is what makes it data-dependent.
    """
    n, eps = G.shape[0], gamma(G)
    g = G.mean(0)
    q = g @ g
    R = G.norm(dim=1)
    Rbar = R.mean()
    S = (R**2).sum()
    dots = G @ g
    out = {}
    spread = S - n * q
    value = (spread / (n * (n - 1) * q)).sqrt()
    rel = 0.5 * eps * (S + 2 * n * Rbar**2) / spread + eps * Rbar**2 / q
    out["NormTest"] = (value, rel * value)
    spread = ((dots - q) ** 2).sum()
    value = (spread / (n * (n - 1) * q**2)).sqrt()
    delta = eps * (R * Rbar + Rbar**2)
    rel = 0.5 * (2 * ((dots - q).abs() * delta).sum() / spread) + 2 * eps * Rbar**2 / q
    out["InnerTest"] = (value, rel * value)
    orthogonal = R**2 - dots**2 / q
    value = (orthogonal.sum() / (n * (n - 1) * q)).sqrt()
    error = eps * (R**2 + 2 * dots.abs() * R * Rbar / q + dots**2 * Rbar**2 / q**2)
    rel = 0.5 * (error.sum() / orthogonal.sum() + eps * Rbar**2 / q)
    out["OrthoTest"] = (value, rel * value)
    return out


def first_order(setup, quantities):
    cockpit = Cockpit(setup.model.named_parameters(), quantities)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CockpitWarning)  # nothing missing
        warnings.filterwarnings("ignore", message="Full backward hook")  # PyTorch's
        warnings.filterwarnings("ignore", message="Mismatch dtype")  # PyTorch's norm
        setup.step(cockpit)
    return cockpit, cockpit.history.to_dict()[0]


# --- first-order statistics ---------------------------------------------------------
@pytest.mark.parametrize("arch", ["mlp", "scaled"])
@pytest.mark.parametrize("mode", list(MODES))
def test_first_order_statistics_are_float32_of_the_half_precision_gradients(mode, arch):
    setup = Setup(mode, arch)
    capture = Capture()
    keys = ("NormTest", "InnerTest", "OrthoTest")
    quantities = [capture, Q.GradNorm(linear(1))]
    quantities += [getattr(Q, key)(linear(1)) for key in keys]
    cockpit, values = first_order(setup, quantities)
    u = roundoff(setup.low)

    # who computed the per-sample gradients: autocast leaves BackPACK out
    for row in cockpit.coverage().params:
        if setup.kind == "autocast":
            assert row.route.engine == "autograd", row
            if row.route.module.startswith("Linear"):
                assert "ran under torch.autocast" in row.route.reason, row
        elif row.route.module.startswith("Linear"):
            assert row.route.engine == "backpack", row

    # what the quantities saw is float32, and the model's own per-sample
    # gradients: those of one autograd backward per sample. The engines
    # differentiate the mean loss (a factor 1/N through every layer, float16
    # output gradients then lose bits to subnormals) and round each layer's
    # output gradient and product once: at most 4 roundings apart per sample
    assert {t.dtype for t in capture.seen.values()} == {torch.float32}
    G = capture.flat()
    reference = setup.per_sample_reference()
    assert ((G - reference).norm(dim=1) <= 4 * u * reference.norm(dim=1)).all()

    # GradNorm: the norm of the half-precision .grad, in float32
    for got, param in zip(values["GradNorm"], setup.params):
        want = param.grad.double().norm()
        assert abs(got - want) <= gamma(G) * want, (got, want)

    # the tests: float64 statistics of the same per-sample gradients
    for key, (want, bound) in statistics_with_bounds(G).items():
        assert abs(values[key] - want) <= bound, (key, values[key], float(want), bound)
        assert bound < 1e-3 * want  # the bound says something


@pytest.mark.parametrize("mode", ["bf16-params", "fp16-params"])
def test_norm_test_of_nearly_equal_samples_does_not_cancel_to_garbage(mode):
    """With ``||g_i - g|| = 2% ||g||`` the numerator ``sum ||g_i||^2 - N ||g||^2``
    keeps ``4e-4`` of its terms: BackPACK's ``BatchL2Grad`` rounded to bfloat16
    (``2**-9``) would leave nothing of it. NormTest alone asks for squared norms
    only; in half precision they come from the per-sample gradients in float32."""
    setup = Setup(mode, spread=0.02)
    alone, values = first_order(setup, [Q.NormTest(linear(1))])
    plan = alone.plan(0)
    assert [type(e).__name__ for e in plan.requested] == ["PerSampleGradients"]
    capture = Capture()
    _, seen = first_order(setup, [capture, Q.NormTest(linear(1))])
    G = capture.flat()
    want, bound = statistics_with_bounds(G)["NormTest"]
    for got in (values["NormTest"], seen["NormTest"]):
        assert abs(got - want) <= bound, (got, float(want), float(bound))
    if setup.low == torch.bfloat16:  # the test can fail: the same numerator with
        # squared norms rounded to bfloat16 (what BatchL2Grad in that dtype
        # returns) is off by far more than the bound. (For float16 the worst case
        # is 2**-12 / gamma = 29 bounds, too close to show with one batch.)
        rounded = (G.norm(dim=1) ** 2).to(setup.low).double().sum()
        g = G.mean(0)
        spread = (rounded - N * (g @ g)).clamp(min=0)
        naive = (spread / (N * (N - 1) * (g @ g))).sqrt()
        assert abs(naive - want) > 10 * bound, (float(naive), float(want))


# --- curvature ----------------------------------------------------------------------
def curvature_truth(setup):
    """Float64 Hessian, GGN and per-sample gradients of the same-valued model."""
    twin = setup.float64_twin()
    params = [p.detach() for p in twin.model.parameters()]
    x = setup.x.double()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # hooks of frozen inputs
        hessian = bf.hessian(twin, params, x, setup.y)
        ggn = bf.ggn(twin, params, x, setup.y)
        per_sample = bf.individual_gradients(twin, params, x, setup.y)
    return params, hessian, ggn, per_sample


def curvature_quantities():
    return [
        Q.HessTrace(linear(1)),
        Q.TICDiag(linear(1), curvature="diag_ggn_exact"),
        Q.HessMaxEV(linear(1)),
    ]


@pytest.mark.parametrize("mode", ["bf16-params", "fp16-params"])
def test_curvature_of_half_precision_parameters(mode):
    """BackPACK's curvature runs in the parameters' dtype; cockpit sums in float32.

    Tolerances: a diagonal entry passes through about four roundings (the
    activations, the backpropagated square root of the loss Hessian, its square,
    the sum over samples), so ``|trace error| <= 8 u sum_d |h_dd|`` (measured: at
    most 1.7 u over five seeds). TICDiag sums positive terms ``M_d / h_d`` whose
    factors carry up to ``4 u`` each: ``8 u`` relative. HessMaxEV: the products
    are those of a perturbed Hessian ``H + E`` with ``||E|| <= a few u ||H||``,
    and Weyl's inequality moves the top eigenvalue by at most ``||E||``: ``4 u``
    relative (measured: at most 0.6 u).
    """
    setup = Setup(mode)
    cockpit = Cockpit(setup.model.parameters(), curvature_quantities())
    with warnings.catch_warnings():
        warnings.simplefilter("error", CockpitWarning)
        warnings.filterwarnings("ignore", message="Full backward hook")
        setup.step(cockpit)
    values = cockpit.history.to_dict()[0]
    u = roundoff(setup.low)
    params, hessian, ggn, per_sample = curvature_truth(setup)
    diagonals = bf.split_diagonal(hessian, params)
    for got, diagonal in zip(values["HessTrace"], diagonals, strict=True):
        assert abs(got - float(diagonal.sum())) <= 8 * u * float(diagonal.abs().sum())
    second_moment = torch.cat([(g**2).mean(0).reshape(-1) for g in per_sample])
    tic = float((second_moment / (torch.diagonal(ggn) + 1e-7)).sum())
    assert abs(values["TICDiag"] - tic) <= 8 * u * tic, (values["TICDiag"], tic)
    top = float(torch.linalg.eigvalsh(hessian).max())
    assert abs(values["HessMaxEV"] - top) <= 4 * u * top, (values["HessMaxEV"], top)


@pytest.mark.parametrize(
    "mode, arch",
    [
        ("autocast-bf16", "mlp"),
        ("autocast-fp16", "mlp"),
        ("autocast-bf16", "scaled"),
        ("autocast-fp16", "scaled"),
        ("bf16-params", "scaled"),  # (bf16 MLP: exact BackPACK curvature, above)
    ],
)
def test_curvature_under_autocast_is_estimated_or_missing_with_the_fix(mode, arch):
    """BackPACK's curvature cannot run under autocast (nor through ScaledMLP's
    forward): HessTrace with ``curvature="hutchinson"`` is a Hutchinson estimate,
    within 4 standard errors (plus the ``8 u`` of the low dtype's products) of the
    float64 truth; TICDiag of the GGN is the exact GGN of the cross-entropy (one
    backward pass per row and class, ``cockpit.curvature.source``), within ``8 u``
    as BackPACK's; HessMaxEV within ``4 u``. TICDiag of the Hessian is missing with
    a reason that names the fix."""
    setup = Setup(mode, arch)
    quantities = [
        Q.HessTrace(linear(1), curvature="hutchinson"),
        Q.TICDiag(linear(1), curvature="diag_ggn_exact"),
        Q.HessMaxEV(linear(1)),
        Q.TICDiag(linear(1), curvature="hutchinson", key="TICDiagHessian"),
    ]
    cockpit = Cockpit(setup.model.parameters(), quantities)
    with pytest.warns(CockpitWarning, match="TICDiagHessian has no value") as record:
        setup.step(cockpit)
    values = cockpit.history.to_dict()[0]
    reason = values["missing"]["TICDiagHessian"]
    if arch == "mlp":  # the only obstacle is autocast
        assert "ran under torch.autocast" in reason
        assert "Fix: run the forward pass of tracked steps outside torch.autocast" in (
            str(record[0].message)
        )
    else:  # a raw parameter in forward code: no BackPACK curvature either way
        assert "ScaledMLP.scale gets its per-sample gradients from autograd" in reason
        assert "Fix: build the model from nn.Sequential" in reason
    u = roundoff(setup.low)
    params, hessian, ggn, per_sample = curvature_truth(setup)
    stderr = values["HessTrace_estimate"]["stderr"]
    diagonals = bf.split_diagonal(hessian, params)
    for got, error, diagonal in zip(values["HessTrace"], stderr, diagonals):
        slack = 4 * error + 8 * u * float(diagonal.abs().sum())
        assert abs(got - float(diagonal.sum())) <= slack
    second_moment = torch.cat([(g**2).mean(0).reshape(-1) for g in per_sample])
    tic = float((second_moment / (torch.diagonal(ggn) + 1e-7)).sum())
    assert values["TICDiag_estimate"]["method"] == "ggn_exact"
    assert abs(values["TICDiag"] - tic) <= 8 * u * tic, (values["TICDiag"], tic)
    top = float(torch.linalg.eigvalsh(hessian).max())
    assert abs(values["HessMaxEV"] - top) <= 4 * u * top, (values["HessMaxEV"], top)


# --- the loss check -----------------------------------------------------------------
def health(loss, losses):
    info = StepInfo(0, {"loss": loss, "individual_losses": losses})
    return step_health(info, [])


def test_loss_check_allows_the_rounding_of_half_precision_losses():
    """A bfloat16 loss and the mean of bfloat16 per-sample losses are each one
    rounding from the true mean: they may differ by two units in the last place
    (``2 eps``) without a warning; a real mismatch is still found."""
    losses = torch.tensor([1.1, 1.2, 1.05, 1.17], dtype=torch.bfloat16)
    mean = losses.float().mean()
    ulp = torch.finfo(torch.bfloat16).eps * float(mean)  # spacing near the mean
    near = torch.tensor(float(mean) + ulp, dtype=torch.bfloat16)
    assert reduction_problem(health(near, losses), N) is None
    far = torch.tensor(float(mean) * 1.05, dtype=torch.bfloat16)
    assert reduction_problem(health(far, losses), N) == "mismatch"
    # float32 keeps its tolerance: the same gap is a mismatch there
    as32 = health(near.float(), losses.float())
    assert isinstance(as32, StepHealth) and as32.rtol == 1e-3
    assert reduction_problem(as32, N) == "mismatch"


# --- every path: a value or a reason ------------------------------------------------
@pytest.mark.parametrize("arch", ["mlp", "scaled"])
@pytest.mark.parametrize("mode", list(MODES))
def test_every_quantity_has_a_finite_value_or_a_reason(mode, arch):
    setup = Setup(mode, arch)
    quantities = configuration("full")
    cockpit = Cockpit(setup.model.parameters(), quantities)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):  # two-step quantities of step 1 end at step 2
            setup.step(cockpit, step, update=True)
    history = cockpit.history.to_dict()
    for step in range(2):
        values = history[step]
        missing = values.get("missing", {})
        for q in quantities:
            if q.key in missing:
                assert "Fix:" in missing[q.key], (q.key, missing[q.key])
                continue
            assert q.key in values, (mode, arch, step, q.key)
            flat = torch.tensor(_numbers(values[q.key]), dtype=torch.float64)
            assert torch.isfinite(flat).all(), (q.key, values[q.key])
    ours = [w for w in caught if issubclass(w.category, CockpitWarning)]
    assert all("Fix:" in str(w.message) for w in ours), [str(w.message) for w in ours]
    # the only values missing are curvature BackPACK cannot compute here
    reasons = {k for s in history.values() for k in s.get("missing", {})}
    assert reasons <= {"TICDiag"}, reasons


def _numbers(value):
    if isinstance(value, dict):
        return [x for v in value.values() for x in _numbers(v)]
    if isinstance(value, (list, tuple)):
        return [x for v in value for x in _numbers(v)]
    return [float(value)] if isinstance(value, (int, float)) else []


def test_unit_roundoffs():
    assert roundoff(torch.bfloat16) == 2.0**-8
    assert roundoff(torch.float16) == 2.0**-11
    assert math.isclose(roundoff(torch.float32), FLOAT32_U)


# --- a scaled backward pass (GradScaler) ---------------------------------------------
@pytest.mark.parametrize("scale", [1024.0, 0.25])
def test_scaled_backward_pass_leaves_gradient_quantities_missing(scale):
    """float16 training scales the loss (GradScaler): ``.grad`` and BackPACK's
    per-sample gradients are ``scale`` times the gradients while the per-sample
    losses are not. The gradient that reaches ``info["loss"]`` gives it away:
    quantities that read gradients are missing, with the fix; Loss and Distance,
    which read no gradients, keep their values."""
    setup = Setup("autocast-fp16")
    scaler = torch.amp.GradScaler("cpu", init_scale=scale)
    quantities = [
        Q.Loss(linear(1)),
        Q.Distance(linear(1)),
        Q.GradNorm(linear(1)),
        Q.NormTest(linear(1)),
        Q.Alpha(linear(1)),
    ]
    cockpit = Cockpit(setup.model.parameters(), quantities)
    losses, loss = setup.forward()
    info = {"batch_size": N, "individual_losses": losses, "loss": loss}
    info["optimizer"] = setup.optimizer
    message = f"differentiated {scale:g} times info\\['loss'\\].*Fix: on tracked"
    with pytest.warns(CockpitWarning, match=message):
        with cockpit(0, info=info):
            if scale > 1:
                scaler.scale(loss).backward()
            else:
                (loss * scale).backward()
    values = cockpit.history.to_dict()[0]
    assert set(values["missing"]) == {"GradNorm", "NormTest", "Alpha"}
    assert "Loss" in values and "Distance" in values
    # the unscaled backward pass of the same step has every value
    again = Cockpit(setup.model.parameters(), quantities[:4])
    with warnings.catch_warnings():
        warnings.simplefilter("error", CockpitWarning)
        setup.step(again)
    assert "missing" not in again.history.to_dict()[0]


@pytest.mark.parametrize(
    "mode, optimizer",
    [
        ("bf16-params", lambda ps: torch.optim.Adam(ps, lr=0.01)),
        # (Adam's eps=1e-8 is zero in float16: its steps are not finite)
        ("fp16-params", lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)),
    ],
    ids=["bf16-adam", "fp16-momentum"],
)
def test_alpha_replays_the_half_precision_optimizer_step(mode, optimizer):
    """Alpha replays the optimizer's step from the float32 mean gradient: the
    shadow step sees it in the parameters' dtype, as the optimizer sees .grad, so
    the replayed update is the update ``optimizer.step()`` makes, bit for bit (the
    difference of two half-precision numbers is exact in float32)."""
    from cockpit.quantities.optim import replay_update

    setup = Setup(mode)
    setup.optimizer = optimizer(setup.model.parameters())
    cockpit = Cockpit(setup.model.parameters(), [Q.Alpha(linear(1))])
    with warnings.catch_warnings():
        warnings.simplefilter("error", CockpitWarning)
        warnings.filterwarnings("ignore", message="Full backward hook")
        setup.step(cockpit, 0, update=True)
        before = [p.detach().clone() for p in setup.params]
        setup.step(cockpit, 1)
        replayed = [
            replay_update(setup.optimizer, p, p.grad.float()) for p in setup.params
        ]
        setup.optimizer.step()
    assert math.isfinite(cockpit.history.to_dict()[0]["Alpha"])
    for update, old, new in zip(replayed, before, setup.params):
        assert update.dtype == torch.float32
        assert torch.equal(update, new.detach().float() - old.float())


def test_plan_follows_the_parameters_dtype():
    """``model.to(torch.bfloat16)`` after creating the Cockpit: the next step's
    squared norms come from per-sample gradients too."""
    model = extend(_mlp())
    cockpit = Cockpit(model.parameters(), [Q.NormTest(linear(1))])
    assert [type(e).__name__ for e in cockpit.plan(0).requested] == ["BatchL2Grad"]
    model.to(torch.bfloat16)
    names = [type(e).__name__ for e in cockpit.plan(1).requested]
    assert names == ["PerSampleGradients"]
