"""Trace estimators and the Lanczos decomposition they share, on dense matrices.

``cockpit.curvature.hutchinson`` against the exact diagonal of symmetric float64
matrices whose spectra look like networks' Hessians (a few outliers of both signs
over a flat bulk): the estimates are unbiased, their reported standard errors match
the spread of repeated estimates, and deflation by the Krylov space cuts the
variance by what :func:`residual_share` says. Also Lanczos' ``top`` (the largest
eigenvalue next to the one of largest magnitude) and ``keep_basis``.
"""

import numpy as np
import pytest
import torch

from cockpit.curvature import hutchinson as te
from cockpit.engines.autograd import sum_error
from cockpit.quantities.hess_max_ev import lanczos_max_ev
from cockpit.step.features.estimators import MIN_DEFLATED_PROBES, deflated_probes

SHAPES = [torch.Size([7]), torch.Size([4, 5]), torch.Size([33])]
DIM = sum(s.numel() for s in SHAPES)


def hessian_like(seed, outliers=(-9.0, 14.0, 11.0, 8.0)):
    gen = torch.Generator().manual_seed(seed)
    basis, _ = torch.linalg.qr(
        torch.randn(DIM, DIM, generator=gen, dtype=torch.float64)
    )
    bulk = 0.6 * torch.randn(DIM, generator=gen, dtype=torch.float64)
    bulk[: len(outliers)] = torch.tensor(outliers, dtype=torch.float64)
    return basis @ torch.diag(bulk) @ basis.T


def block_traces(matrix):
    blocks = torch.split(torch.diagonal(matrix), [s.numel() for s in SHAPES])
    return torch.stack([b.sum() for b in blocks])


def krylov_of(matrix, seed, steps=12):
    gen = torch.Generator().manual_seed(seed)
    v0 = torch.randn(DIM, generator=gen, dtype=torch.float64)
    result = lanczos_max_ev(
        lambda v: matrix @ v, v0, rtol=0.0, atol=1e-300, max_iter=steps,
        keep_basis=True,
    )  # fmt: skip
    return result.krylov


def test_lanczos_decomposition_holds():
    matrix = hessian_like(0)
    krylov = krylov_of(matrix, 1)
    q = torch.stack(list(krylov.rows()), 1)
    k = krylov.size
    t = torch.diag(torch.tensor(krylov.alphas, dtype=torch.float64))
    off = torch.diag(torch.tensor(krylov.betas, dtype=torch.float64), 1)
    t = t + off + off.T
    residual = matrix @ q - q @ t - torch.outer(krylov.tail, torch.eye(k)[-1].double())
    assert float(residual.abs().max()) < 1e-12
    assert float((q.T @ q - torch.eye(k)).abs().max()) < 1e-12
    assert float((q.T @ krylov.tail).abs().max()) < 1e-12


def repeated(estimator, matrix, repeats=150):
    values, errors, sums, sum_errors, shares, products = [], [], [], [], [], []
    for seed in range(repeats):
        gen = torch.Generator().manual_seed(1000 + seed)
        estimate = estimator(matrix, seed, gen)
        traces = estimate.traces
        values.append(traces.mean(0))
        errors.append(traces.std(0) / traces.shape[0] ** 0.5)
        sums.append(traces.sum(1).mean())
        sum_errors.append(sum_error(traces))
        products.append(estimate.products)
        if estimate.krylov_variance is not None:
            shares.append(te.residual_share(estimate))
        diagonals = torch.cat([d.reshape(-1) for d in estimate.diagonals])
        torch.testing.assert_close(
            torch.stack([b.sum() for b in estimate.diagonals]), traces.mean(0)
        )
        assert diagonals.shape == (DIM,)
    return (torch.stack(values), torch.stack(errors), torch.stack(sums),
            torch.stack(sum_errors), shares, products)  # fmt: skip


def hutchinson(matrix, seed, gen):
    return te.hutchinson(lambda v: matrix @ v, SHAPES, 16, gen, torch.float64, "cpu")


def deflated(matrix, seed, gen):
    return te.deflated(lambda v: matrix @ v, krylov_of(matrix, seed), SHAPES, 8, gen)


@pytest.mark.parametrize("estimator", [hutchinson, deflated], ids=["hutch", "defl"])
def test_unbiased_and_errors_match_repeated_draws(estimator):
    matrix = hessian_like(3)
    values, errors, sums, sum_errors, _, _ = repeated(estimator, matrix)
    exact = block_traces(matrix)
    spread = values.std(0)
    # the reported error of one estimate matches the spread of many (+-25 %)
    ratio = (errors**2).mean(0).sqrt() / spread
    assert ((ratio > 0.8) & (ratio < 1.25)).all(), ratio
    sum_ratio = float((sum_errors**2).mean().sqrt() / sums.std())
    assert 0.8 < sum_ratio < 1.25, sum_ratio
    # unbiased: the mean of the repeats within 4 of its standard errors
    mean_error = spread / values.shape[0] ** 0.5
    assert ((values.mean(0) - exact).abs() <= 4 * mean_error).all()
    assert abs(float(sums.mean() - exact.sum())) <= 4 * float(sums.std()) / 150**0.5


def test_deflation_cuts_the_variance_by_the_residual_share():
    matrix = hessian_like(4)
    _, _, hutch_sums, _, _, _ = repeated(hutchinson, matrix, 120)
    _, _, defl_sums, _, shares, _ = repeated(deflated, matrix, 120)
    # per probe: Hutchinson has 16, the deflated estimate 8
    hutch_var = float(hutch_sums.var()) * 16
    defl_var = float(defl_sums.var()) * 8
    assert defl_var < 0.5 * hutch_var  # four outliers hold most of the mass
    predicted = float(np.mean(shares))
    assert 0.7 < (defl_var / hutch_var) / predicted < 1.4


def test_probes_follow_the_previous_share():
    assert deflated_probes(16, None) == 16  # first step: Hutchinson's budget
    assert deflated_probes(16, 1.0) == 16
    assert deflated_probes(16, 0.6) == 10
    assert deflated_probes(16, 0.01) == MIN_DEFLATED_PROBES


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_lanczos_top_is_the_largest_eigenvalue(sign):
    matrix = sign * hessian_like(5, outliers=(-12.0, 10.0, 9.5, 3.0))
    eigenvalues = torch.linalg.eigvalsh(matrix)
    v0 = torch.randn(
        DIM, generator=torch.Generator().manual_seed(2), dtype=torch.float64
    )
    result = lanczos_max_ev(lambda v: matrix @ v, v0, top=True)
    magnitude = float(eigenvalues[eigenvalues.abs().argmax()])
    assert abs(result.eigenvalue - magnitude) <= 1e-3 * abs(magnitude)
    assert abs(result.top - float(eigenvalues[-1])) <= 1e-3 * abs(magnitude) + 1e-6
    if magnitude > 0:
        assert result.top == result.eigenvalue
