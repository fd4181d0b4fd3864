"""HessTrace where BackPACK has no exact diagonal: a Hutchinson estimate with its error.

The estimate must lie within 4 standard errors of the exact trace (dense float64
Hessian from autograd), and the reported standard error must match the spread of
repeated estimates.
"""

import warnings

import pytest
import torch

from cockpit import Cockpit
from cockpit import quantities as Q
from cockpit.curvature.hutchinson import hessian_diagonal, trace_errors
from cockpit.engines.coverage import CoverageError
from cockpit.errors import CockpitWarning
from cockpit.utils.schedules import linear
from tests.utils import brute_force as bf
from tests.utils.any_model import make_any_problem
from tests.utils.harness import run


def exact_traces(problem, record):
    with warnings.catch_warnings():  # torch's note on hooks of frozen inputs
        warnings.simplefilter("ignore", UserWarning)
        hessian = bf.hessian(problem, record.params, record.x, record.y)
    return torch.stack([d.sum() for d in bf.split_diagonal(hessian, record.params)])


def test_hess_trace_is_estimated_within_four_standard_errors():
    problem = make_any_problem("rmsnorm-mlp", batch_size=6)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CockpitWarning)  # an estimate, not missing
        result = run(problem, [Q.HessTrace(linear(1), curvature="hutchinson")], 3)
    coverage = result.cockpit.coverage()
    assert {str(s) for row in coverage.params for s in row.quantities.values()} == {
        "estimated (Hutchinson, 16 Hessian-vector products)"
    }
    for step in range(3):
        got = torch.tensor(result.output[step]["HessTrace"], dtype=torch.float64)
        estimate = result.output[step]["HessTrace_estimate"]
        assert estimate["method"] == "hutchinson" and estimate["probes"] == 16
        stderr = torch.tensor(estimate["stderr"], dtype=torch.float64)
        want = exact_traces(problem, result.records[step])
        assert (stderr > 0).all()
        assert ((got - want).abs() <= 4 * stderr).all(), (got, want, stderr)


def test_reported_standard_error_matches_repeated_estimates():
    problem = make_any_problem("rmsnorm-mlp", batch_size=6)
    x, y = problem.make_batch(0)
    params = problem.params
    generator = torch.Generator().manual_seed(1)
    repeats, probes = 200, 8
    traces, variances = [], []
    for _ in range(repeats):
        losses = problem.individual_loss_fn(problem.model(x), y)
        drawn = hessian_diagonal(losses, params, probes, generator)
        diagonals, errors = drawn.diagonals, trace_errors(drawn.traces)
        traces.append(torch.stack([d.sum() for d in diagonals]))
        variances.append(torch.stack(errors) ** 2)
    traces, variances = torch.stack(traces), torch.stack(variances)
    spread = traces.var(dim=0)  # the variance of one estimate, from repeats
    ratio = variances.mean(dim=0) / spread
    assert ((ratio > 0.75) & (ratio < 1.33)).all(), ratio
    want = torch.stack(
        [d.sum() for d in bf.split_diagonal(bf.hessian(problem, params, x, y), params)]
    )
    mean_error = (spread / repeats).sqrt()
    assert ((traces.mean(0) - want).abs() <= 4 * mean_error).all()


def test_estimates_are_errors_under_strict_and_ggn_is_estimated():
    problem = make_any_problem("rmsnorm-mlp")
    strict = {
        "cockpit_cls": lambda params, quantities: Cockpit(
            params, quantities, strict=True
        )
    }
    hutchinson = Q.HessTrace(linear(1), curvature="hutchinson")
    with pytest.raises(CoverageError, match=r"HessTrace.*estimated \(Hutchinson"):
        run(problem, [hutchinson], steps=1, **strict)
    # the GGN of the cross-entropy (its value: tests/curvature/test_ggn_curvature.py)
    ggn = Q.HessTrace(linear(1), curvature="diag_ggn_exact")
    result = run(make_any_problem("rmsnorm-mlp"), [ggn], steps=1)
    assert result.output[0]["HessTrace_estimate"]["curvature"] == "ggn"
