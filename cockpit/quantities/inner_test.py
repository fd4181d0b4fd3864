"""InnerTest: does the mini-batch gradient point downhill? (Bollapragada et al.)."""

from __future__ import annotations

from cockpit.quantities.batch_statistics import GramQuantity


class InnerTest(GramQuantity):
    """The inner product test of Bollapragada et al. (2018) over the whole gradient.

    ``sqrt( sum_i (g_i . g - ||g||^2)^2 / (N (N-1) ||g||^4) )`` with ``g_i`` the
    gradient of sample ``i`` and ``g`` their mean. Small values mean the mini-batch
    gradient is a descent direction with high probability. Computed from the
    ``[N, N]`` Gram matrix of the per-sample gradients (BackPACK ``BatchGrad``).

    The projections are centred (two-pass) where the per-sample gradients exist as
    a tensor, so where the samples agree the value is 0, exact; from factors
    (a ``Linear`` layer's, the ghost engine's) ``g_i . g - ||g||^2`` is a float64
    difference within ``ULPS eps ||g_i|| ||g||`` of the exact value
    (:class:`~cockpit.quantities.batch_statistics.GramQuantity`), so the value
    is within ``ULPS eps max_i ||g_i|| / (sqrt(N-1) ||g||)`` of the float64 value
    of the same per-sample gradients.

    Missing (see :mod:`cockpit.quantities.defined`) with fewer than 2 samples, a
    zero ``||g||``, or non-finite sums.
    """

    def _from_centered(self, norms, dots, grad_squared_norm):
        n = dots.shape[0]
        spread = (dots**2).sum()  # sum_i ((g_i - g) . g)^2
        return (spread / (n * (n - 1) * grad_squared_norm**2)).sqrt()
