"""One contract over all quantities: schedules, buffers, keys, JSON, exceptions."""

import json

import pytest
import torch
from backpack import CTX
from backpack.extensions import BatchGrad
from backpack.extensions.backprop_extension import BackpropExtension

from cockpit import Cockpit
from cockpit import quantities as Q
from cockpit.history import History
from cockpit.needs import in_backward
from cockpit.quantities.base import Quantity
from cockpit.utils.schedules import linear
from tests.utils import expected_warnings as expected
from tests.utils.harness import run
from tests.utils.problems import make_problem

pytestmark = [expected.TIC_HESSIAN_NOT_POSITIVE]

STEPS = 6
BACKPACK_ATTRIBUTES = {
    "grad_batch",
    "batch_l2",
    "sum_grad_squared",
    "variance",
    "diag_h",
    "diag_ggn_exact",
    "diag_ggn_mc",
    "grad_batch_transforms",
}


def all_quantities(schedule):
    """One instance of every quantity class the package exports."""
    made = []
    for name in Q.__all__:
        cls = getattr(Q, name)
        if not (isinstance(cls, type) and issubclass(cls, Quantity)):
            continue
        if cls.__module__ == "cockpit.quantities.base" or cls.__name__.startswith("_"):
            continue
        made.append(cls(schedule))
    return made


def leftover_buffers(params):
    return {a for p in params for a in vars(p) if a in BACKPACK_ATTRIBUTES}


@pytest.mark.parametrize("arch,loss", [("mlp", "ce"), ("cnn", "mse")])
def test_contract_all_quantities(arch, loss):
    problem = make_problem(arch, loss, "sgd")
    schedule = linear(2, offset=1)  # steps 1, 3, 5
    quantities = all_quantities(schedule)
    keys = [q.key for q in quantities]
    assert len(keys) == len(set(keys))

    cockpit = Cockpit(problem.params, quantities)
    opt = problem.optimizer()
    for step in range(STEPS):
        x, y = problem.make_batch(step)
        opt.zero_grad()
        out = problem.model(x)
        loss_value = problem.loss_fn(out, y)
        info = {
            "batch_size": x.shape[0],
            "individual_losses": problem.individual_loss_fn(out, y),
            "loss": loss_value,
            "optimizer": opt,
        }
        wanted = any(
            in_backward(q.needs_at(step)) or q.extensions(step) for q in quantities
        )
        with cockpit(step, info=info):
            active = [type(e) for e in CTX.get_active_exts()]
            loss_value.backward(create_graph=cockpit.create_graph(step))
        assert bool(active) == wanted, (step, active)
        assert leftover_buffers(problem.params) == set(), step
        # after a create_graph step no double-backward graph stays attached to .grad
        assert all(p.grad.grad_fn is None for p in problem.params)
        opt.step()

    output = cockpit.history.to_dict()
    # every value sits under a scheduled step (two-step ones under their start)
    for step, entries in output.items():
        assert schedule(step), (step, sorted(entries))
    scheduled = [s for s in range(STEPS) if schedule(s)]
    for key in keys:
        # a value, or a reason why there is none (e.g. TICDiag with negative
        # Hessian entries)
        steps_with_key = [
            s for s in output if key in output[s] or key in output[s].get("missing", {})
        ]
        assert steps_with_key, f"{key} never recorded"
        assert set(steps_with_key) <= set(scheduled)
    # JSON-safe: standard JSON without NaN tokens, and a faithful round trip
    json.dumps(output, allow_nan=False)
    assert History(output).to_dict() == output


def test_no_extension_when_nothing_needs_one():
    problem = make_problem("mlp", "ce")
    cockpit = Cockpit(problem.params, [Q.GradNorm(linear(1)), Q.Loss(linear(1))])
    x, y = problem.make_batch(0)
    loss = problem.loss_fn(problem.model(x), y)
    with cockpit(0, info={"loss": loss}):
        assert list(CTX.get_active_exts()) == []
        loss.backward()
    assert 0 in cockpit.get_output()


def test_exception_in_backward_surfaces_and_tracks_nothing():
    problem = make_problem("cnn", "ce")
    cockpit = Cockpit(problem.params, [Q.HessTrace(linear(1)), Q.Loss(linear(1))])
    x, y = problem.make_batch(0)
    loss = problem.loss_fn(problem.model(x), y)
    with pytest.raises(ZeroDivisionError, match="boom"):
        with cockpit(0, info={"loss": loss}):
            loss.backward()
            raise ZeroDivisionError("boom")
    assert cockpit.get_output() == {}
    assert leftover_buffers(problem.params) == set()
    assert list(CTX.get_active_exts()) == []  # BackPACK's context was restored
    # the next step works normally
    for p in problem.params:
        p.grad = None
    loss = problem.loss_fn(problem.model(x), y)
    with cockpit(1, info={"loss": loss}):
        loss.backward()
    assert set(cockpit.get_output()[1]) == {"HessTrace", "Loss"}


def test_hess_trace_holds_one_module_of_curvature_at_a_time(monkeypatch):
    """While BackPACK runs, curvature diagonals never exist for two modules at once."""
    from cockpit.engines.backpack import api as engine

    problem = make_problem("cnn", "mse")
    params = problem.params
    owner = {}
    for module in problem.model.modules():
        for p in module.parameters(recurse=False):
            owner[id(p)] = module
    seen_alive = []
    original = engine.ExtensionHook.__call__

    def spying_call(self, module):
        alive = {id(owner[id(p)]) for p in params if hasattr(p, "diag_h")}
        seen_alive.append(len(alive))
        assert alive <= {id(module)}, "curvature of an earlier module still alive"
        original(self, module)
        assert not any(hasattr(p, "diag_h") for p in params)

    monkeypatch.setattr(engine.ExtensionHook, "__call__", spying_call)
    result = run(problem, [Q.HessTrace(linear(1))], steps=2)
    assert max(seen_alive) == 1  # the check really saw buffers
    assert len(result.output) == 2


def test_duplicate_keys_rejected_and_distinct_keys_coexist():
    problem = make_problem("mlp", "mse")
    schedule = linear(1)
    with pytest.raises(ValueError, match="share the key 'HessTrace'.*key="):
        Cockpit(problem.params, [Q.HessTrace(schedule), Q.HessTrace(schedule)])
    quantities = [
        Q.HessTrace(schedule),
        Q.HessTrace(schedule, curvature="diag_ggn_exact", key="GGNTrace"),
    ]
    result = run(problem, quantities, steps=2)
    assert set(result.output[0]) == {"HessTrace", "GGNTrace"}
    # for MSE on a sigmoid net the Hessian and GGN differ (residual term)
    assert result.output[0]["HessTrace"] != result.output[0]["GGNTrace"]


def test_user_extension_kept_and_conflict_is_an_error():
    problem = make_problem("mlp", "ce")
    cockpit = Cockpit(problem.params, [Q.Variance(linear(1))])
    x, y = problem.make_batch(0)
    loss = problem.loss_fn(problem.model(x), y)
    with cockpit(0, BatchGrad(), info={"loss": loss}):
        loss.backward()
    # the user's own BatchGrad results stay; cockpit's derived ones are gone
    assert all(hasattr(p, "grad_batch") for p in problem.params)
    assert not any(hasattr(p, "batch_l2") for p in problem.params)

    class _Sub(Quantity):
        def extensions(self, global_step):
            return [BatchGrad(subsampling=[0, 1])]

        def track_step(self, global_step, ctx):
            return []

    cockpit2 = Cockpit(problem.params, [_Sub(linear(1))])
    loss = problem.loss_fn(problem.model(x), y)
    with pytest.raises(ValueError, match="Conflicting BackPACK extensions.*grad_batch"):
        with cockpit2(1, BatchGrad(), info={"loss": loss}):
            loss.backward()
    with pytest.raises(TypeError, match="BackpropExtension"):
        with cockpit2(2, "BatchGrad", info={"loss": loss}):
            pass
    assert isinstance(BatchGrad(), BackpropExtension)


def test_missing_info_key_names_key_and_fix():
    problem = make_problem("mlp", "ce")
    cockpit = Cockpit(problem.params, [Q.Loss(linear(1))])
    with pytest.raises(KeyError, match=r"Loss needs info\['loss'\].*cockpit\(0, info="):
        with cockpit(0, info={}):
            pass


def test_rejects_non_quantity_and_frozen_params():
    problem = make_problem("mlp", "ce")
    with pytest.raises(ValueError, match="instantiate it"):
        Cockpit(problem.params, [Q.GradNorm])
    frozen = torch.zeros(3)
    with pytest.raises(ValueError, match="does not require gradients"):
        Cockpit([frozen])


def test_unextended_model_is_a_clear_error():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    loss_fn = torch.nn.MSELoss()
    cockpit = Cockpit(model.parameters(), [Q.Variance(linear(1))])
    x, y = torch.randn(4, 3), torch.randn(4, 2)
    loss = loss_fn(model(x), y)
    with pytest.raises(RuntimeError, match=r"backpack.extend\(\)"):
        with cockpit(0, info={"loss": loss}):
            loss.backward()


def test_incomplete_quantity_fails_at_construction():
    class Forgetful(Q.SingleStepQuantity):
        pass  # no _compute

    with pytest.raises(TypeError, match="abstract method.*_compute"):
        Forgetful(linear(1))
