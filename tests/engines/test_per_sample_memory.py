"""Per-sample gradients exist for one module at a time, never for the whole model.

A spy around the cockpit's extension hook checks, before and after every module:

A. BackPACK's per-sample buffer (``grad_batch``) exists only on the parameters of
   the module being processed (and on none once its hook is done);
B. no per-sample tensor outlives its time, tracked by weak references: every
   materialised ``[N, *shape]`` copy a :class:`~cockpit.param_view.ParamView` hands
   out is gone when its module's hook returns; BackPACK's own ``grad_batch`` tensors
   are gone once the backward pass is over (during it, the autograd engine may still
   hold them: for a ``Linear`` bias the tensor is the layer's output gradient);
C. nothing a quantity keeps (``_acc``, ``_pending``) is the size of a parameter's
   per-sample gradients (``N`` times the parameter's size).

Deliberately leaky quantities show that each check really fails.
"""

import dataclasses
import weakref

import pytest
import torch
from backpack.extensions import BatchGrad

from cockpit import quantities as Q
from cockpit.engines.backpack import api as engine
from cockpit.needs import Need
from cockpit.param_view import ParamView
from cockpit.utils.schedules import linear
from tests.utils.harness import run
from tests.utils.problems import make_problem

MINE = ["Alpha", "CABS", "EarlyStopping", "NormTest", "InnerTest", "OrthoTest"]
MINE += ["MeanGSNR"]
SGD_ONLY = {"CABS", "EarlyStopping"}


def stored_tensors(obj, found=None):
    """Every tensor reachable from ``obj`` through dicts, sequences and dataclasses."""
    found = [] if found is None else found
    if isinstance(obj, torch.Tensor):
        found.append(obj)
    elif isinstance(obj, dict):
        for value in obj.values():
            stored_tensors(value, found)
    elif isinstance(obj, (list, tuple, set)):
        for value in obj:
            stored_tensors(value, found)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            stored_tensors(getattr(obj, f.name), found)
    return found


def quantity_state(quantity):
    return [getattr(quantity, "acc", None), getattr(quantity, "_pending", {})]


class MemorySpy:
    """Installs the checks A, B, C around every call of the extension hook."""

    def __init__(self, monkeypatch, problem, quantities):
        self.params = problem.params
        self.quantities = quantities
        self.batch_size = problem.batch_size
        self.owner = {}
        for module in problem.model.modules():
            for p in module.parameters(recurse=False):
                self.owner[id(p)] = module
        self.per_sample_refs = []  # weak refs to materialised per-sample tensors
        self.buffer_refs = []  # weak refs to BackPACK's grad_batch tensors
        self.hook = None
        self.buffers_seen = 0
        self.calls = 0
        spy = self
        original_call = engine.ExtensionHook.__call__
        original_materialise = ParamView.individual_gradients

        def spying_call(hook, module):
            if hook is not spy.hook:  # a new backward pass
                spy.hook = hook
                spy.check_buffers_released()
            spy.check_buffers(module)
            spy.check_stored()
            for p in module.parameters(recurse=False):
                if isinstance(getattr(p, "grad_batch", None), torch.Tensor):
                    spy.buffer_refs.append(weakref.ref(p.grad_batch))
            original_call(hook, module)
            spy.calls += 1
            spy.check_buffers(None)
            spy.check_stored()
            spy.check_released()

        def recording_materialise(view):
            tensor = original_materialise(view)
            spy.per_sample_refs.append(weakref.ref(tensor))
            return tensor

        monkeypatch.setattr(engine.ExtensionHook, "__call__", spying_call)
        monkeypatch.setattr(ParamView, "individual_gradients", recording_materialise)

    def check_buffers(self, module):
        """A: grad_batch only on the current module's parameters."""
        for i, p in enumerate(self.params):
            if hasattr(p, "grad_batch"):
                self.buffers_seen += 1
                assert self.owner[id(p)] is module, (
                    f"grad_batch of parameter #{i} ({tuple(p.shape)}) is alive while "
                    f"the hook processes {module}"
                )

    def check_stored(self):
        """C: no stored tensor has the size of a parameter's per-sample gradients."""
        n = self.batch_size
        sizes = {n * p.numel(): tuple(p.shape) for p in self.params}
        for q in self.quantities:
            for tensor in stored_tensors(quantity_state(q)):
                if tensor.dim() >= 1 and tensor.shape[0] == n:
                    shape = sizes.get(tensor.numel())
                    assert shape is None, (
                        f"{q.key} stores a per-sample-sized tensor "
                        f"{tuple(tensor.shape)} (N x parameter {shape}) in its state"
                    )

    def check_released(self):
        """B: materialised per-sample tensors of a finished module are gone."""
        alive = [ref() for ref in self.per_sample_refs if ref() is not None]
        assert not alive, (
            f"{len(alive)} per-sample tensor(s) {[tuple(t.shape) for t in alive]} "
            "still alive after their module's hook"
        )
        self.per_sample_refs = []

    def check_buffers_released(self):
        """B: BackPACK's grad_batch tensors of earlier backward passes are gone."""
        alive = [ref() for ref in self.buffer_refs if ref() is not None]
        assert not alive, (
            f"{len(alive)} grad_batch tensor(s) {[tuple(t.shape) for t in alive]} "
            "still alive after their backward pass"
        )
        self.buffer_refs = []


CASES = [("mlp", "ce", "sgd"), ("cnn", "mse", "sgd"), ("cnn", "ce", "adam")]


@pytest.mark.parametrize("spec", CASES, ids=["-".join(c) for c in CASES])
def test_per_sample_gradients_live_one_module_at_a_time(monkeypatch, spec):
    problem = make_problem(*spec)
    schedule = linear(1, offset=1)  # Alpha knows the optimizer from step 0 on
    quantities = [
        getattr(Q, name)(schedule)
        for name in MINE
        if spec[2] == "sgd" or name not in SGD_ONLY
    ]
    spy = MemorySpy(monkeypatch, problem, quantities)
    result = run(problem, quantities, steps=3)
    spy.check_buffers_released()
    assert spy.buffers_seen > 0 and spy.calls > 0  # the checks saw per-sample data
    assert {q.key for q in quantities} <= set(result.output[1])


# --- the checks catch violations ---------------------------------------------------
class _KeepsPerSampleInAcc(Q.SingleStepQuantity):
    """Leaky: keeps every parameter's per-sample gradients until track."""

    needs = frozenset({Need.INDIVIDUAL_GRADIENTS})
    Accumulator = Q.PerParameter

    def accumulate(self, global_step, view):
        self.acc.entries[view.index] = view.individual_gradients()

    def _compute(self, global_step, ctx):
        return len(self.acc.entries)


class _KeepsPerSampleElsewhere(_KeepsPerSampleInAcc):
    """Leaky: hides the per-sample gradients outside ``acc``."""

    def accumulate(self, global_step, view):
        self.stash = getattr(self, "stash", []) + [view.individual_gradients()]


@pytest.mark.parametrize("arch", ["mlp", "cnn"])
def test_check_detects_per_sample_gradients_kept_in_acc(monkeypatch, arch):
    problem = make_problem(arch, "ce", "sgd")
    quantities = [Q.NormTest(linear(1)), _KeepsPerSampleInAcc(linear(1))]
    MemorySpy(monkeypatch, problem, quantities)
    with pytest.raises(AssertionError, match="stores a per-sample-sized tensor"):
        run(problem, quantities, steps=1)


@pytest.mark.parametrize("arch", ["mlp", "cnn"])
def test_check_detects_per_sample_gradients_kept_anywhere(monkeypatch, arch):
    problem = make_problem(arch, "ce", "sgd")
    quantities = [Q.Alpha(linear(1)), _KeepsPerSampleElsewhere(linear(1))]
    MemorySpy(monkeypatch, problem, quantities)
    with pytest.raises(AssertionError, match="still alive after their module's hook"):
        run(problem, quantities, steps=1)


def test_check_detects_grad_batch_of_two_modules(monkeypatch):
    """A user's own BatchGrad keeps grad_batch on every parameter: A must fail."""
    problem = make_problem("cnn", "ce", "sgd")
    quantities = [Q.InnerTest(linear(1))]
    cockpit_spy = MemorySpy(monkeypatch, problem, quantities)
    from cockpit import Cockpit

    cockpit = Cockpit(problem.params, quantities)
    x, y = problem.make_batch(0)
    loss = problem.loss_fn(problem.model(x), y)
    with pytest.raises(AssertionError, match="grad_batch of parameter #.* is alive"):
        with cockpit(0, BatchGrad(), info={"loss": loss}):
            loss.backward()
    assert cockpit_spy.buffers_seen > 0


# --- what Alpha keeps ----------------------------------------------------------------
def held_numbers(quantity):
    """Number of tensor elements a quantity holds (each storage counted once)."""
    seen = {}
    for tensor in stored_tensors(quantity_state(quantity)):
        seen[(tensor.data_ptr(), tensor.numel())] = tensor.numel()
    return sum(seen.values())


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_alpha_keeps_one_copy_of_the_parameters(monkeypatch, optimizer):
    """Alpha holds ``d`` (D numbers) per pending start plus N numbers per tensor.

    Measured while the hooks run and after each step, with every step tracked
    (each step ends one start and begins the next): at most ``2 D + N (P + 1)``
    numbers (+ 5), exactly ``D`` between steps (and the start's 5 scalars: ``tau`` and
    the four observations, kept on the device). cockpit-for-pytorch kept ``N D``
    numbers per step, for two steps, with non-SGD optimizers.
    """
    problem = make_problem("cnn", "ce", optimizer)
    dim = sum(p.numel() for p in problem.params)
    n, num_tensors = problem.batch_size, len(problem.params)
    alpha = Q.Alpha(linear(1, offset=1))
    during = []
    original = engine.ExtensionHook.__call__

    def measuring_call(hook, module):
        original(hook, module)
        during.append(held_numbers(alpha))

    monkeypatch.setattr(engine.ExtensionHook, "__call__", measuring_call)
    result = run(problem, [alpha], steps=4)
    assert sorted(result.output) == [1, 2]  # every start got its value
    assert held_numbers(alpha) == dim + 5  # the pending start of step 3: d, scalars
    assert max(during) <= 2 * dim + n * (num_tensors + 1) + 5
    assert max(during) > dim + 5  # while a step ends and the next starts: both
