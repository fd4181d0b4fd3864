"""Issue 28: step numbers must increase (a repeated or smaller one is an error)."""

from __future__ import annotations

import pytest

from cockpit import Cockpit
from cockpit import quantities as Q
from cockpit.utils.schedules import linear
from tests.utils.problems import make_problem

EVERY = linear(1)


def _step(cockpit, problem, step):
    x, y = problem.make_batch(step)
    problem.model.zero_grad()
    loss = problem.loss_fn(problem.model(x), y)
    with cockpit(step, info={"loss": loss, "batch_size": x.shape[0]}):
        loss.backward()


def _cockpit():
    problem = make_problem("mlp", "ce", "sgd")
    return Cockpit(problem.params, [Q.Loss(EVERY), Q.UpdateSize(EVERY)]), problem


@pytest.mark.parametrize("again", [3, 1], ids=["repeated", "smaller"])
def test_a_step_that_does_not_increase_is_an_error_naming_the_last(again):
    cockpit, problem = _cockpit()
    for step in (1, 3):
        _step(cockpit, problem, step)
    before = cockpit.history.to_dict()
    with pytest.raises(ValueError) as raised:
        _step(cockpit, problem, again)
    message = str(raised.value)
    assert f"Step {again} does not come after step 3" in message
    assert "new Cockpit" in message and "load_state_dict" in message
    assert cockpit.open_step is None and cockpit.history.to_dict() == before
    _step(cockpit, problem, 4)  # the loop goes on with a larger step
    assert sorted(cockpit.get_output()) == [1, 3, 4]
    assert "UpdateSize" in cockpit.get_output()[3]


def test_an_abandoned_step_can_be_tried_again_and_a_checkpoint_rewinds():
    cockpit, problem = _cockpit()
    _step(cockpit, problem, 0)
    state = cockpit.state_dict()
    x, y = problem.make_batch(1)
    loss = problem.loss_fn(problem.model(x), y)
    with pytest.raises(ZeroDivisionError):
        with cockpit(1, info={"loss": loss, "batch_size": x.shape[0]}):
            raise ZeroDivisionError("the user's backward failed")
    _step(cockpit, problem, 1)  # not tracked to the end before: allowed
    _step(cockpit, problem, 2)
    cockpit.load_state_dict(state)  # back to step 0: step 1 comes next
    _step(cockpit, problem, 1)
    with pytest.raises(ValueError, match="does not come after step 1"):
        _step(cockpit, problem, 1)
