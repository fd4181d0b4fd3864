"""InnerTest: does the mini-batch gradient point downhill? (Bollapragada et al.)."""

from __future__ import annotations

from cockpit.quantities import defined
from cockpit.quantities import functional as F
from cockpit.quantities.batch_statistics import GramQuantity


class InnerTest(GramQuantity):
    """The inner product test of Bollapragada et al. (2018) over the whole gradient.

    ``sqrt( sum_i (g_i . g - ||g||^2)^2 / (N (N-1) ||g||^4) )`` with ``g_i`` the
    gradient of sample ``i`` and ``g`` their mean. Small values mean the mini-batch
    gradient is a descent direction with high probability. Computed from the
    ``[N, N]`` Gram matrix of the per-sample gradients (BackPACK ``BatchGrad``).

    Missing (see :mod:`cockpit.quantities.defined`) with fewer than 2 samples, a
    zero or non-finite ``||g||``, or when every ``g_i . g - ||g||^2`` is rounding.
    """

    def _from_projections(self, norms, dots, grad_squared_norm, dtype):
        # the rounding of g_i . g is at most about eps ||g_i|| mean_j ||g_j||
        scale = (norms * norms.mean()).sqrt()
        cancelled = defined.resolved(dots - grad_squared_norm, scale, dtype)
        return cancelled or F.inner_test_from_projections(dots, grad_squared_norm)
