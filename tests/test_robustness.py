"""Bad inputs end in messages that name the problem and the fix (issue 5, part 1)."""

import contextlib
import math
import warnings

import pytest
import torch
from backpack import backpack, extend
from backpack.extensions import BatchGrad

from cockpit import Cockpit
from cockpit import quantities as Q
from cockpit.cockpit import NONFINITE_KEY
from cockpit.errors import CockpitWarning
from cockpit.needs import Need
from cockpit.quantities.base import SingleStepQuantity, TwoStepQuantity
from cockpit.utils.schedules import linear
from tests.utils.harness import run
from tests.utils.problems import make_problem

EVERY = linear(1)


class _NeedsIndividual(SingleStepQuantity):
    """Reads per-sample gradients (forces BatchGrad); reports their mean norm."""

    needs = frozenset({Need.INDIVIDUAL_GRADIENTS})
    Accumulator = Q.PerParameter

    def accumulate(self, global_step, view):
        norms = view.individual_gradients().flatten(1).norm(dim=1)
        self.acc.entries[view.index] = norms

    def _compute(self, global_step, ctx):
        return [float(e.mean()) for e in self.acc.ordered(len(ctx.params))]


class _FragileOnNaN(SingleStepQuantity):
    """Raises on non-finite values, in accumulate and in track (like a histogram)."""

    needs = frozenset({Need.BATCH_L2})
    Accumulator = Q.PerParameter

    def accumulate(self, global_step, view):
        value = view.batch_l2().sum()
        if not torch.isfinite(value):
            raise ValueError("cannot bin NaN")
        self.acc.entries[view.index] = value

    def _compute(self, global_step, ctx):
        total = sum(float(v) for v in self.acc.entries.values())
        if not math.isfinite(total):
            raise ValueError("range is not finite")
        return total


def _step(cockpit, problem, step, x, y, info_update=None, loss_fn=None, opt=None):
    out = problem.model(x)
    loss = (loss_fn or problem.loss_fn)(out, y)
    info = {
        "batch_size": x.shape[0],
        "individual_losses": problem.individual_loss_fn(out, y),
        "loss": loss,
    }
    info.update(info_update or {})
    with cockpit(step, info=info):
        loss.backward(create_graph=cockpit.create_graph(step))
    return loss


# --- mean reduction -------------------------------------------------------------------
def test_sum_reduced_loss_module_fails_before_the_backward():
    problem = make_problem("mlp", "ce")
    cockpit = Cockpit(problem.params, [Q.Variance(EVERY)])
    x, y = problem.make_batch(0)
    loss = extend(torch.nn.CrossEntropyLoss(reduction="sum"))(problem.model(x), y)
    entered = False
    with pytest.raises(ValueError, match=r"sum-reduced.*reduction='mean'"):
        with cockpit(0, info={"loss": loss, "batch_size": 6}):
            entered = True
    assert not entered  # raised on entry, the backward never ran
    assert cockpit.get_output() == {}


def test_sum_of_individual_losses_is_detected_from_the_values():
    problem = make_problem("cnn", "mse")
    cockpit = Cockpit(problem.params, [Q.Loss(EVERY)])
    x, y = problem.make_batch(0)
    out = problem.model(x)
    losses = problem.individual_loss_fn(out, y)
    loss = losses.sum()  # summed by hand: no reduction flag on the graph
    info = {"loss": loss, "individual_losses": losses, "batch_size": 6}
    with pytest.raises(ValueError, match=r"sum-reduced.*is 6 times the mean.*Fix"):
        with cockpit(0, info=info):
            loss.backward()


def test_loss_that_is_not_the_mean_of_individual_losses_warns_once():
    problem = make_problem("mlp", "mse")
    cockpit = Cockpit(problem.params, [Q.Loss(EVERY)])
    penalty = sum((p**2).sum() for p in problem.params)
    with pytest.warns(CockpitWarning, match=r"differs from the mean.*Fix") as record:
        for step in range(3):
            problem.model.zero_grad()
            x, y = problem.make_batch(step)
            out = problem.model(x)
            losses = problem.individual_loss_fn(out, y)
            loss = losses.mean() + 0.1 * penalty
            info = {"loss": loss, "individual_losses": losses, "batch_size": 6}
            with cockpit(step, info=info):
                loss.backward(retain_graph=True)
    assert len([w for w in record if "differs" in str(w.message)]) == 1
    assert sorted(cockpit.get_output()) == [0, 1, 2]  # training went on


def test_mean_reduced_loss_raises_nothing():
    problem = make_problem("cnn", "ce")
    with warnings.catch_warnings():
        warnings.simplefilter("error", CockpitWarning)
        result = run(problem, [Q.Loss(EVERY), Q.Variance(EVERY)], steps=2)
    assert sorted(result.output) == [0, 1]


# --- info -----------------------------------------------------------------------------
def test_batch_size_disagreeing_with_individual_losses():
    problem = make_problem("mlp", "ce")
    cockpit = Cockpit(problem.params, [Q.Loss(EVERY)])
    x, y = problem.make_batch(0)
    with pytest.raises(ValueError, match=r"batch_size'\] is 5 but .* holds 6.*Fix"):
        _step(cockpit, problem, 0, x, y, {"batch_size": 5})
    with pytest.raises(ValueError, match=r"positive int.*Fix: pass"):
        _step(cockpit, problem, 0, x, y, {"batch_size": 6.0})
    with pytest.raises(
        ValueError, match=r"individual_losses'\] must be .*reduction='none'"
    ):
        _step(cockpit, problem, 0, x, y, {"individual_losses": torch.tensor(1.0)})


def test_missing_info_key_a_scheduled_quantity_needs():
    problem = make_problem("mlp", "ce")
    cockpit = Cockpit(problem.params, [Q.Loss(linear(2, offset=1))])
    x, y = problem.make_batch(0)
    loss = problem.loss_fn(problem.model(x), y)
    with cockpit(0, info={}):  # Loss is not scheduled at step 0: nothing needed
        loss.backward()
    with pytest.raises(KeyError, match=r"Loss needs info\['loss'\].*Fix: pass it"):
        with cockpit(1, info={"batch_size": 6}):
            pass


def test_global_step_must_be_an_int():
    problem = make_problem("mlp", "ce")
    cockpit = Cockpit(problem.params, [Q.Loss(EVERY)])
    with pytest.raises(TypeError, match=r"global_step must be an int.*Fix"):
        with cockpit(1.5, info={}):
            pass


# --- models and layers ----------------------------------------------------------------
def _mse_setup(model, quantities, named=True):
    model = extend(model.double())
    params = list(model.named_parameters()) if named else list(model.parameters())
    return model, Cockpit(params, quantities)


def _mse_step(model, cockpit, step=0, loss_fn=None, x=None):
    model.zero_grad()  # as a training loop does (else: gradient accumulation)
    torch.manual_seed(step)
    x = torch.randn(6, 3, dtype=torch.float64) if x is None else x
    y = torch.randn(6, 2, dtype=torch.float64)
    out = model(x)
    loss = (loss_fn or extend(torch.nn.MSELoss()))(out, y)
    losses = ((out - y) ** 2).mean(1)
    info = {"loss": loss, "individual_losses": losses, "batch_size": 6}
    with cockpit(step, info=info):
        loss.backward(create_graph=cockpit.create_graph(step))


def test_model_not_extended():
    # with the per-sample losses, the ghost engine computes what BackPACK cannot
    model = torch.nn.Linear(3, 2).double()
    cockpit = Cockpit(model.parameters(), [Q.Variance(EVERY)])
    _mse_step(model, cockpit)
    assert len(cockpit.get_output()[0]["Variance"]) == 2
    route = cockpit.coverage().params[0].route
    assert route.engine == "ghost" and "not backpack.extend-ed" in route.reason
    # without them, a forgotten extend() is the error
    model.zero_grad()
    cockpit = Cockpit(model.parameters(), [Q.Variance(EVERY)])
    x = torch.randn(6, 3, dtype=torch.float64)
    loss = torch.nn.MSELoss()(model(x), torch.zeros(6, 2, dtype=torch.float64))
    with pytest.raises(
        RuntimeError, match=r"no results for parameter.*backpack.extend"
    ):
        with cockpit(0, info={"loss": loss}):
            loss.backward()


def test_loss_not_extended_for_curvature():
    model, cockpit = _mse_setup(
        torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2)),
        [Q.HessTrace(EVERY)],
    )
    with pytest.raises(
        RuntimeError, match=r"loss function was not extended.*Fix"
    ) as info:
        _mse_step(model, cockpit, loss_fn=torch.nn.MSELoss())
    assert "HessTrace" in str(info.value)
    assert isinstance(info.value.__cause__, AssertionError)


def _layernorm_net():
    return torch.nn.Sequential(
        torch.nn.Linear(3, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 2)
    )


class _Scale(torch.nn.Module):
    """A custom layer with a raw parameter (BackPACK has no rule for it)."""

    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(4))

    def forward(self, x):
        return x * self.scale


def test_layer_without_backpack_rule_goes_to_autograd_and_is_named():
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), _Scale(), torch.nn.Linear(4, 2))
    model, cockpit = _mse_setup(net, [Q.Variance(EVERY)])
    with warnings.catch_warnings():  # neither BackPACK nor cockpit warns
        warnings.simplefilter("error", CockpitWarning)
        warnings.filterwarnings("error", message=".*does not have an extension")
        _mse_step(model, cockpit)
    assert len(cockpit.get_output()[0]["Variance"]) == 5
    rows = cockpit.coverage().params
    engines = [row.route.engine for row in rows]
    assert engines == ["backpack"] * 2 + ["autograd"] + ["backpack"] * 2
    assert "'1.scale'" in rows[2].label and "_Scale" in rows[2].route.reason


def test_curvature_without_backpack_rule_is_missing_or_strict_error():
    # (the Hessian trace is estimated instead:
    # tests/engines/test_any_model_curvature.py)
    def ggn():
        return [Q.HessTrace(EVERY, curvature="diag_ggn_exact")]

    model, cockpit = _mse_setup(_layernorm_net(), ggn(), named=False)
    with pytest.warns(CockpitWarning, match=r"HessTrace has no value.*LayerNorm.*Fix"):
        _mse_step(model, cockpit)
    assert "HessTrace" not in cockpit.get_output().get(0, {})
    strict = Cockpit(model.parameters(), ggn(), strict=True)
    with pytest.raises(RuntimeError, match=r"strict=True.*HessTrace.*#2.*LayerNorm"):
        _mse_step(model, strict)


def _batchnorm_net():
    return torch.nn.Sequential(
        torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2)
    )


class _KeepsIndividual(SingleStepQuantity):
    """Keeps the per-sample gradients it is shown (to compare with brute force)."""

    needs = frozenset({Need.INDIVIDUAL_GRADIENTS})
    Accumulator = Q.PerParameter

    def accumulate(self, global_step, view):
        self.acc.entries[view.index] = view.individual_gradients().clone()
        self.kept = getattr(self, "kept", {})
        self.kept[view.index] = self.acc.entries[view.index]

    def _compute(self, global_step, ctx):
        return [float(e.norm()) for e in self.acc.ordered(len(ctx.params))]


def _bn(affine=True, train=True, running=True, channels=4, cls=None):
    """A BatchNorm layer; in eval mode with running statistics that are not 0, 1."""
    cls = cls or torch.nn.BatchNorm1d
    layer = cls(channels, affine=affine, track_running_stats=running)
    if running:
        gen = torch.Generator().manual_seed(channels)
        layer.running_mean.copy_(torch.randn(channels, generator=gen))
        layer.running_var.copy_(0.5 + torch.rand(channels, generator=gen))
    return layer.train(train)


class _FunctionalBatchNorm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.head = torch.nn.Linear(3, 4), torch.nn.Linear(4, 2)

    def forward(self, x):
        h = torch.nn.functional.batch_norm(self.inp(x), None, None, training=True)
        return self.head(torch.tanh(h))


class _SharedBatchNorm(torch.nn.Module):
    """One BatchNorm layer on two branches (two calls, two sets of statistics)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(3, 4), torch.nn.Linear(3, 4)
        self.bn = torch.nn.BatchNorm1d(4)
        self.head = torch.nn.Linear(4, 2)

    def forward(self, x):
        return self.head(torch.tanh(self.bn(self.a(x)) + self.bn(self.b(x))))


class _Centre(torch.nn.Module):
    """Subtracts the mini-batch mean: mixes the samples without being a BatchNorm."""

    def forward(self, x):
        return x - x.mean(0)


def _features(*shape):
    return lambda: torch.randn(6, *shape, dtype=torch.float64)


#: name -> (model, input, the parameters before a batch norm that mixes the samples,
#: other parameters that go to autograd: used twice, or mixed by other code)
BATCHNORM_CASES = {
    "linear-bn-linear": (_batchnorm_net, _features(3), {0, 1}, set()),
    "bn-without-affine": (
        lambda: torch.nn.Sequential(
            torch.nn.Linear(3, 4), _bn(affine=False), torch.nn.Tanh(),
            torch.nn.Linear(4, 2),
        ),
        _features(3), {0, 1}, set(),
    ),
    "bn-on-the-data": (
        lambda: torch.nn.Sequential(
            _bn(channels=3), torch.nn.Linear(3, 4), torch.nn.Tanh(),
            torch.nn.Linear(4, 2),
        ),
        _features(3), set(), set(),
    ),
    "eval-bn-then-train-bn": (
        lambda: torch.nn.Sequential(
            torch.nn.Linear(3, 4), _bn(train=False), torch.nn.Tanh(),
            torch.nn.Linear(4, 4), _bn(), torch.nn.Tanh(), torch.nn.Linear(4, 2),
        ),
        _features(3), {0, 1, 2, 3, 4, 5}, set(),
    ),
    # the first layer's and the first BatchNorm's samples mix through the second too
    "nested-train-bns": (
        lambda: torch.nn.Sequential(
            torch.nn.Linear(3, 4), _bn(), torch.nn.Tanh(),
            torch.nn.Linear(4, 4), _bn(), torch.nn.Tanh(), torch.nn.Linear(4, 2),
        ),
        _features(3), {0, 1, 2, 3, 4, 5}, set(),
    ),
    "eval-bn-without-running-statistics": (
        lambda: torch.nn.Sequential(
            torch.nn.Linear(3, 4), _bn(train=False, running=False), torch.nn.Tanh(),
            torch.nn.Linear(4, 2),
        ),
        _features(3), {0, 1}, set(),
    ),
    "eval-bn": (
        lambda: torch.nn.Sequential(
            torch.nn.Linear(3, 4), _bn(train=False), torch.nn.Tanh(),
            torch.nn.Linear(4, 2),
        ),
        _features(3), set(), set(),
    ),
    "bn1d-on-sequences": (
        lambda: torch.nn.Sequential(
            torch.nn.Conv1d(3, 4, 2), _bn(), torch.nn.Tanh(), torch.nn.Flatten(),
            torch.nn.Linear(16, 2),
        ),
        _features(3, 5), {0, 1}, set(),
    ),
    "bn2d": (
        lambda: torch.nn.Sequential(
            torch.nn.Conv2d(1, 3, 3), _bn(channels=3, cls=torch.nn.BatchNorm2d),
            torch.nn.Tanh(), torch.nn.Flatten(), torch.nn.Linear(27, 2),
        ),
        _features(1, 5, 5), {0, 1}, set(),
    ),
    "bn3d-eval": (
        lambda: torch.nn.Sequential(
            torch.nn.Conv3d(1, 2, 2),
            _bn(channels=2, train=False, cls=torch.nn.BatchNorm3d),
            torch.nn.Tanh(), torch.nn.Flatten(), torch.nn.Linear(16, 2),
        ),
        _features(1, 3, 3, 3), set(), set(),
    ),
    "bn3d": (
        lambda: torch.nn.Sequential(
            torch.nn.Conv3d(1, 2, 2), _bn(channels=2, cls=torch.nn.BatchNorm3d),
            torch.nn.Tanh(), torch.nn.Flatten(), torch.nn.Linear(16, 2),
        ),
        _features(1, 3, 3, 3), {0, 1}, set(),
    ),
    "functional-batch-norm": (_FunctionalBatchNorm, _features(3), {0, 1}, set()),
    # the layer's weight and bias are used twice: autograd for that reason
    "shared-bn": (_SharedBatchNorm, _features(3), {0, 1, 2, 3}, {4, 5}),
    # samples mixed by code after the BatchNorm: its weight and bias too (probe)
    "bn-then-centring": (
        lambda: torch.nn.Sequential(
            torch.nn.Linear(3, 4), _bn(), _Centre(), torch.nn.Tanh(),
            torch.nn.Linear(4, 2),
        ),
        _features(3), {0, 1}, {2, 3},
    ),
}  # fmt: skip


def _mse_batch(features, seed=0):
    torch.manual_seed(seed)
    return features(), torch.randn(6, 2, dtype=torch.float64)


def _tracked_mse_step(model, cockpit, x, y, step=0):
    model.zero_grad()
    out = model(x)
    loss = extend(torch.nn.MSELoss())(out, y)
    losses = ((out - y) ** 2).mean(1)
    info = {"loss": loss, "individual_losses": losses, "batch_size": 6}
    with cockpit(step, info=info):
        loss.backward()


def _brute_force_and_backpack(model, x, y):
    """Per-sample gradients of the batch: by definition (each sample's loss through
    the batch's graph, float64) and BackPACK's BatchGrad."""
    params = list(model.parameters())
    losses = ((model(x) - y) ** 2).mean(1)
    want = [
        torch.stack(
            [torch.autograd.grad(loss, p, retain_graph=True)[0] for loss in losses]
        )
        for p in params
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # BackPACK's own BatchNorm warning
        try:
            with backpack(BatchGrad()):  # (BackPACK stores inputs in its context)
                extend(torch.nn.MSELoss())(model(x), y).backward()
        except AttributeError:  # BackPACK's BatchNorm rule reads running_var,
            return want, None  # which track_running_stats=False leaves None
    got = [getattr(p, "grad_batch", None) for p in params]
    model.zero_grad()
    return want, [None if g is None else g * 6 for g in got]  # BackPACK's: the mean's


@pytest.mark.parametrize("case", sorted(BATCHNORM_CASES))
def test_batchnorm_mixing_the_samples_sends_the_layers_before_it_to_autograd(case):
    """BackPACK's per-sample results are ``d l_i / d theta`` (float64, brute force)
    for every parameter except those before a batch norm that normalises with the
    mini-batch's statistics (the table's sets, proven here where BackPACK runs);
    cockpit computes those with the autograd engine, so every recorded per-sample
    gradient is exact."""
    build, features, mixed, extra = BATCHNORM_CASES[case]
    torch.manual_seed(0)
    model = extend(build().double())
    x, y = _mse_batch(features)
    want, got = _brute_force_and_backpack(model, x, y)
    for index, w in enumerate(want):
        if got is None or index in extra:
            continue  # BackPACK cannot run it, or it is wrong for another reason
        if index in mixed:
            assert not torch.allclose(got[index], w, rtol=1e-3, atol=1e-8), index
            # what they are instead: the mini-batch gradient split by input sample
            torch.testing.assert_close(
                got[index].sum(0), w.sum(0), rtol=1e-10, atol=1e-12
            )
        else:
            torch.testing.assert_close(got[index], w, rtol=1e-10, atol=1e-12)
    quantities = [_KeepsIndividual(EVERY), Q.Variance(EVERY)]
    cockpit = Cockpit(list(model.parameters()), quantities, strict=True)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _tracked_mse_step(model, cockpit, x, y)
    ours = [str(w.message) for w in record if issubclass(w.category, CockpitWarning)]
    if mixed:
        assert len(ours) == 1, ours
        assert f"{len(mixed)} parameter tensor(s)" in ours[0]
        assert "sit before batch norms" in ours[0] and "Fix" in ours[0]
    else:
        assert ours == []
    rows = cockpit.coverage().params
    engines = {row.index: row.route.engine for row in rows}
    assert {i for i, e in engines.items() if e == "autograd"} == mixed | extra
    for row in rows:
        if row.index in mixed:
            assert row.route.reason.startswith("samples mix through "), row.route
    kept = cockpit.quantities[0].kept
    for index, w in enumerate(want):
        torch.testing.assert_close(kept[index], w, rtol=1e-10, atol=1e-12)
    output = cockpit.get_output()[0]
    assert "missing" not in output and len(output["Variance"]) == len(want)


def test_a_shared_batchnorm_in_eval_then_train_mode_is_exact_at_both_steps():
    """The probe's memory of a module (from an eval-mode step) does not stand in
    for the batch norm check of a later train-mode step."""
    torch.manual_seed(0)
    model = extend(_SharedBatchNorm().double())
    cockpit = Cockpit(list(model.parameters()), [_KeepsIndividual(EVERY)])
    for step, train in enumerate((False, True, False, True)):
        model.train(train)
        x, y = _mse_batch(_features(3), seed=step)
        want, _ = _brute_force_and_backpack(model, x, y)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", CockpitWarning)
            _tracked_mse_step(model, cockpit, x, y, step)
        kept = cockpit.quantities[0].kept
        for index, w in enumerate(want):
            torch.testing.assert_close(kept[index], w, rtol=1e-10, atol=1e-12)


def test_a_batchnorm_outside_the_losses_graph_changes_nothing():
    """A teacher with a train-mode BatchNorm, not extended, run without a graph, in
    one container with the student."""
    torch.manual_seed(0)
    teacher = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    student = extend(
        torch.nn.Sequential(
            torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2)
        ).double()
    )
    # one container, alive (the module map finds containers among live objects)
    both = torch.nn.ModuleDict({"teacher": teacher, "student": student})
    x = torch.randn(6, 3, dtype=torch.float64)
    with torch.no_grad():
        y = teacher.double()(x)
    cockpit = Cockpit(list(student.parameters()), [_KeepsIndividual(EVERY)])
    with warnings.catch_warnings():
        warnings.simplefilter("error", CockpitWarning)
        _tracked_mse_step(student, cockpit, x, y)
    assert {row.route.engine for row in cockpit.coverage().params} == {"backpack"}
    assert both["student"] is student


def test_batchnorm_in_train_mode():
    # Variance's BackPACK extensions refuse BatchNorm in train mode; cockpit's rule
    # for its weight and bias and the autograd engine before it give every value
    model, cockpit = _mse_setup(_batchnorm_net(), [Q.Variance(EVERY)])
    with pytest.warns(CockpitWarning, match=r"2 parameter tensor\(s\) \('0.weight'"):
        _mse_step(model, cockpit)
    assert "missing" not in cockpit.get_output()[0]
    assert len(cockpit.get_output()[0]["Variance"]) == 6
    # in eval mode BackPACK's engine does it all, without a warning
    model.eval()
    model, cockpit = _mse_setup(model, [Q.Variance(EVERY), _NeedsIndividual(EVERY)])
    with warnings.catch_warnings():
        warnings.simplefilter("error", CockpitWarning)
        _mse_step(model, cockpit)
    assert set(cockpit.get_output()[0]) == {"Variance", "_NeedsIndividual"}
    assert {row.route.engine for row in cockpit.coverage().params} == {"backpack"}


class _WithUnusedLayer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.used = torch.nn.Linear(3, 2)
        self.unused = torch.nn.Linear(3, 2)

    def forward(self, x):
        return self.used(x)


@pytest.mark.parametrize("engines", ["default", "sharded"])
def test_parameters_without_gradient_count_as_zero_and_warn_once(engines):
    """Also with only the engines that serve FSDP2 models (the ghost engine),
    which before showed an unused parameter no per-sample gradients and raised
    "No per-sample gradients for parameter #2 ... declare the matching Need"."""
    from tests.utils.fsdp import sharded_engines

    def quantities():
        return [Q.Variance(EVERY), Q.GradNorm(EVERY), _NeedsIndividual(EVERY)]

    torch.manual_seed(0)
    chosen = sharded_engines() if engines == "sharded" else contextlib.nullcontext()
    with chosen:
        model, cockpit = _mse_setup(_WithUnusedLayer(), quantities())
        reference = Cockpit(model.used.parameters(), quantities())
    if engines == "sharded":
        routes = {row.route.engine for row in cockpit.coverage().params}
        assert "backpack" not in routes, routes
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for step in range(3):
            model.zero_grad()
            _mse_step(model, cockpit, step)
            model.zero_grad()
            _mse_step(model, reference, step)
    ours = [str(w.message) for w in record if issubclass(w.category, CockpitWarning)]
    assert len(ours) == 1
    assert "'unused.weight' (#2, shape (2, 3)), 'unused.bias'" in ours[0]
    assert "received no gradient" in ours[0] and "Fix" in ours[0]
    for step in range(3):
        got, want = cockpit.get_output()[step], reference.get_output()[step]
        for key in ("Variance", "GradNorm", "_NeedsIndividual"):
            assert got[key][:2] == pytest.approx(want[key], rel=1e-12)
            assert got[key][2:] == [0.0, 0.0]


# --- quantities, configurations, schedules --------------------------------------------
def test_non_quantity_and_single_quantity():
    problem = make_problem("mlp", "ce")
    with pytest.raises(ValueError, match=r"Only cockpit.quantities.Quantity.*'Loss'"):
        Cockpit(problem.params, ["Loss"])
    with pytest.raises(ValueError, match="instantiate it"):
        Cockpit(problem.params, [Q.Loss])
    with pytest.raises(TypeError, match=r"single quantity.*quantities=\[...\]"):
        Cockpit(problem.params, Q.Loss(EVERY))


def test_bad_parameters():
    problem = make_problem("mlp", "ce")
    with pytest.raises(ValueError, match=r"same tensor as parameter #0.*Fix"):
        Cockpit([problem.params[0], problem.params[0]])
    with pytest.raises(TypeError, match=r"not a tensor.*named_parameters"):
        Cockpit([problem.model])
    with pytest.raises(ValueError, match="does not require gradients"):
        Cockpit([torch.zeros(2)])


def test_unknown_configuration_and_curvature_labels():
    from cockpit.utils.configuration import configuration

    with pytest.raises(KeyError, match=r"Unknown configuration 'ful'.*'full'"):
        configuration("ful")
    with pytest.raises(ValueError, match=r"Unknown curvature 'hessian'.*'diag_h'"):
        Q.HessTrace(EVERY, curvature="hessian")


def test_invalid_schedule():
    with pytest.raises(ValueError, match=r"'interval' must be >= 1, got 0.*linear"):
        linear(0)


# --- non-finite values ----------------------------------------------------------------
def _steps_with_nan_at_step_2(cockpit, problem, opt, steps, optimizer=False):
    """Tracked steps whose input holds a NaN at step 2; that update is skipped."""
    for step in range(steps):
        opt.zero_grad()
        x, y = problem.make_batch(step)
        if step == 2:
            x = x.clone()
            x[0, 0] = math.nan
        info = {"optimizer": opt} if optimizer else None
        _step(cockpit, problem, step, x, y, info_update=info)
        if step != 2:  # the user skips the update of a bad step
            opt.step()


def test_nonfinite_steps_are_recorded_and_training_goes_on():
    problem = make_problem("mlp", "mse", "sgd")
    quantities = [
        Q.Loss(EVERY),
        Q.GradNorm(EVERY),
        Q.Variance(EVERY),
        Q.UpdateSize(EVERY),
        _FragileOnNaN(EVERY),
    ]
    cockpit = Cockpit(problem.params, quantities)
    opt = problem.optimizer()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _steps_with_nan_at_step_2(cockpit, problem, opt, steps=5)
    output = cockpit.get_output()
    assert sorted(output) == [0, 1, 2, 3, 4]
    assert [s for s in output if NONFINITE_KEY in output[s]] == [2]
    assert output[2][NONFINITE_KEY] == ["loss", "gradients"]
    assert math.isnan(output[2]["Loss"])
    assert "_FragileOnNaN" not in output[2]  # dropped there, present elsewhere
    assert all("_FragileOnNaN" in output[s] for s in (0, 1, 3, 4))
    assert all(math.isfinite(output[s]["Loss"]) for s in (0, 1, 3, 4))
    ours = [str(w.message) for w in record if issubclass(w.category, CockpitWarning)]
    assert len([m for m in ours if "not finite" in m]) == 1
    assert any(
        "loss and the gradients are not finite" in m and "Fix" in m for m in ours
    )


def test_infinite_gradients_only_and_every_later_step_nonfinite():
    problem = make_problem("cnn", "ce", "sgd")
    cockpit = Cockpit(problem.params, [Q.Loss(EVERY), Q.GradNorm(EVERY)])
    opt = problem.optimizer()
    hook = problem.params[0].register_hook(lambda g: g * math.inf)
    with pytest.warns(CockpitWarning, match="gradients is not finite"):
        for step in range(3):
            opt.zero_grad()
            _step(cockpit, problem, step, *problem.make_batch(step))
            opt.step()  # parameters become NaN: all later losses are NaN too
            hook.remove() if step == 0 else None
    output = cockpit.get_output()
    assert output[0][NONFINITE_KEY] == ["gradients"]
    assert output[1][NONFINITE_KEY] == ["loss", "gradients"]
    assert output[2][NONFINITE_KEY] == ["loss", "gradients"]


def test_values_a_nonfinite_step_takes_away_are_missing_with_a_reason():
    """Alpha of the step before (finished by the bad step), Alpha and HessMaxEV of
    the bad step: recorded as missing with why, not just absent; the steps
    around them keep their values."""
    problem = make_problem("mlp", "ce", "sgd")
    quantities = [Q.Alpha(EVERY), Q.HessMaxEV(EVERY), Q.Loss(EVERY)]
    cockpit = Cockpit(problem.params, quantities)
    opt = problem.optimizer()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _steps_with_nan_at_step_2(cockpit, problem, opt, steps=5, optimizer=True)
    output = cockpit.get_output()
    assert [s for s in output if NONFINITE_KEY in output[s]] == [2]
    for step in (0, 3):
        assert isinstance(output[step]["Alpha"], float)
    for step in (0, 1, 3, 4):
        assert math.isfinite(output[step]["HessMaxEV"])
    for step in (1, 2):
        assert "Alpha" not in output[step]
        assert "not finite" in output[step]["missing"]["Alpha"]
    assert "HessMaxEV" not in output[2]
    assert "non-finite step 2" in output[2]["missing"]["HessMaxEV"]
    ours = [str(w.message) for w in record if issubclass(w.category, CockpitWarning)]
    assert len([m for m in ours if m.startswith("Alpha has no value")]) == 1
    assert len([m for m in ours if m.startswith("HessMaxEV has no value")]) == 1


class _EndsOnFiniteValues(TwoStepQuantity):
    """Starts at a step, finishes at the next: raises on a non-finite loss there."""

    needs = frozenset()

    def _compute_start(self, global_step, ctx):
        return float(ctx.info.get("loss").detach())

    def _compute_end(self, global_step, ctx, state):
        loss = float(ctx.info.get("loss").detach())
        if not math.isfinite(loss):
            raise ValueError("cannot finish on a non-finite loss")
        return loss - state


def test_a_two_step_value_the_bad_step_was_to_finish_is_missing_at_its_step():
    problem = make_problem("mlp", "ce", "sgd")
    cockpit = Cockpit(problem.params, [_EndsOnFiniteValues(EVERY)])
    opt = problem.optimizer()
    with pytest.warns(CockpitWarning) as said:
        _steps_with_nan_at_step_2(cockpit, problem, opt, steps=4)
    messages = [str(w.message) for w in said]
    assert any("_EndsOnFiniteValues has no value" in m for m in messages), messages
    assert any(
        "Step 2: the loss and the gradients are not finite" in m for m in messages
    )
    output = cockpit.get_output()
    assert isinstance(output[0]["_EndsOnFiniteValues"], float)
    for step in (1, 2):  # 1: finished by the bad step; 2: started there
        assert "_EndsOnFiniteValues" not in output[step]
        reason = output[step]["missing"]["_EndsOnFiniteValues"]
        assert "non-finite step 2" in reason and "Fix:" in reason


def test_finite_step_errors_of_quantities_still_surface():
    class _Broken(_FragileOnNaN):
        def accumulate(self, global_step, view):
            raise ZeroDivisionError("bug in a quantity")

    problem = make_problem("mlp", "ce")
    cockpit = Cockpit(problem.params, [_Broken(EVERY)])
    x, y = problem.make_batch(0)
    with pytest.raises(ZeroDivisionError, match="bug in a quantity"):
        _step(cockpit, problem, 0, x, y)
    assert not any(hasattr(p, "batch_l2") for p in problem.params)


# --- log paths ------------------------------------------------------------------------
def test_unwritable_log_path(tmp_path):
    problem = make_problem("mlp", "ce")
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    with pytest.raises(OSError, match=r"Cannot write the cockpit log to .*a_file.*Fix"):
        Cockpit(problem.params, [Q.Loss(EVERY)], logpath=str(blocker / "run" / "log"))
    (tmp_path / "taken.jsonl").mkdir()
    with pytest.raises(IsADirectoryError, match=r"Cannot write the cockpit log.*Fix"):
        Cockpit(problem.params, logpath=str(tmp_path / "taken.jsonl"))
    result = run(problem, [Q.Loss(EVERY)], steps=1)
    with pytest.raises(OSError, match=r"Cannot write the cockpit log.*Fix"):
        result.cockpit.write(str(blocker / "log"))
    assert 0 in result.cockpit.get_output()  # the history is still there
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "taken.jsonl"]


def test_bare_file_name_as_log_path(tmp_path, monkeypatch):
    from cockpit.history import History

    monkeypatch.chdir(tmp_path)
    problem = make_problem("mlp", "ce")
    cockpit = Cockpit(problem.params, [Q.Loss(EVERY)], logpath="streamed")
    x, y = problem.make_batch(0)
    _step(cockpit, problem, 0, x, y)
    assert cockpit.write("final") == "final.json"
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "final.json",
        "streamed.jsonl",
    ]
    for name in ("final", "streamed"):
        assert History.from_json(name).to_dict() == cockpit.get_output()


# --- long runs ------------------------------------------------------------------------
def test_history_stores_large_numeric_values_compactly_and_reads_them_back_exactly():
    from cockpit.history import History

    history = History()
    counts = torch.arange(2000, dtype=torch.float32) / 7
    edges = [torch.linspace(0, 1, 41, dtype=torch.float64), torch.linspace(0, 1, 51)]
    history.add(0, "Hist", {"hist": counts, "edges": edges})
    history.add(0, "Counts", list(range(300)))
    history.add(0, "Mixed", [1, 2.0] * 10)
    history.add(0, "Small", [1.0, 2.0])
    history.add(0, "Grid", [[float(i + j) for j in range(8)] for i in range(4)])
    back = history[0]
    assert back["Hist"]["hist"] == counts.tolist()  # float32 values, exactly
    assert back["Hist"]["edges"] == [e.tolist() for e in edges]
    assert back["Counts"] == list(range(300)) and type(back["Counts"][0]) is int
    assert back["Mixed"] == [1, 2.0] * 10 and type(back["Mixed"][0]) is int
    assert back["Small"] == [1.0, 2.0]
    assert back["Grid"] == [[float(i + j) for j in range(8)] for i in range(4)]
    back["Counts"].append("changed")  # readers get copies
    assert len(history[0]["Counts"]) == 300


def test_history_memory_per_number_is_about_eight_bytes():
    import gc
    import tracemalloc

    from cockpit.history import History

    steps, bins = 50, 2000
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        history = History()
        for step in range(steps):  # as a histogram quantity returning lists would
            history.add(
                step, "GradHist1d", {"hist": [float(step + i) for i in range(bins)]}
            )
        gc.collect()
        used = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert used < steps * bins * 9, used  # a list of floats would take ~32 bytes each
    assert history.memory_bytes() < steps * bins * 9
    assert history.memory_bytes() > steps * bins * 8


def test_soak_benchmark_runs(tmp_path):
    from benchmarks.soak import main

    out = tmp_path / "soak.md"
    threads = str(torch.get_num_threads())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        args = ["--steps", "12", "--interval", "5", "--sample-every", "5"]
        args += ["--mmap-threshold", "0"]
        main(args + ["--batch-size", "4", "--threads", threads, "--out", str(out)])
    text = out.read_text()
    for row in ("| first | 2 |", "| middle | 7 |", "| last | 11 |"):
        assert row in text, text


def test_a_cockpit_that_can_never_track_anything_fails_at_construction():
    param = torch.zeros(2, requires_grad=True)
    with pytest.raises(ValueError, match="no parameters.*model.parameters"):
        Cockpit([], [Q.Loss(EVERY)])
    with pytest.raises(ValueError, match="empty list of quantities.*configuration"):
        Cockpit([param], [])
    with pytest.raises(ValueError, match="Quantity instances.*instantiate it"):
        Cockpit([param], [Q.Loss])
    with pytest.raises(ValueError, match="Quantity instances"):
        Cockpit([param], ["Loss"])
    with pytest.raises(TypeError, match="single quantity.*quantities=\\[...\\]"):
        Cockpit([param], Q.Loss(EVERY))
    Cockpit([param]).add(Q.Loss(EVERY))  # no quantities yet: 1.0.2 adds them later


def test_old_style_needs_method_is_refused_with_the_fix():
    with pytest.raises(TypeError, match="needs must be data.*frozenset"):

        class _Old(SingleStepQuantity):
            def needs(self, global_step):
                return {Need.BATCH_L2}

            def _compute(self, global_step, ctx):
                return 0.0


def _steps_with_a_user_warning(config: str, steps: int = 3) -> None:
    """Tracked steps of an MLP whose loop warns from the same line every step."""
    from cockpit.utils.configuration import configuration

    torch.manual_seed(0)
    model = extend(
        torch.nn.Sequential(
            torch.nn.Linear(5, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3)
        )
    )
    loss_fn = extend(torch.nn.CrossEntropyLoss())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    cockpit = Cockpit(model.parameters(), quantities=configuration(config))
    for step in range(steps):
        warnings.warn("the loop's own warning", UserWarning, stacklevel=1)  # here
        x, y = torch.randn(6, 5), torch.randint(0, 3, (6,))
        outputs = model(x)
        loss = loss_fn(outputs, y)
        losses = torch.nn.functional.cross_entropy(outputs, y, reduction="none")
        info = {"batch_size": 6, "individual_losses": losses, "loss": loss}
        with cockpit(step, info={**info, "optimizer": optimizer}):
            loss.backward(create_graph=cockpit.create_graph(step))
        optimizer.step()
        optimizer.zero_grad()


@pytest.mark.parametrize("config", ["economy", "full"])
def test_a_warning_shown_once_per_location_stays_once_across_tracked_steps(config):
    """Python shows a warning once per code location by default; changing the
    warning filters (``catch_warnings``) forgets what was shown. Cockpit keeps its
    engines' noise out without that, so the loop's warning shows once, not at
    every step, and the filters are as before."""
    with warnings.catch_warnings():  # imports on first use may add filters of
        warnings.simplefilter("ignore")  # their own (sympy's): done before
        _steps_with_a_user_warning(config, steps=3)  # every code path once
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        before = list(warnings.filters)
        _steps_with_a_user_warning(config)
        after = list(warnings.filters)
    ours = [w for w in caught if str(w.message) == "the loop's own warning"]
    assert len(ours) == 1, [str(w.message) for w in caught]
    assert after == before
    assert not [w for w in caught if "Full backward hook" in str(w.message)]


def test_the_engines_noise_stays_quiet_under_an_error_filter():
    """A user (or test suite) turning warnings into errors still gets tracked
    steps: the messages cockpit keeps quiet are ignored before that filter."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", message="the loop's own warning")
        _steps_with_a_user_warning("full", steps=2)


def test_quiet_warnings_takes_out_only_its_own_entries_even_on_error():
    from cockpit.errors import quiet_warnings

    with warnings.catch_warnings():
        before = list(warnings.filters)
        with pytest.raises(RuntimeError), quiet_warnings("noise"):
            assert len(warnings.filters) == len(before) + 1
            # the user's own equal filter, added in front of ours, stays
            warnings.filterwarnings("ignore", message="noise")
            users = warnings.filters[0]
            with warnings.catch_warnings(record=True) as caught:
                warnings.warn("noise, ignored", stacklevel=1)
                warnings.warn("signal, shown", stacklevel=1)
            raise RuntimeError
        assert warnings.filters == [users, *before]
        assert warnings.filters[0] is users
    assert [str(w.message) for w in caught] == ["signal, shown"]


def _tiny_resnet():
    from benchmarks.real_models import ResNet18

    return ResNet18(width=2)  # nested BatchNorms, in-place residual, downsampling


#: design A on the cases above (not centring: it mixes samples outside a batch norm)
DESIGN_CASES = {
    **{k: v[:2] for k, v in BATCHNORM_CASES.items() if k != "bn-then-centring"},
    "resnet18-layout": (_tiny_resnet, _features(3, 8, 8)),
}


@pytest.mark.parametrize("case", sorted(DESIGN_CASES))
def test_the_statistics_jacobian_design_is_exact(case):
    """benchmarks.studies.batchnorm_designs' low-rank design (per-sample gradients with
    the statistics held, plus their Jacobian's rows) equals brute force in float64."""
    from benchmarks.studies.batchnorm_designs import stats_jacobian_gradients

    build, features = DESIGN_CASES[case]
    torch.manual_seed(0)
    model = build().double()
    x, _ = _mse_batch(features)
    out = model(x)
    y = torch.randn(out.shape, dtype=torch.float64)

    def losses_of(output, target):
        return ((output - target) ** 2).flatten(1).mean(1)

    names = [n for n, _ in model.named_parameters()]
    chunk = 64 if case == "resnet18-layout" else 7  # several chunks per call
    got = stats_jacobian_gradients(model, x, y, losses_of, names, chunk=chunk)
    losses = losses_of(model(x), y)
    params = list(model.parameters())
    rows = [torch.autograd.grad(li, params, retain_graph=True) for li in losses]
    for k, (name, g) in enumerate(zip(names, got, strict=True)):
        want = torch.stack([row[k] for row in rows])
        torch.testing.assert_close(g, want, rtol=1e-9, atol=1e-12, msg=name)


def test_large_batches_get_fewer_samples_per_batched_backward(monkeypatch):
    """The chunk shrinks to ``pairs // N`` samples (the batched backward's memory
    stays that of ``pairs`` samples), and the values stay exact."""
    from cockpit.engines import autograd

    assert autograd.chunk_size(32) == 8 and autograd.chunk_size(128) == 2
    assert autograd.chunk_size(4096) == 1 and autograd.chunk_size(64, chunk=3) == 3
    ranges = []
    original = autograd._chunk

    def counted(losses, params, start, stop):
        ranges.append((start, stop))
        return original(losses, params, start, stop)

    monkeypatch.setattr(autograd, "_chunk", counted)
    torch.manual_seed(0)
    model = _batchnorm_net().double()
    x, y = _mse_batch(_features(3))
    params = list(model.parameters())
    losses = ((model(x) - y) ** 2).mean(1)
    got = dict(autograd.per_sample_gradients(losses, params, chunk=8, pairs=12))
    assert ranges == [(0, 2), (2, 4), (4, 6)]
    for k, p in enumerate(params):
        want = torch.stack(
            [torch.autograd.grad(li, p, retain_graph=True)[0] for li in losses]
        )
        torch.testing.assert_close(got[k], want, rtol=1e-10, atol=1e-12)
