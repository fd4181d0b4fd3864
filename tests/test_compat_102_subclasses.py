"""Quantities written as cockpit-for-pytorch 1.0.2 documents them; 1.0.2's types.

1.0.2's ``Quantity`` says: "New ``Quantity`` objects can be defined by inheriting
from this class and implementing the ``extensions`` and ``track`` methods", or
``should_compute`` and ``compute`` instead of ``track``; ``track`` stores results in
``self.output[step]``, which ``get_output()`` returns and ``Cockpit.get_output()``
collects under the class name. Its built-ins read the step's ``info`` with
``cockpit.context.get_batch_size(global_step)`` and friends. Each test below runs
such a quantity, or checks a type or attribute 1.0.2 code reads, on a tiny model.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from backpack import extend

import cockpit.quantities as Q
from cockpit import Cockpit
from cockpit.quantities.quantity import ByproductQuantity, Quantity
from cockpit.utils.schedules import linear

N, D_IN, CLASSES = 6, 4, 3


def _data(steps):
    torch.manual_seed(1)
    return [
        (torch.randn(N, D_IN), torch.randint(0, CLASSES, (N,))) for _ in range(steps)
    ]


def _model():
    torch.manual_seed(0)
    return extend(
        torch.nn.Sequential(
            torch.nn.Linear(D_IN, 3), torch.nn.Tanh(), torch.nn.Linear(3, CLASSES)
        )
    )


def _train(quantities, steps=3):
    """1.0.2's loop with plain SGD; returns the cockpit and the model."""
    model = _model()
    loss_fn = extend(torch.nn.CrossEntropyLoss())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cockpit = Cockpit(model.parameters(), quantities=quantities)
    for step, (x, y) in enumerate(_data(steps)):
        opt.zero_grad()
        outputs = model(x)
        loss = loss_fn(outputs, y)
        losses = torch.nn.functional.cross_entropy(outputs, y, reduction="none")
        info = {
            "batch_size": N,
            "individual_losses": losses,
            "loss": loss,
            "optimizer": opt,
        }
        with cockpit(step, info=info):
            loss.backward(create_graph=cockpit.create_graph(step))
        opt.step()
    return cockpit, model


# --- quantities that override track or compute (1.0.2's Quantity docstring) ---


class StepCounter(Quantity):
    """A direct ``Quantity`` subclass: ``extensions`` and ``track``, as 1.0.2 says."""

    def extensions(self, global_step):
        return []

    def track(self, global_step, params, batch_loss):
        # every step; the value of an even step is written one step later
        if global_step % 2 == 1:
            self.output[global_step - 1] = batch_loss.item() + global_step
        self.output[global_step]  # reading a step not written: {} (a defaultdict)


def test_direct_subclass_overriding_track_is_instantiated_and_tracked():
    counter = StepCounter(linear(100))  # track decides itself, every step
    cockpit, _ = _train([counter], steps=4)
    assert sorted(k for k, v in counter.get_output().items() if v != {}) == [0, 2]
    output = cockpit.get_output()
    assert output[0]["StepCounter"] == pytest.approx(counter.get_output()[0])
    assert output[2]["StepCounter"] == pytest.approx(counter.get_output()[2])
    assert "StepCounter" not in output[1] and "StepCounter" not in output[3]
    assert counter.output is counter.get_output()


class ScaledGradNorm(Q.GradNorm):
    """A built-in's subclass that overrides ``track`` and calls ``super().track``."""

    def track(self, global_step, params, batch_loss):
        super().track(global_step, params, batch_loss)
        if global_step in self.output:
            self.output[global_step] = [2 * v for v in self.output[global_step]]


def test_builtin_subclass_overriding_track_keeps_its_writes():
    plain = Q.GradNorm(linear(1))
    scaled = ScaledGradNorm(linear(2))
    cockpit, _ = _train([plain, scaled], steps=3)
    output = cockpit.get_output()
    assert sorted(scaled.get_output()) == [0, 2]
    for step in (0, 2):
        want = [2 * v for v in output[step]["GradNorm"]]
        assert output[step]["ScaledGradNorm"] == pytest.approx(want)
        assert scaled.get_output()[step] == pytest.approx(want)
    assert "ScaledGradNorm" not in output[1]


class LossTimesStep(Quantity):
    """1.0.2's alternative: ``should_compute`` and ``compute`` instead of ``track``."""

    def extensions(self, global_step):
        return []

    def should_compute(self, global_step):
        return global_step in (1, 2)

    def compute(self, global_step, params, batch_loss):
        return global_step, batch_loss.item() * global_step


def test_direct_subclass_with_should_compute_and_compute():
    quantity = LossTimesStep(linear(1))
    loss = Q.Loss(linear(1))
    cockpit, _ = _train([quantity, loss], steps=4)
    output = cockpit.get_output()
    assert sorted(quantity.get_output()) == [1, 2]
    for step in (1, 2):
        assert output[step]["LossTimesStep"] == pytest.approx(
            output[step]["Loss"] * step
        )


def test_output_written_outside_a_step_is_kept():
    """Values written by hand (no step running) are recorded too, as in 1.0.2."""
    quantity = StepCounter(linear(1))
    quantity.output[7] = 1.5  # before the quantity belongs to a cockpit
    cockpit, _ = _train([quantity], steps=2)
    quantity.output[9] = 2.5
    assert quantity.get_output()[7] == 1.5 and quantity.get_output()[9] == 2.5
    assert cockpit.get_output()[7]["StepCounter"] == 1.5
    assert cockpit.get_output()[9]["StepCounter"] == 2.5


def test_quantity_tracked_by_hand_with_info_from_cockpit_ctx():
    """1.0.2: ``CockpitCTX.set(info, step)``, then ``quantity.track(...)`` by hand."""
    from cockpit.context import CockpitCTX

    class BatchSize(ByproductQuantity):
        def _compute(self, global_step, params, batch_loss):
            from cockpit.context import get_batch_size

            return float(get_batch_size(global_step))

    quantity = BatchSize(linear(1))
    CockpitCTX.set({"batch_size": 5}, 3)
    try:
        quantity.track(3, [torch.zeros(2, requires_grad=True)], torch.tensor(0.0))
    finally:
        CockpitCTX.erase()
    assert dict(quantity.get_output()) == {3: 5.0}


# --- cockpit.context getters in an old-style _compute ---


class ContextNormTest(Q.NormTest):
    """1.0.2's NormTest recomputed from the context getters (per-sample autograd)."""

    def extensions(self, global_step):
        return []

    def create_graph(self, global_step):
        return self.should_compute(global_step)

    def _compute(self, global_step, params, batch_loss):
        from cockpit.context import (
            get_batch_size,
            get_individual_losses,
            get_loss,
            get_optimizer,
        )

        assert isinstance(get_optimizer(global_step), torch.optim.SGD)
        assert get_loss(global_step) is batch_loss
        losses = get_individual_losses(global_step)
        rows = [
            torch.cat(
                [g.flatten() for g in torch.autograd.grad(l, params, retain_graph=True)]
            )
            for l in losses  # noqa: E741
        ]
        g_i = torch.stack(rows)
        g = g_i.mean(0)
        n = get_batch_size(global_step)
        return ((g_i - g).pow(2).sum() / (n * (n - 1) * g.pow(2).sum())).sqrt().item()


def test_old_style_compute_reads_the_context_getters():
    builtin = Q.NormTest(linear(1))
    copied = ContextNormTest(linear(2))
    cockpit, _ = _train([builtin, copied], steps=3)
    output = cockpit.get_output()
    assert sorted(copied.get_output()) == [0, 2]
    for step in (0, 2):
        assert output[step]["ContextNormTest"] == pytest.approx(
            output[step]["NormTest"], rel=1e-4
        )


def test_context_getters_outside_a_step_say_how_to_pass_info():
    from cockpit.context import get_batch_size, get_individual_losses, get_optimizer

    for getter in (get_batch_size, get_individual_losses, get_optimizer):
        with pytest.raises(KeyError, match="cockpit\\(info="):
            getter(0)


def test_context_getter_names_a_missing_info_key():
    class NeedsOptimizer(ByproductQuantity):
        def _compute(self, global_step, params, batch_loss):
            from cockpit.context import get_optimizer

            return float(get_optimizer(global_step) is None)

    model = _model()
    loss_fn = extend(torch.nn.CrossEntropyLoss())
    cockpit = Cockpit(model.parameters(), quantities=[NeedsOptimizer(linear(1))])
    x, y = _data(1)[0]
    loss = loss_fn(model(x), y)
    with pytest.raises(KeyError, match="optimizer"):
        with cockpit(0, info={"loss": loss, "batch_size": N}):
            loss.backward()


# --- 1.0.2's helpers and hooks of Quantity ---


class FetchedGradNorm(ByproductQuantity):
    """Copied from 1.0.2's GradNorm: ``self._fetch_grad(params)``."""

    def _compute(self, global_step, params, batch_loss):
        return [g.norm().item() for g in self._fetch_grad(params)]


def test_fetch_helpers_of_102_quantities():
    fetched, builtin = FetchedGradNorm(linear(1)), Q.GradNorm(linear(1))
    cockpit, _ = _train([fetched, builtin], steps=2)
    for step in (0, 1):
        out = cockpit.get_output()[step]
        assert out["FetchedGradNorm"] == pytest.approx(out["GradNorm"])


def test_102_extension_hooks_fail_with_the_replacement():
    """1.0.2's BatchGradTransforms hooks do not run here: a clear error, no silence."""

    class HookedNormTest(ByproductQuantity):
        def extension_hooks(self, global_step):
            return [lambda module: None]

        def _compute(self, global_step, params, batch_loss):
            return 0.0

    with pytest.raises(NotImplementedError, match="accumulate"):
        _train([HookedNormTest(linear(1))], steps=1)


# --- two-step attributes mean what they meant in 1.0.2 ---


@pytest.mark.parametrize("cls", [Q.Alpha, Q.UpdateSize])
def test_two_step_save_shift_and_is_end_as_102(cls):
    schedule = linear(2, offset=1)  # starts at 1, 3
    quantity = cls(schedule)
    assert cls.SAVE_SHIFT == 1
    # 1.0.2: is_end(t) is the schedule at t - SAVE_SHIFT, whatever the run did
    assert [t for t in range(7) if quantity.is_end(t)] == [2, 4, 6]
    assert [t for t in range(7) if quantity.is_start(t)] == [1, 3, 5]
    steps = 5
    _train([quantity], steps=steps)
    assert [t for t in range(7) if quantity.is_end(t)] == [2, 4, 6]
    # 1.0.2's rule: a value is stored under t for every end t + SAVE_SHIFT in the run
    want = [
        t
        for t in range(steps)
        if quantity.is_end(t + cls.SAVE_SHIFT) and t + cls.SAVE_SHIFT < steps
    ]
    assert sorted(quantity.get_output()) == want == [1, 3]


# --- quantities.__all__ ---


def test_quantities_all_lists_quantity_classes_only():
    for name in Q.__all__:
        cls = getattr(Q, name)
        assert isinstance(cls, type) and issubclass(cls, Q.Quantity), name
    for name in ("MISSING_KEY", "Missing", "TrackContext", "PerParameter"):
        assert name not in Q.__all__
        assert hasattr(Q, name)  # still importable from cockpit.quantities
    from cockpit.quantities import MISSING_KEY, Missing, PerParameter, TrackContext

    assert isinstance(MISSING_KEY, str) and Missing and PerParameter and TrackContext


# --- 1.0.2's types in get_output() ---


def test_histogram_output_types_as_102(tmp_path):
    hist1d = Q.GradHist1d(linear(1), bins=8)
    hist2d = Q.GradHist2d(linear(1), bins=(4, 5), keep_individual=True)
    cockpit, _ = _train([hist1d, hist2d], steps=1)
    own = {"GradHist1d": hist1d.get_output()[0], "GradHist2d": hist2d.get_output()[0]}
    for entry in (cockpit.get_output()[0], own):
        one, two = entry["GradHist1d"], entry["GradHist2d"]
        assert isinstance(one["hist"], np.ndarray) and one["hist"].shape == (8,)
        assert isinstance(one["edges"], np.ndarray) and one["edges"].shape == (9,)
        assert isinstance(two["hist"], np.ndarray) and two["hist"].shape == (4, 5)
        assert isinstance(two["edges"], tuple) and len(two["edges"]) == 2
        assert [e.shape for e in two["edges"]] == [(5,), (6,)]
        assert isinstance(two["param_0"]["edges"], tuple)
        assert one["hist"].sum() == N * sum(p.numel() for p in cockpit.params)
    path = cockpit.write(str(tmp_path / "log"))
    edges = json.load(open(path))["0"]["GradHist2d"]["edges"]
    assert isinstance(edges, list) and len(edges) == 2  # the log keeps lists


# --- 1.0.2's private names a copied built-in reads ---


def test_builtin_settings_under_102_attribute_names():
    assert Q.EarlyStopping(linear(1), epsilon=0.5)._epsilon == 0.5
    assert Q.MeanGSNR(linear(1), epsilon=0.25)._epsilon == 0.25
    tic = Q.TICDiag(linear(1), curvature="diag_ggn_exact", epsilon=0.125)
    assert (tic._curvature, tic._epsilon) == ("diag_ggn_exact", 0.125)
    assert Q.TICTrace(linear(1))._curvature == "diag_h"
    assert Q.HessTrace(linear(1), curvature="diag_ggn_mc")._curvature == "diag_ggn_mc"
    hist = Q.GradHist1d(linear(1), bins=7, range=(-3, 3))
    assert hist._bins == 7 and tuple(hist._range) == (-3, 3)
    assert not hist._adapt.should_compute(0)  # no adaptation by default
    hist2d = Q.GradHist2d(linear(1), bins=(3, 4), keep_individual=True)
    assert tuple(hist2d._bins) == (3, 4) and hist2d._keep_individual is True
    assert [tuple(r) for r in hist2d._range] == [(-1, 1), (-2, 2)]
    assert len(hist2d._adapt) == 2


def test_cabs_get_lr_and_compute_step():
    from cockpit.utils.optim import ComputeStep

    params = [torch.nn.Parameter(torch.zeros(2))]
    sgd = torch.optim.SGD(params, lr=0.3)
    assert Q.CABS(linear(1)).get_lr(sgd) == 0.3
    assert ComputeStep.is_sgd_default_kwargs(sgd)
    assert not ComputeStep.is_sgd_default_kwargs(
        torch.optim.SGD(params, lr=1, momentum=0.9)
    )
    assert not ComputeStep.is_sgd_default_kwargs(torch.optim.Adam(params))
    other = [torch.nn.Parameter(torch.zeros(1))]
    two_groups = torch.optim.SGD(
        [{"params": params}, {"params": other, "lr": 1}], lr=0.3
    )
    with pytest.raises(ValueError):
        Q.CABS(linear(1)).get_lr(two_groups)


def test_alpha_fit_helpers_as_102():
    from cockpit.quantities.alpha import _fit_quadratic, _get_alpha

    # q(x) = 1 - 2x + x^2, minimum at x = 1; observed exactly at 0 and t = 1.5
    t = 1.5
    fs = [1.0, 1 - 2 * t + t**2]
    dfs = [-2.0, -2 + 2 * t]
    mu = _fit_quadratic(t, fs, dfs, [1.0, 1.0], [1.0, 1.0])
    assert isinstance(mu, np.ndarray)
    np.testing.assert_allclose(mu, [1.0, -2.0, 1.0], atol=1e-9)
    assert _get_alpha(mu, t) == pytest.approx(t / 1.0 - 1)  # overshoot by half
    assert _get_alpha(None, 0.0) == -1 and _get_alpha(None, 1.0) is None
    assert _get_alpha(np.array([0.0, 1.0, -1.0]), 1.0) == -1  # concave


def test_bin_adaptation_policy_with_102s_get_abs_max():
    """1.0.2's policies compute ``m`` in ``_get_abs_max``; an override is used."""
    from cockpit.context import get_batch_size
    from cockpit.quantities.bin_adaptation import GradAbsMax

    class Fixed(GradAbsMax):
        def _get_abs_max(self, global_step, params, batch_loss, range):
            return 0.5 * get_batch_size(global_step) / N  # 0.5, via the getters

    hist = Q.GradHist1d(linear(1), bins=4, adapt=Fixed(lambda step: step == 0))
    _train([hist], steps=2)
    np.testing.assert_allclose(hist.get_output()[0]["edges"], [-2, -1, 0, 1, 2])
    np.testing.assert_allclose(
        hist.get_output()[1]["edges"], [-0.5, -0.25, 0, 0.25, 0.5]
    )
