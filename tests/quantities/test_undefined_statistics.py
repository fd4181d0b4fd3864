"""Issue 28: a statistic undefined for the step's data is missing, never a number.

Issue 37: and a defined one is never refused (the spreads are formed with the
mean subtracted first; see tests/quantities/test_defined_values.py).

Each statistic that divides by a norm or subtracts two sums, at batch size 1, with
gradients exactly zero, with a loss near 1e30, and with one sample scaled far
beyond the others, in float32 and with bfloat16 parameters. Where a value is
defined it is compared with its definition, computed in float64 from the
per-sample gradients the step's engine gave (and ``.grad`` for Variance, which
reads it); where it is not, it is recorded under ``missing`` with the reason
(:mod:`cockpit.quantities.defined`) and warned once.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from backpack import extend

from cockpit import Cockpit
from cockpit import quantities as Q
from cockpit.errors import CockpitWarning
from cockpit.needs import Need
from cockpit.quantities import defined
from cockpit.quantities.base import SingleStepQuantity
from cockpit.utils.host import to_host
from cockpit.utils.schedules import linear

KEYS = ["NormTest", "InnerTest", "OrthoTest", "Variance", "MeanGSNR",
        "EarlyStopping", "CABS"]  # fmt: skip
LR, EPSILON = 0.1, 1e-5
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class _Capture(SingleStepQuantity):
    """Keeps the per-sample gradients the quantities saw (float64)."""

    needs = frozenset({Need.INDIVIDUAL_GRADIENTS})

    def __init__(self, schedule):
        super().__init__(schedule)
        self.seen = {}

    def accumulate(self, global_step, view):
        self.seen[view.index] = view.individual_gradients().detach().double()

    def _compute(self, global_step, ctx):
        return None


def _step(dtype, n=6, target_scale=None, sample_scale=None, zero=False):
    """One tracked step of a small ReLU net; returns values, per-sample grads, etc."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2)
    )
    model = extend(model.to(dtype))
    x = torch.randn(n, 3).to(dtype)
    if sample_scale is not None:
        x[0] *= sample_scale
    y = torch.randn(n, 2)
    if target_scale is not None:
        y = y * target_scale
    y = (model(x).detach() if zero else y).to(dtype)
    capture = _Capture(linear(1))
    quantities = [getattr(Q, key)(linear(1)) for key in KEYS]
    cockpit = Cockpit(model.parameters(), [capture, *quantities])
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    out = model(x)
    loss = extend(torch.nn.MSELoss())(out, y)
    info = {"loss": loss, "batch_size": n, "optimizer": opt,
            "individual_losses": ((out - y) ** 2).mean(1)}  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with cockpit(0, info=info):
            loss.backward()
    ours = [str(w.message) for w in caught if issubclass(w.category, CockpitWarning)]
    per_sample = [capture.seen[i] for i in sorted(capture.seen)]
    grads = [p.grad.double() for p in model.parameters()]
    return cockpit.get_output()[0], per_sample, grads, float(loss.detach()), ours


def _definitions(per_sample, loss):
    """Every statistic from its definition, float64 (None where undefined)."""
    n = per_sample[0].shape[0]
    G = torch.cat([g.flatten(1) for g in per_sample], dim=1)
    g = G.mean(0)
    q = g @ g
    dots = G @ g
    v = ((G - g) ** 2).mean(0)  # biased, per coordinate
    s2 = ((G - g) ** 2).sum(0) / (n - 1)
    out = {
        "NormTest": (((G - g) ** 2).sum() / (n * (n - 1) * q)).sqrt(),
        "InnerTest": (((dots - q) ** 2).sum() / (n * (n - 1) * q**2)).sqrt(),
        "OrthoTest": (
            ((G - (dots / q)[:, None] * g) ** 2).sum() / (n * (n - 1) * q)
        ).sqrt(),
        "Variance": [
            ((p - p.mean(0)) ** 2).flatten(1).sum(1).mean() for p in per_sample
        ],
        "MeanGSNR": (g**2 / (v + EPSILON)).mean(),
        "EarlyStopping": 1 - n / G.shape[1] * (g**2 / (s2 + EPSILON)).sum(),
        "CABS": LR * v.sum() / loss,
    }
    return out


def _close(key, got, want):
    want = torch.as_tensor(want, dtype=torch.float64)
    got = torch.as_tensor(got, dtype=torch.float64)
    assert torch.isfinite(got).all(), (key, got)
    tolerance = 1e-3 * want.abs() + 1e-30
    assert ((got - want).abs() <= tolerance).all(), (key, got, want)


def _missing(values, keys, reason, ours):
    missing = values.get("missing", {})
    for key in keys:
        assert key not in values, (key, values.get(key))
        assert missing.get(key, "").startswith(reason[:40]), (key, missing.get(key))
    for key in keys:  # one warning each, with the fix
        said = [m for m in ours if m.startswith(f"{key} has no value")]
        assert len(said) == 1 and "Fix" in said[0], (key, ours)


@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
def test_batch_size_one(dtype):
    values, *_, ours = _step(DTYPES[dtype], n=1)
    _missing(values, KEYS, defined.FEW_SAMPLES, ours)


@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
def test_gradients_exactly_zero(dtype):
    """The net's own outputs as targets: every per-sample gradient is zero. Tests
    that divide by ||g|| (and CABS by the zero loss) are missing; the variance and
    signal-to-noise ratio of zeros are zero, by their definitions."""
    values, per_sample, grads, loss, ours = _step(DTYPES[dtype], zero=True)
    assert loss == 0 and all((g == 0).all() for g in per_sample)
    _missing(values, ["NormTest", "InnerTest", "OrthoTest"], defined.ZERO_GRADIENT,
             ours)  # fmt: skip
    assert "zero" in values["missing"]["CABS"]
    assert values["Variance"] == [0.0] * 4
    assert values["MeanGSNR"] == 0.0 and values["EarlyStopping"] == 1.0


@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
def test_loss_near_1e30_is_defined_and_right(dtype):
    """Gradients near 1e15: ||g||^4 is beyond float32's range (InnerTest divides
    by it), every statistic is still defined, and equals its definition."""
    values, per_sample, grads, loss, ours = _step(DTYPES[dtype], target_scale=1e15)
    assert 1e28 < loss < 1e32
    want = _definitions(per_sample, loss)
    assert "missing" not in values, values["missing"]
    for key in KEYS:
        _close(key, values[key], want[key])


@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
def test_squared_norms_beyond_the_dtype_are_missing(dtype):
    """x[0] times 2.5e10: the loss and .grad are finite, that sample's squared
    norm is not."""
    values, per_sample, grads, loss, ours = _step(DTYPES[dtype], sample_scale=2.5e10)
    assert math.isfinite(loss) and "nonfinite" not in values
    _missing(values, KEYS, defined.overflow(torch.float32), ours)


@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
def test_one_sample_scaled_far_beyond_the_others(dtype):
    """x[0] times 1e9: every g_i is all but parallel to g. Every value is defined
    and right (||g||^4 is beyond float32's range); OrthoTest's orthogonal spread
    is below float32's resolution of ||g_i - g||^2, so it is within the absolute
    bound the dtype allows (its docstring) of the float64 value."""
    values, per_sample, grads, loss, ours = _step(DTYPES[dtype], sample_scale=1e9)
    want = _definitions(per_sample, loss)
    assert "missing" not in values, values["missing"]
    for key in KEYS:
        if key != "OrthoTest":
            _close(key, values[key], want[key])
    G = torch.cat([g.flatten(1) for g in per_sample], dim=1)
    n, g = G.shape[0], G.mean(0)
    scale = ((G - g).norm(dim=1) ** 2).sum() / (n * (n - 1) * (g @ g))
    bound = (defined.ULPS * torch.finfo(torch.float32).eps * scale).sqrt()
    assert abs(values["OrthoTest"] - float(want["OrthoTest"])) <= bound


@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
def test_identical_samples_have_zero_spread(dtype):
    """Every sample the same: the spread is zero, and so are the tests; the
    signal-to-noise ratio is g^2 / epsilon. Each is defined (the mean is
    subtracted before squaring), within the dtype's bound of its definition."""
    torch.manual_seed(0)
    model = extend(torch.nn.Linear(3, 2).to(DTYPES[dtype]))
    x = torch.randn(1, 3).repeat(6, 1).to(DTYPES[dtype])
    y = torch.randn(1, 2).repeat(6, 1).to(DTYPES[dtype])
    keys = ["NormTest", "OrthoTest", "Variance", "InnerTest", "MeanGSNR"]
    cockpit = Cockpit(model.parameters(), [getattr(Q, k)(linear(1)) for k in keys])
    loss = extend(torch.nn.MSELoss())(model(x), y)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with cockpit(0, info={"loss": loss, "batch_size": 6}):
            loss.backward()
    values = cockpit.get_output()[0]
    assert "missing" not in values and not [
        w for w in caught if issubclass(w.category, CockpitWarning)
    ]
    bound = (defined.ULPS * torch.finfo(torch.float32).eps * 2 / 5) ** 0.5
    for key in ["NormTest", "OrthoTest", "InnerTest"]:
        assert 0 <= values[key] <= bound, (key, values[key])
    assert values["Variance"] == [0.0, 0.0]
    g = torch.cat([p.grad.double().flatten() for p in model.parameters()])
    # .grad is rounded to the model's dtype, the mean of the samples is not
    rounding = 2 * torch.finfo(DTYPES[dtype]).eps
    want = float((g**2 / EPSILON).mean())
    assert math.isclose(values["MeanGSNR"], want, rel_tol=rounding), want


def test_missing_has_one_rule():
    """The helpers: a zero divisor, and a non-finite sum or value, are missing.

    The checks are tensors, decided with the value when it is copied to the host.
    """
    inf, one = torch.tensor(float("inf")), torch.tensor(1.0)

    def decide(value, *conditions):
        return to_host(defined.decided(value, torch.float32, *conditions))

    assert "non-finite" in decide(one, *defined.nonfinite(torch.ones(2), inf)).reason
    assert decide(one, *defined.nonfinite(torch.ones(2))) == 1.0
    zero = decide(one, *defined.divisor(torch.tensor(0.0)))
    assert zero.reason == defined.ZERO_GRADIENT
    assert decide(one, *defined.divisor(torch.tensor(1e-30))) == 1.0
    assert "non-finite" in decide(torch.tensor(float("nan"))).reason
    assert decide(torch.tensor(2.0)) == 2.0
    # the first condition that holds gives the reason
    both = decide(one, *defined.divisor(torch.tensor(0.0)), *defined.nonfinite(inf))
    assert both.reason == defined.ZERO_GRADIENT
    assert decide(torch.tensor([1.0, float("inf")])).reason.startswith("the squared")
