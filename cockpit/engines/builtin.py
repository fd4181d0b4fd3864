"""The built-in engines, registered on import: BackPACK, ghost, replay, autograd."""

from cockpit.engines.autograd import AutogradEngine
from cockpit.engines.backpack.engine import BackpackEngine
from cockpit.engines.ghost import GhostEngine
from cockpit.engines.replay import ReplayEngine

#: The built-in engines, in their order.
BUILTIN_ENGINES = (BackpackEngine, GhostEngine, ReplayEngine, AutogradEngine)
