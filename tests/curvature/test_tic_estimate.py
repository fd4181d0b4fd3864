"""TICTrace where BackPACK has no exact curvature: exact moments, Hutchinson trace.

``TICTrace = A / (T + eps)`` with ``A = (1/N) sum_i ||g_i||^2`` exact (per-sample
gradients of either engine) and ``T`` the Hutchinson estimate of the Hessian trace
from the probes the step draws for HessTrace anyway. Its standard error is the
delta method's ``A * SE(T) / (T + eps)**2``; a step whose ``T + eps`` is below
``MIN_RELATIVE`` (3) standard errors is recorded missing.

Proof in float64 against brute force (dense Hessian diagonal from autograd,
per-sample gradients by a loop over samples): every estimated value lies within 4
standard errors of the exact TICTrace, and the reported standard error matches the
spread of repeated estimates.
"""

import math
import warnings

import numpy as np
import pytest
import torch

from cockpit import Cockpit
from cockpit import quantities as Q
from cockpit.engines.coverage import CoverageError
from cockpit.errors import CockpitWarning
from cockpit.quantities.tic import MIN_RELATIVE, tic_trace_estimate
from cockpit.utils.schedules import linear
from tests.utils import brute_force as bf
from tests.utils.any_model import make_any_problem
from tests.utils.harness import run

EPS = 1e-7  # TICTrace's default epsilon


def exact_parts(problem, params, x, y):
    """``(A, T)``: the exact second moment and Hessian trace, by brute force."""
    with warnings.catch_warnings():  # torch's note on hooks of frozen inputs
        warnings.simplefilter("ignore", UserWarning)
        hessian = bf.hessian(problem, params, x, y)
        grads = bf.individual_gradients(problem, params, x, y)
    moment = sum(float((g**2).sum()) for g in grads) / x.shape[0]
    return moment, float(torch.diagonal(hessian).sum())


@pytest.mark.parametrize("arch", ["lstm-batch-first", "tied-custom"])
def test_tic_trace_is_estimated_within_four_standard_errors(arch):
    """Four steps with the default 16 probes: estimated steps lie within 4 SE of the
    brute-force value; their denominator is exactly HessTrace's summed estimate
    (the same probes) and their error the delta method's on HessTrace's
    ``stderr_sum``; a missing step is one whose trace is not clearly positive."""
    problem = make_any_problem(arch, batch_size=6)
    quantities = [
        Q.HessTrace(linear(1), curvature="hutchinson"),
        Q.TICTrace(linear(1), curvature="hutchinson"),
    ]
    with warnings.catch_warnings():  # a refused step warns that it has no value
        warnings.simplefilter("ignore", CockpitWarning)
        result = run(problem, quantities, steps=4)
    coverage = result.cockpit.coverage()
    statuses = {str(row.quantities["TICTrace"]) for row in coverage.params}
    assert statuses == {"estimated (Hutchinson, 16 Hessian-vector products)"}
    assert "TICTrace estimated" in coverage.summary()
    assert any(p.startswith("TICTrace for ") for p in coverage.problems())
    estimated = 0
    for step in range(4):
        values, record = result.output[step], result.records[step]
        moment, trace = exact_parts(problem, record.params, record.x, record.y)
        want = moment / (trace + EPS)
        shared_trace = sum(values["HessTrace"])
        shared_error = values["HessTrace_estimate"]["stderr_sum"]
        if "TICTrace" not in values:  # refused: the rule, with its reason
            assert shared_trace + EPS <= MIN_RELATIVE * shared_error
            reason = values["missing"]["TICTrace"]
            assert "not clearly positive" in reason and "HUTCHINSON_PROBES" in reason
            continue
        estimated += 1
        got = values["TICTrace"]
        entry = values["TICTrace_estimate"]
        assert entry["method"] == "hutchinson" and entry["probes"] == 16
        (stderr,) = entry["stderr"]
        assert stderr == entry["stderr_sum"] > 0
        assert abs(got - want) <= 4 * stderr, (step, got, want, stderr)
        # exact moment over the probes HessTrace drew (shared, not drawn twice)
        denominator = shared_trace + EPS
        assert math.isclose(got, moment / denominator, rel_tol=1e-9)
        delta = moment * shared_error / denominator**2
        assert math.isclose(stderr, delta, rel_tol=1e-9)
        assert denominator > MIN_RELATIVE * shared_error
    assert estimated >= 2, f"only {estimated} of 4 steps estimated"


def test_reported_standard_error_matches_repeated_draws():
    """200 estimates with fresh probes (128 each, where the trace's relative error
    ``r = SE(T)/T`` is about 0.12, inside the delta method's range) on the
    tied-weights model: the variance of the estimates matches the mean squared
    reported error. The variance of 200 draws has a relative spread of about
    sqrt(2/199) = 0.1, the averaged squared errors less, and the delta method's
    second-order terms are about 3 r**2 relative (4 %): band [0.75, 1.33], as for
    HessTrace's errors. Their mean lies within 4 standard errors of the exact value,
    allowing the ratio's bias ``r**2``.

    The probes' per-parameter traces ``v_p . (H v)_p`` are those Hutchinson's
    estimator draws (:func:`~cockpit.curvature.hutchinson.hessian_diagonal`, whose
    own errors are checked against repeated draws in ``test_estimate_errors.py``),
    formed here from the
    dense Hessian in one matrix product: 25,600 Hessian-vector products through
    autograd would take most of a minute."""
    problem = make_any_problem("tied-custom", batch_size=6)
    x, y = problem.make_batch(0)
    params = problem.params
    moment, trace = exact_parts(problem, params, x, y)
    want = moment / (trace + EPS)
    with warnings.catch_warnings():  # torch's note on hooks of frozen inputs
        warnings.simplefilter("ignore", UserWarning)
        hessian = bf.hessian(problem, params, x, y).to(torch.float64)
    sizes = [p.numel() for p in params]
    assert hessian.shape == (sum(sizes), sum(sizes))
    draws, probes = 200, 128
    generator = torch.Generator().manual_seed(1)
    signs = torch.randint(0, 2, (draws * probes, sum(sizes)), generator=generator)
    vectors = (2 * signs - 1).to(torch.float64)
    products = vectors * (vectors @ hessian)  # v_d (H v)_d, H symmetric
    table = torch.stack([block.sum(1) for block in products.split(sizes, 1)], 1)
    values, squared, relative = [], [], []
    for traces in table.split(probes):  # [probes, P] per draw
        estimate = float(traces.sum(1).mean())
        value, error, trace_error = tic_trace_estimate(moment, estimate, traces, EPS)
        assert value is not None  # clearly positive at this precision
        values.append(value)
        squared.append(error**2)
        relative.append(trace_error / estimate)
    spread = float(np.var(values, ddof=1))
    ratio = float(np.mean(squared)) / spread
    assert 0.75 < ratio < 1.33, ratio
    r = float(np.mean(relative))
    assert r < 0.2, r  # where the delta method is meant to hold
    slack = 4 * math.sqrt(spread / len(values)) + want * r**2
    assert abs(float(np.mean(values)) - want) <= slack, (np.mean(values), want)


def test_tic_diag_of_the_hessian_stays_missing_and_strict_refuses():
    """TICDiag of the Hessian cannot be estimated honestly (elementwise division by
    noisy diagonal entries): missing, saying why and pointing to TICTrace. GGN
    curvatures are the GGN's (tests/curvature/test_ggn_curvature.py checks their
    values).
    Under strict=True an estimated TICTrace is an error."""
    problem = make_any_problem("tied-custom")
    quantities = [
        Q.TICDiag(linear(1), curvature="hutchinson"),
        Q.TICTrace(linear(1), curvature="diag_ggn_exact", key="TICTraceGGN"),
    ]
    with pytest.warns(CockpitWarning, match="TICDiag has no value"):
        result = run(problem, quantities, steps=1)
    missing = result.output[0]["missing"]
    assert "only an exact one serves" in missing["TICDiag"]
    assert "track TICTrace, which is estimated" in missing["TICDiag"]
    assert result.output[0]["TICTraceGGN_estimate"]["curvature"] == "ggn"
    strict = {
        "cockpit_cls": lambda params, quantities: Cockpit(
            params, quantities, strict=True
        )
    }
    hutchinson = Q.TICTrace(linear(1), curvature="hutchinson")
    with pytest.raises(CoverageError, match=r"TICTrace.*estimated \(Hutchinson"):
        run(make_any_problem("tied-custom"), [hutchinson], 1, **strict)
