"""Quantities that cockpit can track (all keyed by class name unless given a key)."""

from cockpit.quantities.base import (
    ByproductQuantity,
    Quantity,
    SingleStepQuantity,
    TrackContext,
    TwoStepQuantity,
)
from cockpit.quantities.distance import Distance
from cockpit.quantities.grad_hist import GradHist1d, GradHist2d
from cockpit.quantities.grad_norm import GradNorm
from cockpit.quantities.hess_max_ev import HessMaxEV
from cockpit.quantities.hess_trace import HessTrace
from cockpit.quantities.loss import Loss
from cockpit.quantities.parameters import Parameters
from cockpit.quantities.tic import TICDiag, TICTrace
from cockpit.quantities.time import Time
from cockpit.quantities.update_size import UpdateSize
from cockpit.quantities.variance import Variance

__all__ = [
    "ByproductQuantity",
    "Distance",
    "GradHist1d",
    "GradHist2d",
    "GradNorm",
    "HessMaxEV",
    "HessTrace",
    "Loss",
    "Parameters",
    "Quantity",
    "SingleStepQuantity",
    "TICDiag",
    "TICTrace",
    "Time",
    "TrackContext",
    "TwoStepQuantity",
    "UpdateSize",
    "Variance",
]
