"""The built-in step features, registered on import (each sets its own order)."""

from cockpit.distributed_step import DataParallel
from cockpit.step_features.cost import StepCost
from cockpit.step_features.engine_checks import EngineChecks
from cockpit.step_features.estimators import Hutchinson
from cockpit.step_features.failures import Failures
from cockpit.step_features.ggn import GGNCurvature
from cockpit.step_features.loss_scale import LossScale
from cockpit.step_features.nonfinite import NonFinite
from cockpit.step_features.repeated_backward import RepeatedBackward
from cockpit.step_features.unreached import Unreached

#: The built-in features (their ``order`` says when each runs).
BUILTIN_FEATURES = (
    StepCost,
    GGNCurvature,
    Hutchinson,
    RepeatedBackward,
    NonFinite,
    LossScale,
    EngineChecks,
    Unreached,
    Failures,
    DataParallel,
)
