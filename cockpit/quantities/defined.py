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
  the step: :func:`nonfinite`, :func:`decided`); nothing computed from them
  afterwards can recover the lost value.

Only the batch size is known on the host when a statistic is computed; the other
checks are tensors, decided with the value when the step's values are copied to
the host (:func:`decided`, once per step for all of them), so checking costs no
device synchronisation.

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

import math

import torch
from torch import Tensor

from cockpit.quantities.base import Missing
from cockpit.utils.host import Deferred

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
    """Undefined with fewer than 2 samples (known on the host: no check deferred)."""
    return Missing(FEW_SAMPLES) if n < 2 else None


#: A deferred check: a 0-dim boolean tensor, true where the value is undefined,
#: and the reason recorded then (a dtype stands for :func:`overflow` in it, the
#: text made only where it is recorded).
Condition = tuple[Tensor, "str | torch.dtype"]


def nonfinite(*sums: Tensor) -> list[Condition]:
    """Undefined if any of the sums is not finite (one condition per dtype)."""
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for value in sums:
        value = torch.as_tensor(value)
        by_dtype.setdefault(value.dtype, []).append(torch.isfinite(value).all())
    return [
        (~torch.stack(flags).all() if len(flags) > 1 else ~flags[0], dtype)
        for dtype, flags in by_dtype.items()
    ]


def divisor(squared_norm: Tensor) -> list[Condition]:
    """Undefined if the squared norm a statistic divides by is not finite, or zero."""
    finite = torch.isfinite(squared_norm)
    return [(~finite, squared_norm.dtype), (~(squared_norm > 0), ZERO_GRADIENT)]


def decided(
    value: Tensor, dtype: torch.dtype, *conditions: Condition, then=None
) -> Deferred:
    """``value``, unless a condition holds or it is not finite: decided on the host.

    Nothing is synchronised here: the conditions travel to the host with the
    step's values (:class:`~cockpit.utils.host.Deferred`), where the first that
    holds gives the :class:`Missing` recorded instead (its reason), as does a
    non-finite ``value`` (an overflow in ``dtype``).

    Args:
        value: The statistic (a 0-dim tensor, or one value per parameter).
        dtype: The dtype its inputs were formed in (named in the overflow reason).
        conditions: Deferred checks, in the order their reasons take precedence.
        then: Applied to the host value when it is defined (default: none).
    """
    reasons = [reason for _, reason in conditions]
    flags = [flag.reshape(()).to(value.device) for flag, _ in conditions]
    stacked = torch.stack(flags) if flags else None

    def finish(host):
        number, undefined = host
        for flag, reason in zip(undefined or (), reasons, strict=True):
            if flag:
                return Missing(reason if isinstance(reason, str) else overflow(reason))
        numbers = number if isinstance(number, list) else [number]
        while numbers and isinstance(numbers[0], list):  # (nested lists)
            numbers = [v for row in numbers for v in row]
        for v in numbers:
            if not math.isfinite(v):
                return Missing(overflow(dtype))
        return number if then is None else then(number)

    return Deferred([value, stacked], finish)


def snr_finite(mean_grad: Tensor, spread: Tensor) -> Tensor:
    """Whether ``sum_d g_d^2 / (var_d + epsilon)`` of one tensor has finite inputs.

    Computed without a device synchronisation (inside the backward pass).

    Returns:
        A 0-dim boolean tensor.
    """
    return torch.isfinite(mean_grad).all() & torch.isfinite(spread).all()
