"""OrthoTest: how much of the per-sample gradients is orthogonal to their mean?"""

from __future__ import annotations

from cockpit.quantities import defined
from cockpit.quantities import functional as F
from cockpit.quantities.base import Missing
from cockpit.quantities.batch_statistics import GramQuantity


class OrthoTest(GramQuantity):
    """The orthogonality test of Bollapragada et al. (2018) over the whole gradient.

    ``sqrt( sum_i ||g_i - (g_i . g / ||g||^2) g||^2 / (N (N-1) ||g||^2) )`` with
    ``g_i`` the gradient of sample ``i`` and ``g`` their mean. Computed from the
    ``[N, N]`` Gram matrix of the per-sample gradients (BackPACK ``BatchGrad``).

    Missing (see :mod:`cockpit.quantities.defined`) with fewer than 2 samples, a
    zero or non-finite ``||g||``, or when ``sum_i ||g_i||^2 - sum_i (g_i . g)^2 /
    ||g||^2`` is lost to rounding (every ``g_i`` parallel to ``g``).
    """

    def _from_projections(self, norms, dots, grad_squared_norm, dtype):
        along = (dots**2 / grad_squared_norm).sum()
        spread = defined.difference(norms.sum(), along, dtype)
        if isinstance(spread, Missing):
            return spread
        return F.ortho_test_from_projections(norms, dots, grad_squared_norm)
