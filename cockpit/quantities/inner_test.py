"""InnerTest: does the mini-batch gradient point downhill? (Bollapragada et al.)."""

from __future__ import annotations

from torch import Tensor

from cockpit.quantities import functional as F
from cockpit.quantities.batch_statistics import GramQuantity


class InnerTest(GramQuantity):
    """The inner product test of Bollapragada et al. (2018) over the whole gradient.

    ``sqrt( sum_i (g_i . g - ||g||^2)^2 / (N (N-1) ||g||^4) )`` with ``g_i`` the
    gradient of sample ``i`` and ``g`` their mean. Small values mean the mini-batch
    gradient is a descent direction with high probability. Computed from the
    ``[N, N]`` Gram matrix of the per-sample gradients (BackPACK ``BatchGrad``).
    """

    def _statistic(self, gram: Tensor) -> Tensor:
        return F.inner_test(gram)

    def _from_projections(self, norms: Tensor, dots: Tensor, grad_squared_norm):
        return F.inner_test_from_projections(dots, grad_squared_norm)
