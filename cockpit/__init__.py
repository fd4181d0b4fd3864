"""cockpit: a debugger for the training of neural networks in PyTorch.

``Cockpit`` tracks quantities (gradient norms, curvature, gradient noise, ...) in the
same backward pass as training; ``CockpitPlotter`` shows them as a dashboard.
"""

from __future__ import annotations

from importlib import metadata

from cockpit import quantities
from cockpit.cockpit import Cockpit
from cockpit.history import History

try:
    __version__ = metadata.version("cockpit-debugger")
except metadata.PackageNotFoundError:  # running from a source tree
    __version__ = "0+unknown"

__all__ = ["Cockpit", "CockpitPlotter", "History", "quantities", "__version__"]


def __getattr__(name: str):
    # The plotter pulls in matplotlib; import it only when asked for.
    if name == "CockpitPlotter":
        from cockpit.plotting import CockpitPlotter

        return CockpitPlotter
    raise AttributeError(f"module 'cockpit' has no attribute {name!r}")
