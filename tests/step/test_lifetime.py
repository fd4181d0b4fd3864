"""Issue 28: a Cockpit the user drops is freed, with its log, checks and hooks."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from cockpit import Cockpit
from cockpit import quantities as Q
from cockpit.utils.schedules import linear
from tests.utils import expected_warnings as expected
from tests.utils.problems import make_problem

pytestmark = [expected.ALPHA_GRAD_CHANGED]

EVERY = linear(1)


def _tracked_step(cockpit, problem, opt, step):
    opt.zero_grad()
    x, y = problem.make_batch(step)
    out = problem.model(x)
    loss = problem.loss_fn(out, y)
    info = {"loss": loss, "batch_size": x.shape[0], "optimizer": opt,
            "individual_losses": problem.individual_loss_fn(out, y)}  # fmt: skip
    with cockpit(step, info=info):
        loss.backward()


def test_a_cockpit_dropped_between_backward_and_step_is_freed(tmp_path):
    """Alpha watches .grad until optimizer.step() through a pre-hook on the
    optimizer: it must not keep the cockpit's parts (its recorder, the open log)
    alive, nor leave cycles behind for the collector; the hook then goes away."""
    problem = make_problem("mlp", "ce", "sgd")
    opt = problem.optimizer()
    quantities = [Q.Alpha(EVERY), Q.UpdateSize(EVERY), Q.Loss(EVERY)]
    cockpit = Cockpit(problem.params, quantities, logpath=str(tmp_path / "run"))
    _tracked_step(cockpit, problem, opt, 0)
    opt.step()
    _tracked_step(cockpit, problem, opt, 1)
    assert len(opt._optimizer_step_pre_hooks) == 1  # the watch is on
    parts = (cockpit, cockpit.recorder, cockpit._loop, cockpit._stream)
    refs = [weakref.ref(part) for part in parts]
    del cockpit, parts
    gc.disable()  # freed by reference counting alone: no cycles
    try:
        assert [r() is None for r in refs] == [True] * 4
    finally:
        gc.enable()
    opt.step()  # the hook finds its cockpit gone and removes itself
    assert len(opt._optimizer_step_pre_hooks) == 0


def test_the_watch_still_sees_clipping_while_the_cockpit_lives():
    problem = make_problem("mlp", "ce", "sgd")
    opt = problem.optimizer()
    cockpit = Cockpit(problem.params, [Q.Alpha(EVERY)])
    _tracked_step(cockpit, problem, opt, 0)
    gc.collect()
    for p in problem.params:
        p.grad.mul_(0.5)  # "clipping"
    opt.step()
    assert "missing" in cockpit.get_output()[0]
    assert ".grad" in cockpit.get_output()[0]["missing"]["Alpha"]


def _stored_io(model) -> list[str]:
    """What BackPACK's forward hook left on the model's modules."""
    return [
        f"{name or 'model'}.{attribute}"
        for name, module in model.named_modules()
        for attribute in vars(module)
        if attribute == "output" or attribute.startswith("input")
    ]


def test_a_step_that_fails_before_its_backward_pass_leaves_no_stored_io():
    """BackPACK stores each extended module's input and output (with the graph) in
    the forward pass and deletes them when its backward hook runs. A step the
    cockpit refuses before the backward pass (CABS with Adam) must not leave them:
    the graph holds the modules' hooks, a cycle through autograd that gc cannot
    free, so the model and its graph would stay in memory for good."""
    problem = make_problem("mlp", "ce", "sgd")
    opt = torch.optim.Adam(problem.params)
    cockpit = Cockpit(problem.params, [Q.CABS(EVERY)])
    with pytest.raises(ValueError, match="CABS is only defined"):
        _tracked_step(cockpit, problem, opt, 0)
    assert _stored_io(problem.model) == []
    # a forward pass of its own stores them again (BackPACK is unchanged)
    problem.model(problem.make_batch(0)[0])
    assert _stored_io(problem.model)


def test_a_finished_step_leaves_no_stored_io():
    problem = make_problem("cnn", "ce", "sgd")
    opt = problem.optimizer()
    cockpit = Cockpit(problem.params, [Q.GradNorm(EVERY), Q.Variance(EVERY)])
    _tracked_step(cockpit, problem, opt, 0)
    assert _stored_io(problem.model) == []
