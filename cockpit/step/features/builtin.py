"""The built-in step features, registered on import (each sets its own order)."""

from cockpit.step.features.cost import StepCost
from cockpit.step.features.data_parallel import DataParallel
from cockpit.step.features.engine_checks import EngineChecks
from cockpit.step.features.estimators import Hutchinson
from cockpit.step.features.failures import Failures
from cockpit.step.features.ggn import GGNCurvature
from cockpit.step.features.loss_scale import LossScale
from cockpit.step.features.nonfinite import NonFinite
from cockpit.step.features.repeated_backward import RepeatedBackward
from cockpit.step.features.unreached import Unreached

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
