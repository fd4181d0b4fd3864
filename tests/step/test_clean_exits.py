"""Issue 37: a model that saw a cockpit is indistinguishable from one that never did.

After every way a cockpit's step or life can end (an exception raised by a
user's hook in the middle of a tracked backward pass, ``close()``, the cockpit
dropped without ``close()`` and garbage-collected, one of two cockpits closed)
every module has exactly the hooks it had before (forward, forward-pre, backward,
backward-pre, with their kwargs/always-called flags; the global module hooks
too), BackPACK's ``extend`` hooks are those the user set, the optimizer holds no
hook of the cockpit's, a fresh output carries no tensor hook, and a plain backward
pass gives bit for bit the gradients of a copy that never saw a cockpit (no hook
runs, so it costs what the copy costs). Two models: a small ReLU net under
BackPACK's ``extend`` and a Hugging Face BERT built from a config (not extended;
cockpit's own engines serve it). A model used in a failed step is freed once the
user drops it.
"""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
from backpack import extend
from torch.nn.modules import module as torch_module
from torch.optim import optimizer as torch_optimizer

from cockpit import Cockpit
from cockpit.utils.configuration import configuration
from cockpit.utils.schedules import linear
from tests.utils import expected_warnings as expected
from tests.utils import hf_models

pytestmark = [expected.GGN_FOR_HESSIAN]

MODULE_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks",
                "_backward_pre_hooks", "_forward_hooks_with_kwargs",
                "_forward_hooks_always_called", "_forward_pre_hooks_with_kwargs",
                "_state_dict_hooks", "_load_state_dict_pre_hooks")  # fmt: skip
GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks",
                "_global_backward_hooks", "_global_backward_pre_hooks")  # fmt: skip
OPTIMIZER_HOOKS = ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks",
                   "_optimizer_state_dict_pre_hooks",
                   "_optimizer_state_dict_post_hooks",
                   "_optimizer_load_state_dict_pre_hooks",
                   "_optimizer_load_state_dict_post_hooks")  # fmt: skip


class Boom(RuntimeError):
    """What the user's hook raises."""


def _hooks(model, opt):
    """Every hook dictionary of the model's modules, the optimizer and torch."""
    seen = {}
    for name, module in model.named_modules():
        for attr in MODULE_HOOKS:
            hooks = getattr(module, attr, None)
            if hooks is not None:
                seen[name, attr] = list(hooks.items())
    for attr in GLOBAL_HOOKS:
        seen["torch", attr] = list(getattr(torch_module, attr).items())
    for attr in OPTIMIZER_HOOKS:
        seen["optimizer", attr] = list(getattr(opt, attr, {}).items())
    seen["torch", "optimizer"] = [
        list(hooks.items())
        for hooks in (
            torch_optimizer._global_optimizer_pre_hooks,
            torch_optimizer._global_optimizer_post_hooks,
        )
    ]
    return seen


class Mlp:
    """A ReLU net under BackPACK's ``extend`` (the 1.0.2 loop's set-up)."""

    def __init__(self):
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(
            torch.nn.Linear(5, 6), torch.nn.ReLU(), torch.nn.Linear(6, 3)
        )
        self.pristine = copy.deepcopy(self.model)
        self.model = extend(self.model)
        self.loss_fn = extend(torch.nn.CrossEntropyLoss())
        self.raising = self.model[2]

    def batch(self, seed):
        gen = torch.Generator().manual_seed(seed)
        return {"x": torch.randn(4, 5, generator=gen)}, torch.randint(
            0, 3, (4,), generator=gen
        )

    def logits(self, model, inputs):
        return model(inputs["x"])


class Bert:
    """A Hugging Face BERT from a config (cockpit's engines, no ``extend``)."""

    def __init__(self):
        case = hf_models.build("bert", dtype=torch.float32)
        self.case, self.model = case, case.model
        self.pristine = copy.deepcopy(self.model)
        self.loss_fn = torch.nn.CrossEntropyLoss()
        self.raising = self.model.bert.encoder.layer[1].output

    def batch(self, seed):
        return self.case.inputs(hf_models.BATCH, seed)

    def logits(self, model, inputs):
        return model(**inputs).logits


MODELS = {"mlp": Mlp, "bert": Bert}


def _quantities():
    """The `full` configuration at every step (per-sample statistics, curvature,
    Alpha's optimizer hook, HessMaxEV's second backward pass)."""
    return configuration("full", track_schedule=linear(1))


def _step(setup, cockpit, opt, step, keep=None, info_keys=None):
    """One step of the 1.0.2 loop; ``keep`` gets its loss (the graph)."""
    inputs, targets = setup.batch(step)
    opt.zero_grad()
    logits = setup.logits(setup.model, inputs)
    loss = setup.loss_fn(logits, targets)
    if keep is not None:
        keep["loss"] = loss
    losses = torch.nn.functional.cross_entropy(logits, targets, reduction="none")
    info = {"loss": loss, "batch_size": targets.shape[0], "optimizer": opt,
            "individual_losses": losses}  # fmt: skip
    info = {k: v for k, v in info.items() if info_keys is None or k in info_keys}
    with cockpit(step, info=info):
        loss.backward(create_graph=cockpit.create_graph(step))
    opt.step()


def _plain_gradients(setup, model):
    """A plain backward pass: ``.grad`` of every parameter, and the output."""
    inputs, targets = setup.batch(99)
    model.zero_grad(set_to_none=True)
    logits = setup.logits(model, inputs)
    torch.nn.functional.cross_entropy(logits, targets).backward()
    return [p.grad.clone() for p in model.parameters()], logits


def _same_as_pristine(setup, before, opt):
    """Hooks as before; a plain backward bit for bit that of the untouched copy."""
    assert _hooks(setup.model, opt) == before
    setup.pristine.load_state_dict(setup.model.state_dict())
    ours, logits = _plain_gradients(setup, setup.model)
    theirs, _ = _plain_gradients(setup, setup.pristine)
    assert logits._backward_hooks is None
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))


def _raise_on(flag):
    def hook(module, grad_input, grad_output):
        if flag["raise"]:
            raise Boom("the user's hook")

    return hook


@pytest.mark.parametrize("name", list(MODELS))
def test_exception_in_a_users_hook_mid_backward(name):
    """A user's full backward hook raises in the middle of a tracked step: the
    error reaches the user, and the model and optimizer have the hooks they had
    before the step (and before the cockpit, once it is closed)."""
    setup = MODELS[name]()
    flag = {"raise": False}
    setup.raising.register_full_backward_hook(_raise_on(flag))
    opt = torch.optim.SGD(setup.model.parameters(), lr=0.01)
    before_cockpit = _hooks(setup.model, opt)
    cockpit = Cockpit(setup.model.parameters(), _quantities())
    _step(setup, cockpit, opt, 0)
    before_step = _hooks(setup.model, opt)
    flag["raise"] = True
    with pytest.raises(Boom):
        _step(setup, cockpit, opt, 1)
    assert _hooks(setup.model, opt) == before_step
    flag["raise"] = False
    _step(setup, cockpit, opt, 2)  # the cockpit goes on
    assert "NormTest" in cockpit.get_output()[2]
    cockpit.close()
    _same_as_pristine(setup, before_cockpit, opt)


@pytest.mark.parametrize("name", list(MODELS))
def test_close(name):
    setup = MODELS[name]()
    opt = torch.optim.SGD(setup.model.parameters(), lr=0.01)
    before = _hooks(setup.model, opt)
    cockpit = Cockpit(setup.model.parameters(), _quantities())
    _step(setup, cockpit, opt, 0)
    cockpit.close()
    _same_as_pristine(setup, before, opt)


@pytest.mark.parametrize("name", list(MODELS))
def test_dropped_without_close(name):
    """The cockpit dropped (between the backward pass and ``opt.step()``, where
    Alpha watches the optimizer) and garbage-collected, never closed."""
    setup = MODELS[name]()
    opt = torch.optim.SGD(setup.model.parameters(), lr=0.01)
    before = _hooks(setup.model, opt)
    cockpit = Cockpit(setup.model.parameters(), _quantities())
    inputs, targets = setup.batch(1)
    opt.zero_grad()
    logits = setup.logits(setup.model, inputs)
    loss = setup.loss_fn(logits, targets)
    losses = torch.nn.functional.cross_entropy(logits, targets, reduction="none")
    info = {"loss": loss, "batch_size": targets.shape[0], "optimizer": opt,
            "individual_losses": losses}  # fmt: skip
    with cockpit(0, info=info):
        loss.backward(create_graph=cockpit.create_graph(0))
    gone = weakref.ref(cockpit)
    del cockpit, loss, logits, losses, info
    gc.collect()
    assert gone() is None
    _same_as_pristine(setup, before, opt)


@pytest.mark.parametrize("name", list(MODELS))
def test_two_cockpits_on_one_model(name):
    """Closing one of two cockpits leaves the other tracking, with values; once
    both are closed the model is as it was."""
    setup = MODELS[name]()
    opt = torch.optim.SGD(setup.model.parameters(), lr=0.01)
    before = _hooks(setup.model, opt)
    first = Cockpit(setup.model.parameters(), _quantities())
    second = Cockpit(setup.model.parameters(), _quantities())
    _step(setup, first, opt, 0)
    first.close()
    _step(setup, second, opt, 1)
    values = second.get_output()[1]
    assert "missing" not in values or "NormTest" not in values["missing"]
    assert "NormTest" in values and "HessMaxEV" in values
    second.close()
    _same_as_pristine(setup, before, opt)


@pytest.mark.parametrize("failure", ["mid-backward", "opening"])
def test_model_of_a_failed_step_is_freed(failure):
    """A step fails (the user's tensor hook raises mid-backward, or it cannot
    open: Alpha's ``individual_losses`` not handed in). The user keeps that
    step's loss (its graph, whose outputs the ghost engine listened at) and
    drops the model, the optimizer and the cockpit: every module is freed."""
    setup = Bert()
    if failure == "mid-backward":  # on a parameter: torch's module hooks would
        # keep their module in the graph whether or not a cockpit saw it

        def boom(grad):
            raise Boom("the user's hook")

        setup.raising.dense.weight.register_hook(boom)
    opt = torch.optim.SGD(setup.model.parameters(), lr=0.01)
    cockpit = Cockpit(setup.model.parameters(), _quantities())
    kept = {}
    if failure == "mid-backward":
        with pytest.raises(Boom):
            _step(setup, cockpit, opt, 0, keep=kept)
    else:
        with pytest.raises(KeyError, match="individual_losses"):
            _step(setup, cockpit, opt, 0, keep=kept, info_keys={"loss", "optimizer"})
    modules = [weakref.ref(module) for module in setup.model.modules()]
    del setup, opt, cockpit
    gc.collect()
    assert kept["loss"].grad_fn is not None  # the graph is alive
    alive = [type(ref()).__name__ for ref in modules if ref() is not None]
    assert not alive, alive
