"""The trace estimator and Lanczos, on dense matrices.

``cockpit.curvature.hutchinson`` against the exact diagonal of symmetric float64
matrices whose spectra look like networks' Hessians (a few outliers of both signs
over a flat bulk): the estimates are unbiased and their reported standard errors
match the spread of repeated estimates. Also Lanczos' ``top`` (the largest
eigenvalue next to the one of largest magnitude).
"""

import pytest
import torch

from cockpit.curvature import hutchinson as te
from cockpit.curvature.hutchinson import sum_error
from cockpit.curvature.lanczos import lanczos_max_ev

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


def repeated(estimator, matrix, repeats=150):
    values, errors, sums, sum_errors, products = [], [], [], [], []
    for seed in range(repeats):
        gen = torch.Generator().manual_seed(1000 + seed)
        estimate = estimator(matrix, seed, gen)
        traces = estimate.traces
        values.append(traces.mean(0))
        errors.append(traces.std(0) / traces.shape[0] ** 0.5)
        sums.append(traces.sum(1).mean())
        sum_errors.append(sum_error(traces))
        products.append(estimate.products)
        diagonals = torch.cat([d.reshape(-1) for d in estimate.diagonals])
        torch.testing.assert_close(
            torch.stack([b.sum() for b in estimate.diagonals]), traces.mean(0)
        )
        assert diagonals.shape == (DIM,)
    return (torch.stack(values), torch.stack(errors), torch.stack(sums),
            torch.stack(sum_errors), products)  # fmt: skip


def hutchinson(matrix, seed, gen):
    return te.hutchinson(lambda v: matrix @ v, SHAPES, 16, gen, torch.float64, "cpu")


@pytest.mark.parametrize("estimator", [hutchinson], ids=["hutch"])
def test_unbiased_and_errors_match_repeated_draws(estimator):
    matrix = hessian_like(3)
    values, errors, sums, sum_errors, _ = repeated(estimator, matrix)
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
