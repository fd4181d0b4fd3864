"""When a statistic of the step's gradients is defined, decided in one place.

Cockpit never records an undefined statistic as a number. A quantity that divides
by a norm or subtracts two sums asks this module first and returns
:class:`~cockpit.quantities.base.Missing` with the reason (recorded under
``missing``, warned once, with the fix) when the step's data leave it undefined:

* **fewer than 2 samples**: a spread over samples needs two (:func:`samples`);
* **a divisor that is zero or not finite**: the norm of an exactly zero gradient,
  or squared norms that overflow the dtype (:func:`divisor`, :func:`finite_sums`);
* **cancellation**: a difference of two sums (``sum_i ||g_i||^2 - N ||g||^2``,
  ``g_i . g - ||g||^2``) smaller than the rounding error of the dtype the sums
  were formed in, or negative, where the statistic divides it by something: what
  is left of it is rounding, not data (:func:`difference`, :func:`resolved`); a
  variance reported as is (Variance) is then zero, as exact as the dtype allows;
* **a result that is not finite** (:func:`finite`).

What that means for each quantity:

============  ==================================================================
NormTest      N < 2; ``||g|| = 0``; sums not finite; ``sum_i ||g_i||^2 - N ||g||^2``
              within rounding
InnerTest     N < 2; ``||g|| = 0``; sums not finite; every ``g_i . g - ||g||^2``
              within rounding
OrthoTest     N < 2; ``||g|| = 0``; sums not finite; ``sum_i ||g_i||^2 -
              sum_i (g_i . g)^2 / ||g||^2`` within rounding
Variance      N < 2; a parameter's sums not finite (``(1/N) sum_i ||g_i,p||^2 -
              ||g_p||^2`` within rounding or negative: 0)
MeanGSNR,     N < 2; sums not finite; a coordinate whose variance is within its
EarlyStopping rounding error, when that error is above 1% of ``epsilon``
CABS          N < 2; the loss zero or not finite; the spread as for NormTest
============  ==================================================================

Values that are defined are unchanged (the divisions are done in float64, so
``||g||^4`` of a float32 gradient near its largest value does not overflow).
"""

from __future__ import annotations

import torch
from torch import Tensor

from cockpit.quantities.base import Missing

#: A difference smaller than this many units of the dtype's precision (``eps``)
#: of the larger sum is rounding: with pairwise summation, a sum of ``M`` terms
#: carries at most about ``log2(M) eps`` of relative error.
ULPS = 32

FEW_SAMPLES = (
    "it needs at least 2 samples, and the batch has 1 (a spread over samples is "
    "not defined for one). Fix: a batch size > 1 at the tracked steps"
)
ZERO_GRADIENT = (
    "the mini-batch gradient is exactly zero, and the statistic divides by its "
    "norm. Fix: none at a stationary point; otherwise check that the loss "
    "depends on the parameters (a detached output, a zero loss)"
)


def overflow(dtype: torch.dtype) -> str:
    """The reason for sums that are not finite in ``dtype``."""
    return (
        f"the squared gradient norms are non-finite in {_name(dtype)} (an overflow: "
        "a loss near 1e30, or a sample scaled far beyond the others; or a NaN in "
        "the step). Fix: scale the loss or the inputs down, or train in float64"
    )


def cancelled(dtype: torch.dtype) -> str:
    """The reason for a difference lost to ``dtype``'s rounding."""
    return (
        f"the per-sample gradients agree to within {_name(dtype)}'s rounding: their "
        "spread is lost in the difference of two sums (cancellation beyond the "
        "dtype's precision). Fix: compute in float64 (model.double()) to resolve it"
    )


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def eps(dtype: torch.dtype) -> float:
    """The precision of ``dtype`` (``torch.finfo(dtype).eps``)."""
    return torch.finfo(dtype).eps


def wide(tensor) -> Tensor:
    """``tensor`` as a float64 tensor on its device (scalars and ``[N]`` vectors)."""
    return torch.as_tensor(tensor).detach().to(torch.float64)


def first(*checks: Missing | None) -> Missing | None:
    """The first undefined reason among ``checks`` (``None``: all defined)."""
    return next((c for c in checks if c is not None), None)


def samples(n: int) -> Missing | None:
    """Undefined with fewer than 2 samples."""
    return Missing(FEW_SAMPLES) if n < 2 else None


def finite_sums(*sums: Tensor) -> Missing | None:
    """Undefined if any of the sums (tensors) is not finite."""
    values = [torch.as_tensor(value) for value in sums]
    flags = [torch.isfinite(value).all() for value in values]
    if len(flags) > 1 and flags[0].device == flags[-1].device:  # one sync, not one each
        if bool(torch.stack(flags).all()):
            return None
    for value, flag in zip(values, flags, strict=True):
        if not bool(flag):
            return Missing(overflow(value.dtype))
    return None


def divisor(squared_norm: Tensor) -> Missing | None:
    """Undefined if the squared norm a statistic divides by is zero or not finite."""
    undefined = finite_sums(squared_norm)
    if undefined is None and not bool(torch.as_tensor(squared_norm) > 0):
        return Missing(ZERO_GRADIENT)
    return undefined


def difference(
    total: Tensor, part: Tensor, dtype: torch.dtype | None = None, floor=False
):
    """``total - part`` (elementwise) of two non-negative sums, if resolved.

    Args:
        total: The larger sum (e.g. ``sum_i ||g_i||^2``), any shape.
        part: What is taken from it (e.g. ``N ||g||^2``), the same shape.
        dtype: The dtype the sums were formed in (default: ``total``'s).
        floor: For a statistic reported as is (a variance): an entry within
            rounding of zero, or below it, is zero, as exact as the dtype allows
            (gradients that vanish by the model's structure, such as a bias
            before a batch norm, are rounding noise whose sums can come out in
            either order). Otherwise (a statistic divided by something) such an
            entry makes it undefined.

    Returns:
        The difference in float64, or :class:`Missing` if a sum is not finite or
        (unless ``floor``) an entry is negative or within ``ULPS`` rounding
        errors of the larger sum. Entries where both sums are exactly zero (no
        gradient at all) are zero.
    """
    total, part = torch.as_tensor(total), torch.as_tensor(part)
    dtype = dtype or total.dtype
    undefined = finite_sums(total, part)
    if undefined is not None:
        return undefined
    total, part = wide(total), wide(part)
    spread = total - part
    error = ULPS * eps(dtype) * torch.maximum(total.abs(), part.abs())
    lost = spread <= error
    if not floor and bool((lost & ((total != 0) | (part != 0))).any()):
        return Missing(cancelled(dtype))
    return torch.where(lost, torch.zeros_like(spread), spread)


def resolved(differences: Tensor, scale: Tensor, dtype: torch.dtype):
    """Undefined if every one of ``differences`` is within rounding of ``scale``.

    For statistics that sum squares of differences (InnerTest's ``g_i . g -
    ||g||^2``): a few resolved differences carry the sum, none leave noise.
    """
    differences, scale = wide(differences), wide(scale)
    if bool((differences.abs() <= ULPS * eps(dtype) * scale.abs()).all()):
        return Missing(cancelled(dtype))
    return None


def finite(value, dtype: torch.dtype = torch.float32):
    """``float(value)``, or :class:`Missing` if it is not finite."""
    value = float(value)
    if value != value or value in (float("inf"), float("-inf")):
        return Missing(overflow(dtype))
    return value


#: :func:`snr_undefined`'s flags: defined, a coordinate lost to rounding, overflow.
SNR_DEFINED, SNR_CANCELLED, SNR_OVERFLOW = 0, 1, 2


def snr_undefined(
    mean_grad: Tensor, sum_grad_squared: Tensor, n: int, epsilon: float, unbiased: bool
) -> Tensor:
    """Whether ``sum_d g_d^2 / (var_d + epsilon)`` of one tensor is defined.

    A coordinate's variance ``(sum_i g_i,d^2 - N g_d^2) / N`` (or ``/ (N-1)``) is
    lost when it is within the rounding error of ``sum_i g_i,d^2`` and that error
    is not negligible against ``epsilon`` (above 1% of it): its term is then
    rounding. Computed without a device synchronisation (inside the backward pass).

    Returns:
        A 0-dim integer tensor: :data:`SNR_DEFINED`, :data:`SNR_CANCELLED` or
        :data:`SNR_OVERFLOW` (a square or a sum not finite).
    """
    squared = mean_grad**2
    divide = max(n - 1 if unbiased else n, 1)
    variance = (sum_grad_squared - n * squared) / divide
    error = ULPS * eps(sum_grad_squared.dtype) * sum_grad_squared.abs() / divide
    lost = ((variance <= error) & (error >= 1e-2 * epsilon)).any()
    bad = ~(torch.isfinite(squared).all() & torch.isfinite(sum_grad_squared).all())
    return torch.where(bad, SNR_OVERFLOW, lost.long() * SNR_CANCELLED)


def snr_reason(flag: int, dtype: torch.dtype) -> Missing | None:
    """The :class:`Missing` of an :func:`snr_undefined` flag (``None``: defined)."""
    if flag == SNR_OVERFLOW:
        return Missing(overflow(dtype))
    if flag == SNR_CANCELLED:
        return Missing(cancelled(dtype))
    return None
