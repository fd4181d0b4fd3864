"""When a statistic of the step's gradients is defined, decided in one place.

Cockpit never records an undefined statistic as a number, and never refuses a
defined one. A quantity that divides by a norm asks this module first and returns
:class:`~cockpit.quantities.base.Missing` with the reason (recorded under
``missing``, warned once, with the fix) when the step's data leave it undefined:

* **fewer than 2 samples**: a spread over samples needs two (:func:`samples`);
* **a zero divisor**: the norm of an exactly zero mini-batch gradient
  (:func:`divisor`);
* **non-finite inputs**: per-sample results or sums that are infinite or NaN in
  the dtype they were handed over in (an overflow of a squared norm, a NaN in
  the step: :func:`finite_sums`, :func:`finite`); nothing computed from them
  afterwards can recover the lost value.

The spreads that cancel (``sum_i ||g_i - g||^2``, a coordinate's variance,
``(g_i - g) . g``) are formed the stable way wherever the per-sample gradients are
at hand as a tensor: the mean is subtracted from each sample before anything is
squared (the corrected two-pass algorithm,
:meth:`cockpit.per_sample.IndividualGradients.centered`), and the per-parameter
sums are accumulated in float64. Only where an engine hands over reductions alone
(BackPACK's ``BatchL2Grad``, a ``Linear`` layer's factors) is a spread the
difference of two sums, taken in float64 and clamped at 0: it is then within
``ULPS * eps * (the larger sum)`` of the exact value, ``eps`` being the precision
of the dtype the sums were formed in. No value is refused for that rounding.

What that means for each quantity (each says its bound in its docstring):

============  ==================================================================
NormTest      N < 2; ``||g|| = 0``; sums not finite
InnerTest     N < 2; ``||g|| = 0``; sums not finite
OrthoTest     N < 2; ``||g|| = 0``; sums not finite
Variance      N < 2; a parameter's sums not finite
MeanGSNR,     N < 2; a mean or centred spread not finite
EarlyStopping
CABS          N < 2; the loss zero or not finite; sums not finite
============  ==================================================================

The divisions are done in float64, so ``||g||^4`` of a float32 gradient near its
largest value does not overflow.
"""

from __future__ import annotations

import torch
from torch import Tensor

from cockpit.quantities.base import Missing

#: The documented bound of a spread taken as a difference of two sums: within
#: this many units of the dtype's precision (``eps``) of the larger sum (with
#: pairwise summation, a sum of ``M`` terms carries at most about ``log2(M) eps``
#: of relative error).
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
        "the step). Fix: scale the loss or the inputs down (or find the NaN)"
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


def finite(value, dtype: torch.dtype = torch.float32):
    """``float(value)``, or :class:`Missing` if it is not finite."""
    value = float(value)
    if value != value or value in (float("inf"), float("-inf")):
        return Missing(overflow(dtype))
    return value


#: :func:`snr_flag`'s flags: defined, or a mean or spread not finite.
SNR_DEFINED, SNR_OVERFLOW = 0, 2


def snr_flag(mean_grad: Tensor, spread: Tensor) -> Tensor:
    """Whether ``sum_d g_d^2 / (var_d + epsilon)`` of one tensor has finite inputs.

    Computed without a device synchronisation (inside the backward pass).

    Returns:
        A 0-dim integer tensor: :data:`SNR_DEFINED` or :data:`SNR_OVERFLOW`.
    """
    finite = torch.isfinite(mean_grad).all() & torch.isfinite(spread).all()
    return torch.where(finite, SNR_DEFINED, SNR_OVERFLOW)


def snr_reason(flag: int, dtype: torch.dtype) -> Missing | None:
    """The :class:`Missing` of an :func:`snr_flag` flag (``None``: defined)."""
    if flag == SNR_OVERFLOW:
        return Missing(overflow(dtype))
    return None
