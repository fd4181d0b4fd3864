"""Quantities that cockpit can track (all keyed by class name unless given a key).

``__all__`` lists quantity classes only (as 1.0.2's did, plus the base classes and
:class:`Variance`), so that code can iterate it as such. The helpers for writing
quantities, :data:`MISSING_KEY`, :class:`Missing`, :class:`TrackContext` and
:class:`PerParameter`, are importable from here all the same.
"""

from cockpit.quantities.alpha import Alpha
from cockpit.quantities.base import MISSING_KEY as MISSING_KEY
from cockpit.quantities.base import (
    ByproductQuantity,
    Quantity,
    SingleStepQuantity,
    TwoStepQuantity,
)
from cockpit.quantities.base import Missing as Missing
from cockpit.quantities.base import TrackContext as TrackContext
from cockpit.quantities.batch_statistics import PerParameter as PerParameter
from cockpit.quantities.cabs import CABS
from cockpit.quantities.distance import Distance
from cockpit.quantities.early_stopping import EarlyStopping
from cockpit.quantities.grad_hist import GradHist1d, GradHist2d
from cockpit.quantities.grad_norm import GradNorm
from cockpit.quantities.hess_max_ev import HessMaxEV
from cockpit.quantities.hess_trace import HessTrace
from cockpit.quantities.inner_test import InnerTest
from cockpit.quantities.loss import Loss
from cockpit.quantities.mean_gsnr import MeanGSNR
from cockpit.quantities.norm_test import NormTest
from cockpit.quantities.ortho_test import OrthoTest
from cockpit.quantities.parameters import Parameters
from cockpit.quantities.tic import TICDiag, TICTrace
from cockpit.quantities.time import Time
from cockpit.quantities.update_size import UpdateSize
from cockpit.quantities.variance import Variance

__all__ = [
    "Alpha",
    "ByproductQuantity",
    "CABS",
    "Distance",
    "EarlyStopping",
    "GradHist1d",
    "GradHist2d",
    "GradNorm",
    "HessMaxEV",
    "HessTrace",
    "InnerTest",
    "Loss",
    "MeanGSNR",
    "NormTest",
    "OrthoTest",
    "Parameters",
    "Quantity",
    "SingleStepQuantity",
    "TICDiag",
    "TICTrace",
    "Time",
    "TwoStepQuantity",
    "UpdateSize",
    "Variance",
]
