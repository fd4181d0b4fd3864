"""What a quantity can ask for, as data.

A quantity declares the :class:`Need` members it reads (its ``needs`` attribute); it
never names an engine's extensions or buffers. At each step the cockpit unions the
needs of the quantities due and the engine picks the cheapest way to serve them all
in one backward pass (for BackPACK:
:func:`cockpit.engines.backpack.api.extensions_for`).

:data:`NEEDS` says, for every need, what it is and what it asks of the step: whether
it is read inside the backward pass (through
:meth:`Quantity.accumulate <cockpit.quantities.Quantity.accumulate>`, while the
engine's buffers are alive), whether ``loss.backward`` must keep the graph
(``create_graph=True``), and whether the quantity runs after the engine's buffers are
freed, with the engine off (extra Hessian-vector products).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Mapping


class Need(str, Enum):
    """Something a quantity reads at a step."""

    GRADIENT = "gradient"
    PARAMETERS = "parameters"
    INDIVIDUAL_GRADIENTS = "individual_gradients"
    GRAM = "gram"
    PROJECTIONS = "projections"
    BATCH_L2 = "batch_l2"
    SUM_GRAD_SQUARED = "sum_grad_squared"
    DIAG_H = "diag_h"
    DIAG_GGN_EXACT = "diag_ggn_exact"
    DIAG_GGN_MC = "diag_ggn_mc"
    HESSIAN_VECTOR_PRODUCTS = "hessian_vector_products"
    OPTIMIZER_UPDATE = "optimizer_update"


@dataclass(frozen=True)
class NeedSpec:
    """What one need is and what it asks of the step.

    Attributes:
        description: What the quantity reads.
        in_backward: Read in ``accumulate`` during the backward pass.
        create_graph: ``loss.backward`` must be called with ``create_graph=True``.
        after_cleanup: Tracked after the engine's buffers are freed, engine off.
    """

    description: str
    in_backward: bool = False
    create_graph: bool = False
    after_cleanup: bool = False


#: Every need, with what it asks of the step.
NEEDS: Mapping[Need, NeedSpec] = {
    Need.GRADIENT: NeedSpec("the mini-batch gradient g in .grad after the backward"),
    Need.PARAMETERS: NeedSpec("the parameter values when the step is tracked"),
    Need.INDIVIDUAL_GRADIENTS: NeedSpec(
        "per-sample gradients g_i (their elements, projections, mean)",
        in_backward=True,
    ),
    Need.GRAM: NeedSpec("inner products g_i . g_j of per-sample gradients", True),
    Need.PROJECTIONS: NeedSpec(
        "projections g_i . v of per-sample gradients onto one vector per parameter "
        "(the mean gradient, an update) and the mean gradient",
        True,
    ),
    Need.BATCH_L2: NeedSpec("squared norms ||g_i||^2 of per-sample gradients", True),
    Need.SUM_GRAD_SQUARED: NeedSpec(
        "elementwise second moment sum_i g_i**2 of per-sample gradients", True
    ),
    Need.DIAG_H: NeedSpec("the diagonal of the loss Hessian", True),
    Need.DIAG_GGN_EXACT: NeedSpec("the diagonal of the generalised Gauss-Newton", True),
    Need.DIAG_GGN_MC: NeedSpec(
        "a one-sample Monte-Carlo estimate of the GGN diagonal", True
    ),
    Need.OPTIMIZER_UPDATE: NeedSpec(
        "the update optimizer.step() makes, as replayed from the mini-batch gradient"
    ),
    Need.HESSIAN_VECTOR_PRODUCTS: NeedSpec(
        "Hessian-vector products of the mini-batch loss",
        create_graph=True,
        after_cleanup=True,
    ),
}

#: Curvature labels accepted by HessTrace and the TIC quantities.
CURVATURES = {
    "diag_h": Need.DIAG_H,
    "diag_ggn_exact": Need.DIAG_GGN_EXACT,
    "diag_ggn_mc": Need.DIAG_GGN_MC,
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
        valid = ", ".join(repr(c) for c in [*CURVATURES, "hutchinson"])
        raise ValueError(
            f"Unknown curvature {curvature!r}. Choose one of {valid}."
        ) from None


def in_backward(needs) -> bool:
    """Whether any of ``needs`` is read during the backward pass."""
    return any(NEEDS[need].in_backward for need in needs)


def create_graph(needs) -> bool:
    """Whether any of ``needs`` requires ``loss.backward(create_graph=True)``."""
    return any(NEEDS[need].create_graph for need in needs)


def after_cleanup(needs) -> bool:
    """Whether any of ``needs`` makes the quantity run after the engine's cleanup."""
    return any(NEEDS[need].after_cleanup for need in needs)
