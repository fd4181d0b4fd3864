"""OrthoTest: how much of the per-sample gradients is orthogonal to their mean?"""

from __future__ import annotations

from torch import Tensor

from cockpit.quantities import functional as F
from cockpit.quantities.batch_statistics import GramQuantity


class OrthoTest(GramQuantity):
    """The orthogonality test of Bollapragada et al. (2018) over the whole gradient.

    ``sqrt( sum_i ||g_i - (g_i . g / ||g||^2) g||^2 / (N (N-1) ||g||^2) )`` with
    ``g_i`` the gradient of sample ``i`` and ``g`` their mean. Computed from the
    ``[N, N]`` Gram matrix of the per-sample gradients (BackPACK ``BatchGrad``).
    """

    def _statistic(self, gram: Tensor) -> Tensor:
        return F.ortho_test(gram)

    def _from_projections(self, norms: Tensor, dots: Tensor, grad_squared_norm):
        return F.ortho_test_from_projections(norms, dots, grad_squared_norm)
