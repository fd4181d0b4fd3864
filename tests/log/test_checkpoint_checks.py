"""Issue 28: a cockpit state loads only into a cockpit that can continue it."""

from __future__ import annotations

import pytest
import torch

from cockpit import Cockpit
from cockpit import quantities as Q
from cockpit.utils.schedules import linear

EVERY = linear(1)


def _quantities():
    return [Q.Distance(EVERY), Q.UpdateSize(EVERY), Q.Loss(EVERY)]


def _step(cockpit, model, step):
    x = torch.randn(4, model[0].in_features, dtype=model[0].weight.dtype)
    model.zero_grad()
    loss = model(x).square().mean()
    with cockpit(step, info={"loss": loss, "batch_size": 4}):
        loss.backward()


def _model(hidden=4, dtype=torch.float64):
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(3, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 2)
    ).to(dtype)


def _saved():
    model = _model()
    cockpit = Cockpit(model.named_parameters(), _quantities())
    _step(cockpit, model, 0)
    return cockpit.state_dict()


def _untouched(cockpit):
    assert cockpit.last_step is None and len(cockpit.history.steps) == 0
    assert cockpit.quantities[0].state_dict() == {"initial": None}


@pytest.mark.parametrize(
    "model, match",
    [
        (lambda: _model(hidden=5), r"'0.weight' \(#0, shape \(5, 3\)\) has shape "
         r"\(5, 3\), but shape \(4, 3\) in the cockpit state.*Fix"),
        (lambda: _model(dtype=torch.float32), r"'0.weight' .* has dtype float32, "
         r"but float64 in the cockpit state.*Fix"),
        (lambda: torch.nn.Sequential(torch.nn.Linear(3, 2).double()),
         r"saved with 4 parameter tensors, this cockpit has 2.*Fix"),
    ],
    ids=["shape", "dtype", "count"],
)  # fmt: skip
def test_parameters_of_another_shape_dtype_or_number_are_named(model, match):
    state = _saved()
    cockpit = Cockpit(model().named_parameters(), _quantities())
    with pytest.raises(ValueError, match=match):
        cockpit.load_state_dict(state)
    _untouched(cockpit)  # nothing was restored


def test_a_quantity_of_another_class_under_the_same_key():
    state = _saved()
    model = _model()
    quantities = [Q.Distance(EVERY), Q.Loss(EVERY, key="UpdateSize"), Q.Loss(EVERY)]
    cockpit = Cockpit(model.parameters(), quantities)
    with pytest.raises(ValueError, match=r"'UpdateSize' is a Loss here but a Upd"):
        cockpit.load_state_dict(state)
    _untouched(cockpit)
    cockpit.load_state_dict(state, strict=False)  # that one starts afresh
    assert cockpit.last_step == 0 and cockpit.quantities[0].state_dict()["initial"]


def test_no_state_inside_an_open_step_and_older_states_still_load(tmp_path):
    model = _model()
    cockpit = Cockpit(model.parameters(), _quantities())
    _step(cockpit, model, 0)
    state = cockpit.state_dict()
    loss = model(torch.randn(4, 3, dtype=torch.float64)).square().mean()
    cockpit.begin(1, info={"loss": loss, "batch_size": 4})
    with pytest.raises(RuntimeError, match=r"state_dict\(\).*step 1 is open.*Fix"):
        cockpit.state_dict()
    with pytest.raises(RuntimeError, match=r"load_state_dict\(\).*step 1 is open"):
        cockpit.load_state_dict(state)
    loss.backward()
    cockpit.end()
    state = cockpit.state_dict()
    assert sorted(state["history"]) == [0, 1]
    # states saved before the checks (no shapes, no classes) load unchecked
    old = {k: v for k, v in state.items() if k not in ("params", "quantity_types")}
    fresh = Cockpit(_model().parameters(), _quantities())
    fresh.load_state_dict(old)
    assert fresh.last_step == 1
    torch.save(state, tmp_path / "state.pt")  # plain data: weights_only loads it
    again = Cockpit(_model().parameters(), _quantities())
    again.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True))
    assert again.last_step == 1
