"""OrthoTest: how much of the per-sample gradients is orthogonal to their mean?"""

from __future__ import annotations

from cockpit.quantities.batch_statistics import GramQuantity


class OrthoTest(GramQuantity):
    """The orthogonality test of Bollapragada et al. (2018) over the whole gradient.

    ``sqrt( sum_i ||g_i - (g_i . g / ||g||^2) g||^2 / (N (N-1) ||g||^2) )`` with
    ``g_i`` the gradient of sample ``i`` and ``g`` their mean. Computed from the
    ``[N, N]`` Gram matrix of the per-sample gradients (BackPACK ``BatchGrad``).

    With ``c_i = g_i - g`` the numerator is ``sum_i ||c_i||^2 - (c_i . g)^2 /
    ||g||^2`` (clamped at 0), from per-sample gradients centred in the two-pass
    form where they exist as a tensor (exact to the dtype); from factors the
    centred terms are float64 differences within ``ULPS eps ||g_i|| (||g_i|| +
    ||g||)`` of the exact ones (:class:`~cockpit.quantities.batch_statistics.
    GramQuantity`), which bounds the value's absolute error by the square root of
    their sum over ``N (N-1) ||g||^2``.

    Missing (see :mod:`cockpit.quantities.defined`) with fewer than 2 samples, a
    zero ``||g||``, or non-finite sums.
    """

    def _from_centered(self, norms, dots, grad_squared_norm):
        n = dots.shape[0]
        orthogonal = (norms - dots**2 / grad_squared_norm).clamp(min=0)
        return (orthogonal.sum() / (n * (n - 1) * grad_squared_norm)).sqrt()
