"""The built-in step features, registered on import (each sets its own order)."""

from cockpit.step.features.backward_checks import (
    EngineChecks,
    Failures,
    LossScale,
    NonFinite,
    RepeatedBackward,
    Unreached,
)
from cockpit.step.features.cost import StepCost
from cockpit.step.features.curvature import Curvature
from cockpit.step.features.data_parallel import DataParallel
from cockpit.step.features.sharded import ShardedReplay

#: The built-in features (their ``order`` says when each runs).
BUILTIN_FEATURES = (
    StepCost,
    Curvature,
    RepeatedBackward,
    NonFinite,
    LossScale,
    EngineChecks,
    Unreached,
    Failures,
    DataParallel,
    ShardedReplay,
)
