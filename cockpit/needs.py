"""What quantities ask for during the backward pass, and which extensions deliver it.

Quantities do not name BackPACK extensions directly; they name *needs* (per-sample
squared norms, a Gram matrix, a curvature diagonal, ...). The cockpit unions the needs
of every quantity due at a step and :func:`extensions_for` picks the cheapest set of
extensions that serves all of them, so a single backward pass feeds everything:

* if any quantity needs the per-sample gradients themselves (or their Gram matrix),
  the cockpit's :class:`~cockpit.extensions.PerSampleGradients` runs (``BatchGrad``
  that keeps ``Linear`` weights' per-sample gradients as two small factors) and every
  other first-order statistic is derived from its output while it is alive;
* otherwise per-sample squared norms come from ``BatchL2Grad`` and the elementwise
  second moment from ``SumGradSquared``, neither of which materialises per-sample
  gradients for linear and convolution layers;
* curvature diagonals come from ``DiagHessian``, ``DiagGGNExact`` or ``DiagGGNMC``
  (the cockpit's memory-lean variants, see :mod:`cockpit.extensions`).
"""

from __future__ import annotations

from enum import Enum
from typing import Iterable

from backpack.extensions import BatchL2Grad, SumGradSquared
from backpack.extensions.backprop_extension import BackpropExtension

from cockpit.extensions import (
    PerSampleGradients,
    lean_diag_ggn_exact,
    lean_diag_ggn_mc,
    lean_diag_hessian,
)


class Need(str, Enum):
    """A per-parameter statistic that a quantity reads inside the backward pass."""

    INDIVIDUAL_GRADIENTS = "individual_gradients"
    GRAM = "gram"
    BATCH_L2 = "batch_l2"
    SUM_GRAD_SQUARED = "sum_grad_squared"
    DIAG_H = "diag_h"
    DIAG_GGN_EXACT = "diag_ggn_exact"
    DIAG_GGN_MC = "diag_ggn_mc"


#: Curvature labels accepted by HessTrace and the TIC quantities.
CURVATURES = {
    "diag_h": Need.DIAG_H,
    "diag_ggn_exact": Need.DIAG_GGN_EXACT,
    "diag_ggn_mc": Need.DIAG_GGN_MC,
}

_NEEDS_GRAD_BATCH = {Need.INDIVIDUAL_GRADIENTS, Need.GRAM}

_CURVATURE_EXTENSIONS = {
    Need.DIAG_H: lean_diag_hessian,
    Need.DIAG_GGN_EXACT: lean_diag_ggn_exact,
    Need.DIAG_GGN_MC: lean_diag_ggn_mc,
}


def curvature_need(curvature: str) -> Need:
    """Map a curvature label to its need, or fail with the list of valid labels.

    Args:
        curvature: One of ``"diag_h"``, ``"diag_ggn_exact"``, ``"diag_ggn_mc"``.

    Returns:
        The corresponding :class:`Need`.

    Raises:
        ValueError: For an unknown label.
    """
    try:
        return CURVATURES[curvature]
    except (KeyError, TypeError):
        valid = ", ".join(repr(c) for c in CURVATURES)
        raise ValueError(
            f"Unknown curvature {curvature!r}. Choose one of {valid}."
        ) from None


def extensions_for(needs: Iterable[Need]) -> list[BackpropExtension]:
    """Return the BackPACK extensions that serve all ``needs`` in one backward pass.

    Args:
        needs: The union of the needs of all quantities due at a step.

    Returns:
        Extension instances, without duplicates; empty if nothing is needed.
    """
    needs = set(needs)
    extensions: list[BackpropExtension] = []
    if needs & _NEEDS_GRAD_BATCH:
        extensions.append(PerSampleGradients())
    else:
        if Need.BATCH_L2 in needs:
            extensions.append(BatchL2Grad())
        if Need.SUM_GRAD_SQUARED in needs:
            extensions.append(SumGradSquared())
    for need, make in _CURVATURE_EXTENSIONS.items():
        if need in needs:
            extensions.append(make())
    return extensions
