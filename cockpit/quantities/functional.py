"""Pure maths of the first-order quantities: no parameters, hooks or optimizers.

The quantities reduce per-parameter BackPACK results to small sums inside the
backward pass and finish with the functions below. Notation (mean-reduced loss):
``g_i`` is the gradient of sample ``i``'s loss, ``g = (1/N) sum_i g_i`` the
mini-batch gradient, ``D`` the number of parameters. Functions take and return
tensors (no device synchronisation) unless they say otherwise.
"""

from __future__ import annotations

import torch
from torch import Tensor

#: What the Alpha fit uses in place of a zero variance (as cockpit-for-pytorch does).
VARIANCE_FLOOR = 1e-10


def sample_variance(values: Tensor) -> Tensor:
    """Return the unbiased variance ``(1/(N-1)) sum_i (v_i - mean(v))**2``.

    Args:
        values: ``N`` observations, any shape (flattened).

    Returns:
        A scalar tensor; zero if there are fewer than two observations.
    """
    values = values.reshape(-1)
    if values.numel() < 2:
        return torch.zeros((), dtype=values.dtype, device=values.device)
    return torch.var(values, correction=1)


def norm_test(sum_squared_norms: Tensor, grad_squared_norm: Tensor, n: int) -> Tensor:
    """Return the norm test statistic of Byrd et al. (2012).

    ``sqrt( sum_i ||g_i - g||^2 / (N (N-1) ||g||^2) )``, computed as
    ``sum_i ||g_i - g||^2 = sum_i ||g_i||^2 - N ||g||^2`` (clamped at zero against
    rounding).

    Args:
        sum_squared_norms: ``sum_i ||g_i||^2`` over the whole model.
        grad_squared_norm: ``||g||^2`` over the whole model.
        n: The batch size ``N``.

    Returns:
        A scalar tensor (``nan`` or ``inf`` if ``N < 2`` or ``g = 0``).
    """
    spread = (sum_squared_norms - n * grad_squared_norm).clamp(min=0)
    return (spread / (n * (n - 1) * grad_squared_norm)).sqrt()


def _gram_parts(gram: Tensor) -> tuple[Tensor, Tensor, int]:
    n = gram.shape[0]
    dots = gram.sum(1) / n  # g_i . g
    grad_squared_norm = dots.sum() / n  # ||g||^2
    return dots, grad_squared_norm, n


def inner_test(gram: Tensor) -> Tensor:
    """Return the inner product test statistic of Bollapragada et al. (2018).

    ``sqrt( sum_i (g_i . g - ||g||^2)^2 / (N (N-1) ||g||^4) )``.

    Args:
        gram: The Gram matrix ``G_ij = g_i . g_j`` of the whole model, ``[N, N]``.

    Returns:
        A scalar tensor (``nan`` or ``inf`` if ``N < 2`` or ``g = 0``).
    """
    dots, grad_squared_norm, _ = _gram_parts(gram)
    return inner_test_from_projections(dots, grad_squared_norm)


def inner_test_from_projections(dots: Tensor, grad_squared_norm: Tensor) -> Tensor:
    """:func:`inner_test` from ``g_i . g`` (``[N]``) and ``||g||^2``."""
    n = dots.shape[0]
    spread = ((dots - grad_squared_norm) ** 2).sum()
    return (spread / (n * (n - 1) * grad_squared_norm**2)).sqrt()


def ortho_test(gram: Tensor) -> Tensor:
    """Return the orthogonality test statistic of Bollapragada et al. (2018).

    ``sqrt( sum_i ||g_i - (g_i . g / ||g||^2) g||^2 / (N (N-1) ||g||^2) )``, where
    ``||g_i - (g_i . g / ||g||^2) g||^2 = ||g_i||^2 - (g_i . g)^2 / ||g||^2``.

    Args:
        gram: The Gram matrix ``G_ij = g_i . g_j`` of the whole model, ``[N, N]``.

    Returns:
        A scalar tensor (``nan`` or ``inf`` if ``N < 2`` or ``g = 0``).
    """
    dots, grad_squared_norm, _ = _gram_parts(gram)
    return ortho_test_from_projections(torch.diagonal(gram), dots, grad_squared_norm)


def ortho_test_from_projections(
    norms: Tensor, dots: Tensor, grad_squared_norm: Tensor
) -> Tensor:
    """:func:`ortho_test` from ``||g_i||^2`` and ``g_i . g`` (``[N]``), ``||g||^2``."""
    n = dots.shape[0]
    orthogonal = (norms - dots**2 / grad_squared_norm).clamp(min=0)
    return (orthogonal.sum() / (n * (n - 1) * grad_squared_norm)).sqrt()


def snr_sum(
    mean_grad: Tensor,
    sum_grad_squared: Tensor,
    n: int,
    epsilon: float,
    unbiased: bool,
) -> Tensor:
    """Return ``sum_d g_d^2 / (var_d + epsilon)`` over the coordinates of a tensor.

    Args:
        mean_grad: ``g`` for one parameter tensor.
        sum_grad_squared: ``sum_i g_i^2`` elementwise, same shape.
        n: The batch size ``N``.
        epsilon: Added to the variance to avoid division by zero.
        unbiased: Use ``var_d = (1/(N-1)) sum_i (g_i,d - g_d)^2`` (EarlyStopping)
            instead of the biased ``(1/N) sum_i (g_i,d - g_d)^2`` (MeanGSNR).

    Returns:
        A scalar tensor.
    """
    squared = mean_grad**2
    spread = sum_grad_squared - n * squared  # sum_i (g_i,d - g_d)^2
    variance = spread / (n - 1) if unbiased else spread / n
    variance = variance.clamp(min=0)  # a variance below zero is rounding
    return (squared / (variance + epsilon)).sum()


def snr_sum_centered(
    mean_grad: Tensor, spread: Tensor, n: int, epsilon: float, unbiased: bool
) -> Tensor:
    """:func:`snr_sum` from ``spread = sum_i (g_i,d - g_d)^2`` (formed centred).

    Args:
        mean_grad: ``g`` for one parameter tensor.
        spread: ``sum_i (g_i,d - g_d)^2`` elementwise, same shape, ``>= 0``.
        n: The batch size ``N``.
        epsilon: Added to the variance to avoid division by zero.
        unbiased: Divide the spread by ``N - 1`` (EarlyStopping) instead of ``N``.

    Returns:
        A scalar tensor.
    """
    variance = spread / (n - 1) if unbiased else spread / n
    return (mean_grad**2 / (variance + epsilon)).sum()


def early_stopping(snr: Tensor, n: int, dim: int) -> Tensor:
    """Return the evidence-based criterion of Mahsereci et al. (2017).

    ``1 - (N/D) sum_d g_d^2 / (s_d^2 + epsilon)``; positive values suggest stopping.

    Args:
        snr: ``sum_d g_d^2 / (s_d^2 + epsilon)`` with the unbiased variance, summed
            over all coordinates (see :func:`snr_sum`).
        n: The batch size ``N``.
        dim: The number of coordinates ``D``.

    Returns:
        A scalar tensor.
    """
    return 1 - n / dim * snr


def fit_quadratic(
    tau: float, values: tuple, slopes: tuple, variances: tuple
) -> Tensor | None:
    """Fit ``q(x) = w0 + w1 x + w2 x^2`` to noisy values and slopes at 0 and ``tau``.

    Python numbers in, the fit or ``None`` out: :func:`quadratic_fit` decided on
    the host.

    Args:
        tau: Distance between the two points.
        values: ``(f0, f1)``.
        slopes: ``(f'0, f'1)``.
        variances: Variances of ``(f0, f1, f'0, f'1)``, all positive.

    Returns:
        ``(w0, w1, w2)``, or ``None`` if the system is singular.
    """
    numbers = [torch.as_tensor(v, dtype=torch.float64) for v in (*values, *slopes)]
    solution, solved = quadratic_fit(
        torch.tensor(tau, dtype=torch.float64),
        torch.stack(numbers),
        torch.tensor(variances, dtype=torch.float64),
    )
    return solution if bool(solved) else None


def quadratic_fit(
    tau: Tensor, observations: Tensor, variances: Tensor
) -> tuple[Tensor, Tensor]:
    """The weighted least-squares fit of :func:`fit_quadratic`, on the device.

    The observations ``(f0, f1, f'0, f'1)`` have design rows ``(1, 0, 0)``,
    ``(1, tau, tau^2)``, ``(0, 1, 0)``, ``(0, 1, 2 tau)`` and weights
    ``1 / variance``; the estimate is ``(Phi^T W Phi)^{-1} Phi^T W y`` (float64).
    Nothing is synchronised: whether the system could be solved is a tensor.

    Args:
        tau: Distance between the two points (0-dim, float64).
        observations: ``(f0, f1, f'0, f'1)`` (float64).
        variances: Their variances, all positive (float64).

    Returns:
        ``(w0, w1, w2)`` and whether it is a finite solution (0-dim boolean).
    """
    one, zero = torch.ones_like(tau), torch.zeros_like(tau)
    phi = torch.stack(
        [
            torch.stack([one, zero, zero]),
            torch.stack([one, tau, tau**2]),
            torch.stack([zero, one, zero]),
            torch.stack([zero, one, 2 * tau]),
        ]
    )
    weights = 1.0 / variances
    lhs = phi.T @ (weights[:, None] * phi)
    rhs = phi.T @ (weights * observations)
    solution, info = torch.linalg.solve_ex(lhs, rhs)
    return solution, (info == 0) & torch.isfinite(solution).all()


def alpha_from_fit(tau: float, coefficients: Tensor | None) -> float | None:
    """Map a quadratic fit along the step to the normalised step length ``alpha``.

    With the minimiser ``x* = -w1 / (2 w2)`` of the fit, ``alpha = tau / x* - 1``:
    ``-1`` means the step did not move (or the fit has no minimum ahead: ``w2 <= 0``,
    the limit ``x* -> infinity``), ``0`` landing in the minimum, ``+1`` landing at the
    mirror point of equal height.

    Args:
        tau: The step length (``>= 0``).
        coefficients: ``(w0, w1, w2)`` from :func:`fit_quadratic`, or ``None``.

    Returns:
        ``alpha`` as a float; ``-1.0`` for ``tau = 0``; ``None`` if there is no
        estimate (singular fit, or ``w1 = 0`` so that ``x* = 0``).
    """
    if tau == 0:
        return -1.0
    if coefficients is None:
        return None
    tau = torch.tensor(tau, dtype=torch.float64)
    coefficients = torch.as_tensor(coefficients, dtype=torch.float64)
    alpha, defined = alpha_of_fit(tau, coefficients, torch.tensor(True))
    return float(alpha) if bool(defined) else None


def alpha_of_fit(
    tau: Tensor, coefficients: Tensor, solved: Tensor
) -> tuple[Tensor, Tensor]:
    """:func:`alpha_from_fit` on the device: ``alpha`` and whether it is defined.

    Args:
        tau: The step length (0-dim, float64, ``>= 0``).
        coefficients: ``(w0, w1, w2)`` from :func:`quadratic_fit`.
        solved: Whether the fit was solved (from :func:`quadratic_fit`).

    Returns:
        ``alpha`` (0-dim float64; ``-1`` for ``tau = 0`` or ``w2 <= 0``) and
        whether it is defined (false for an unsolved fit or ``w1 = 0``).
    """
    w1, w2 = coefficients[1], coefficients[2]
    flat = (tau == 0) | (w2 <= 0)
    alpha = torch.where(flat, -1.0, -2.0 * tau * w2 / w1 - 1.0)
    defined = (tau == 0) | (solved & ((w2 <= 0) | (w1 != 0)))
    return alpha, defined


def floor_variances(variances: tuple) -> tuple[tuple, bool]:
    """Replace zero (or negative) variances by :data:`VARIANCE_FLOOR`.

    Returns:
        The variances as floats, and whether any was replaced.
    """
    floored = tuple(VARIANCE_FLOOR if float(v) <= 0 else float(v) for v in variances)
    replaced = any(float(v) <= 0 for v in variances)
    return floored, replaced
