"""Real training loops: accumulation, clipping, mismatched optimizers, frozen weights.

Where a quantity cannot be right in such a loop, cockpit records it as missing with
the reason (never a wrong number) and warns once with a CockpitWarning naming the fix.
"""

import warnings

import pytest
import torch

from cockpit import Cockpit
from cockpit import quantities as Q
from cockpit.errors import CockpitWarning
from cockpit.utils.schedules import linear
from tests.utils.problems import make_problem

EVERY = linear(1)


def _step(cockpit, problem, opt, step, clip=None, zero=True, extra_backward=False):
    x, y = problem.make_batch(step)
    if zero:
        opt.zero_grad()
    if extra_backward:  # an earlier micro-batch accumulated into .grad
        problem.loss_fn(problem.model(x), y).backward()
    out = problem.model(x)
    loss = problem.loss_fn(out, y)
    info = {
        "batch_size": x.shape[0],
        "individual_losses": problem.individual_loss_fn(out, y),
        "loss": loss,
        "optimizer": opt,
    }
    with cockpit(step, info=info):
        loss.backward(create_graph=cockpit.create_graph(step))
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(problem.params, clip)
    opt.step()


def test_learning_rate_of_every_group_is_recorded():
    problem = make_problem("mlp", "ce", "sgd")
    groups = [{"params": problem.params[:2], "lr": 0.1}, {"params": problem.params[2:]}]
    opt = torch.optim.SGD(groups, lr=0.05)
    cockpit = Cockpit(problem.params, [Q.Loss(linear(2))])
    for step in range(3):
        _step(cockpit, problem, opt, step)
    out = cockpit.history.to_dict()
    assert out[0]["learning_rates"] == [0.1, 0.05]
    assert sorted(out) == [0, 2]  # only tracked steps


def test_gradient_accumulation_makes_grad_readers_missing():
    problem = make_problem("mlp", "ce", "sgd")
    opt = problem.optimizer()
    quantities = [Q.GradNorm(EVERY), Q.NormTest(EVERY), Q.GradHist1d(EVERY)]
    cockpit = Cockpit(problem.params, quantities)
    _step(cockpit, problem, opt, 0)
    with pytest.warns(CockpitWarning, match="gradient accumulation.*Fix"):
        _step(cockpit, problem, opt, 1, extra_backward=True)
    out = cockpit.history.to_dict()
    assert {"GradNorm", "NormTest", "GradHist1d"} <= set(out[0])
    # .grad readers are missing with the reason; the micro-batch histogram stays
    assert "GradNorm" not in out[1] and "NormTest" not in out[1]
    assert "GradHist1d" in out[1]
    assert set(out[1]["missing"]) == {"GradNorm", "NormTest"}
    assert "accumulation" in out[1]["missing"]["GradNorm"]


def test_a_quantity_left_out_takes_its_extensions_along():
    """Variance alone on a sequence-first LSTM (routed to autograd) under accumulation:
    BackPACK's BatchL2Grad must not run for the quantity left out (its LSTM rule
    fails on that layout)."""
    from tests.utils.any_model import make_any_problem

    problem = make_any_problem("lstm-seq-first-t3")
    opt = problem.make_optimizer(problem.model.parameters())
    cockpit = Cockpit(problem.params, [Q.Variance(EVERY), Q.Loss(EVERY)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CockpitWarning)
        _step(cockpit, problem, opt, 0)
        _step(cockpit, problem, opt, 1, zero=False)  # .grad keeps step 0's
    out = cockpit.history.to_dict()
    assert "Variance" in out[0] and "Loss" in out[1]
    assert "accumulation" in out[1]["missing"]["Variance"]


def test_zero_tensors_in_grad_are_not_accumulation():
    problem = make_problem("mlp", "ce", "sgd")
    opt = problem.optimizer()
    cockpit = Cockpit(problem.params, [Q.GradNorm(EVERY)])
    for step in range(2):
        opt.zero_grad(set_to_none=False)
        _step(cockpit, problem, opt, step, zero=False)
    assert all("missing" not in v for v in cockpit.history.to_dict().values())


def test_clipping_between_backward_and_step_drops_alpha():
    problem = make_problem("mlp", "ce", "sgd")
    opt = problem.optimizer()
    cockpit = Cockpit(problem.params, [Q.Alpha(EVERY)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _step(cockpit, problem, opt, 0)
        _step(cockpit, problem, opt, 1, clip=1e-4)  # changes .grad in place
        _step(cockpit, problem, opt, 2)
        _step(cockpit, problem, opt, 3)
    out = cockpit.history.to_dict()
    assert isinstance(out[0]["Alpha"], float)  # unclipped start
    assert "Alpha" not in out[1] and "optimizer.step()" in out[1]["missing"]["Alpha"]
    assert isinstance(out[2]["Alpha"], float)  # later steps are fine again
    messages = [str(w.message) for w in caught if w.category is CockpitWarning]
    assert sum("clipping" in m for m in messages) == 1


def test_an_unclipped_run_keeps_every_alpha():
    problem = make_problem("mlp", "ce", "momentum")
    opt = problem.optimizer()
    cockpit = Cockpit(problem.params, [Q.Alpha(EVERY)])
    for step in range(4):
        _step(cockpit, problem, opt, step)
    out = cockpit.history.to_dict()
    assert [s for s in out if "Alpha" in out[s]] == [0, 1, 2]
    assert all("missing" not in v for v in out.values())


def test_optimizer_of_other_parameters_makes_alpha_missing():
    problem = make_problem("mlp", "ce", "sgd")
    opt = problem.optimizer()
    cockpit = Cockpit(problem.params[:2], [Q.Alpha(EVERY), Q.Loss(EVERY)])
    with pytest.warns(CockpitWarning, match="same parameters to the Cockpit"):
        for step in range(2):
            _step(cockpit, problem, opt, step)
    out = cockpit.history.to_dict()
    assert "Alpha" not in out[0] and "Alpha" in out[0]["missing"]
    assert "Loss" in out[0]


def test_frozen_parameters_are_skipped_with_one_note():
    model = make_problem("mlp", "ce", "sgd").model
    every = list(model.parameters())
    every[0].requires_grad_(False)
    with pytest.warns(CockpitWarning, match="skips 1 frozen parameter"):
        cockpit = Cockpit(model.parameters(), [Q.GradNorm(EVERY)])
    assert cockpit.params == every[1:]


def test_every_warning_cockpit_emits_is_a_cockpit_warning():
    """Every warnings.warn call in the package names CockpitWarning as category."""
    import ast
    import pathlib

    import cockpit

    offenders = []
    for path in pathlib.Path(cockpit.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "warn"
                and getattr(node.func.value, "id", None) == "warnings"
            ):
                continue
            category = node.args[1] if len(node.args) > 1 else None
            for keyword in node.keywords:
                if keyword.arg == "category":
                    category = keyword.value
            if getattr(category, "id", None) != "CockpitWarning":
                offenders.append(f"{path.name}:{node.lineno}")
    assert not offenders, offenders


def test_live_diagnosis_is_subscribed_and_shown_in_the_demo_bar():
    from cockpit.demo import _postfix

    problem = make_problem("mlp", "ce", "sgd")
    opt = problem.optimizer()
    cockpit = Cockpit(problem.params, [Q.Loss(EVERY), Q.GradNorm(EVERY)])
    assert cockpit.diagnosis in cockpit.recorder.subscribers
    for step in range(2):
        _step(cockpit, problem, opt, step)
    assert _postfix(cockpit, 1)["diagnosis"] == "ok"
    quiet = Cockpit(problem.params, [Q.Loss(EVERY)], diagnose=False)
    assert quiet.diagnosis is None and "diagnosis" not in _postfix(quiet, 0)


def test_backpack_hook_warnings_do_not_flood_the_output():
    """BackPACK's module hooks make PyTorch warn at every step: cockpit drops that."""
    problem = make_problem("mlp", "ce", "sgd")
    opt = problem.optimizer()
    cockpit = Cockpit(problem.params, [Q.GradHist1d(EVERY)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            _step(cockpit, problem, opt, step)
            warnings.warn("the user's own warning", UserWarning, stacklevel=1)
    firing = [w for w in caught if "Full backward hook is firing" in str(w.message)]
    assert firing == []
    assert sum("the user's own warning" in str(w.message) for w in caught) == 3


def test_warnings_of_the_users_backward_pass_still_reach_the_user():
    problem = make_problem("mlp", "ce", "sgd")
    cockpit = Cockpit(problem.params, [Q.GradNorm(EVERY)])
    x, y = problem.make_batch(0)
    loss = problem.loss_fn(problem.model(x), y)
    with pytest.warns(RuntimeWarning, match="inside the backward block"):
        with cockpit(0, info={"loss": loss}):
            warnings.warn("inside the backward block", RuntimeWarning, stacklevel=1)
            loss.backward()


def test_backpack_without_a_rule_does_not_flood_the_output():
    from backpack import extend

    class Scale(torch.nn.Module):  # a module with a parameter and no BackPACK rule
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))

        def forward(self, x):
            return x * self.weight

    torch.manual_seed(0)
    model = extend(
        torch.nn.Sequential(torch.nn.Linear(4, 3).double(), Scale(), torch.nn.ReLU())
    )
    loss_fn = extend(torch.nn.CrossEntropyLoss())
    cockpit = Cockpit(model.parameters(), [Q.NormTest(EVERY)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            model.zero_grad()
            x, y = torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 3, (5,))
            out = model(x)
            loss = loss_fn(out, y)
            losses = torch.nn.functional.cross_entropy(out, y, reduction="none")
            with cockpit(step, info={"loss": loss, "individual_losses": losses}):
                loss.backward()
    raw = [w for w in caught if "does not have an extension" in str(w.message)]
    assert raw == []  # routing sends Scale.weight to the autograd engine instead
    assert cockpit.coverage().params[2].route.engine == "autograd"  # Scale.weight
    assert all("NormTest" in cockpit.history[s] for s in range(3))


def test_several_backward_passes_in_one_tracked_step_are_explained():
    problem = make_problem("mlp", "ce", "sgd")
    cockpit = Cockpit(problem.params, [Q.NormTest(EVERY), Q.GradHist1d(EVERY)])
    x, y = problem.make_batch(0)
    out = problem.model(x)
    loss = problem.loss_fn(out, y)
    with pytest.raises(RuntimeError, match="Several backward passes.*once inside"):
        with cockpit(0, info={"loss": loss}):
            loss.backward(retain_graph=True)
            loss.backward()
    assert 0 not in cockpit.history  # nothing half-right was recorded
    assert not any(hasattr(p, "grad_batch") for p in problem.params)


def test_a_failure_while_the_step_opens_leaves_nothing_open(monkeypatch):
    from cockpit.step.run import StepRun

    problem = make_problem("mlp", "ce", "sgd")
    cockpit = Cockpit(problem.params, [Q.GradHist1d(EVERY)])
    filters = list(warnings.filters)

    original = StepRun.open

    def breaks_after_entering(self):
        original(self)  # the backward context and warning capture are entered ...
        raise RuntimeError("engine broke")  # ... then something fails

    monkeypatch.setattr(StepRun, "open", breaks_after_entering)
    x, y = problem.make_batch(0)
    loss = problem.loss_fn(problem.model(x), y)
    with pytest.raises(RuntimeError, match="engine broke"):
        cockpit.begin(0, info={"loss": loss})
    assert warnings.filters == filters
    monkeypatch.undo()
    # the failed step dropped what its forward pass stored for BackPACK (it would
    # keep the graph and the model alive, test_lifetime.py): the next step runs
    # its own forward pass, as a training loop does, and opens normally
    loss = problem.loss_fn(problem.model(x), y)
    with cockpit(1, info={"loss": loss}):
        loss.backward()
    assert "GradHist1d" in cockpit.history[1]


def test_this_packages_signatures_with_defaults_are_not_taken_for_1_0_2():
    from cockpit.quantities.base import SingleStepQuantity, TwoStepQuantity

    class Scaled(SingleStepQuantity):
        needs = frozenset({Q.base.Need.GRADIENT})

        def _compute(self, global_step, ctx, scale=2.0):
            return scale * len(ctx.params)

    class Pair(TwoStepQuantity):
        def _compute_start(self, global_step, ctx, eps=1e-8):
            return global_step

        def _compute_end(self, global_step, ctx, state):
            return float(state)

    assert not Scaled._legacy and not Pair._legacy
    problem = make_problem("mlp", "ce", "sgd")
    opt = problem.optimizer()
    cockpit = Cockpit(problem.params, [Scaled(EVERY), Pair(EVERY)])
    for step in range(2):
        _step(cockpit, problem, opt, step)
    assert cockpit.history[0]["Scaled"] == 2.0 * len(problem.params)
    assert cockpit.history[0]["Pair"] == 0.0  # the two-step value is recorded


def test_warning_filters_of_the_user_still_apply_inside_tracked_steps():
    problem = make_problem("mlp", "ce", "sgd")
    cockpit = Cockpit(problem.params, [Q.GradNorm(EVERY)])
    x, y = problem.make_batch(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")  # once per location
        warnings.filterwarnings("ignore", message="filtered away")
        for step in range(3):
            problem.model.zero_grad()
            loss = problem.loss_fn(problem.model(x), y)
            with cockpit(step, info={"loss": loss}):
                warnings.warn("filtered away", UserWarning, stacklevel=1)
                warnings.warn("shown once", UserWarning, stacklevel=1)
                loss.backward()
    messages = [str(w.message) for w in caught]
    # the user's filters apply; the warning keeps its category and location
    # (Python forgets "once per location" whenever filters change, as they do
    # around each tracked step, so it may show again on later steps)
    assert "shown once" in messages and "filtered away" not in messages
    assert all(w.category is UserWarning and w.filename == __file__ for w in caught)


def test_a_failed_step_leaves_no_partial_values_and_no_graph():
    problem = make_problem("mlp", "ce", "sgd")
    opt = problem.optimizer()
    cockpit = Cockpit(problem.params, [Q.GradNorm(EVERY), Q.HessMaxEV(EVERY)])
    x, y = problem.make_batch(0)
    out = problem.model(x)
    loss = problem.loss_fn(out, y)
    info = {"loss": loss, "optimizer": opt}
    with pytest.raises(ZeroDivisionError):
        with cockpit(0, info=info):
            loss.backward(create_graph=cockpit.create_graph(0))
            1 / 0  # noqa: B018  (the user's code fails inside the block)
    assert 0 not in cockpit.history  # not even the learning rates
    assert all(p.grad.grad_fn is None for p in problem.params)  # graph released
    _step(cockpit, problem, opt, 1)
    assert {"GradNorm", "HessMaxEV", "learning_rates"} <= set(cockpit.history[1])


def test_the_optimizer_hook_goes_when_the_cockpit_closes():
    problem = make_problem("mlp", "ce", "sgd")
    opt = problem.optimizer()
    cockpit = Cockpit(problem.params, [Q.Alpha(EVERY)])
    x, y = problem.make_batch(0)
    out = problem.model(x)
    loss = problem.loss_fn(out, y)
    info = {
        "loss": loss,
        "individual_losses": problem.individual_loss_fn(out, y),
        "optimizer": opt,
    }
    with cockpit(0, info=info):
        loss.backward()
    assert len(opt._optimizer_step_pre_hooks) == 1
    cockpit.close()
    assert len(opt._optimizer_step_pre_hooks) == 0


def test_a_failing_subscriber_does_not_cost_the_others_their_values():
    from cockpit.step.recorder import Recorder

    seen = []

    class Broken:
        def on_record(self, step, values):
            raise OSError("disk full")

    class Keeps:
        def on_record(self, step, values):
            seen.append((step, dict(values)))

    recorder = Recorder()
    recorder.subscribe(Broken())
    recorder.subscribe(Keeps())
    recorder.record(3, "Loss", 1.0)
    recorder.record(4, "Loss", 2.0)
    with pytest.raises(OSError, match="disk full"):
        recorder.flush()
    assert seen == [(3, {"Loss": 1.0}), (4, {"Loss": 2.0})]
