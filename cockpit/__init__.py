"""cockpit: a debugger for the training of neural networks in PyTorch.

``Cockpit`` tracks quantities (gradient norms, curvature, gradient noise, ...) in the
same backward pass as training; ``CockpitPlotter`` shows them as a dashboard.

The names below, and submodules such as ``cockpit.history``, are imported when first
used (PEP 562), so ``import cockpit.history`` or the ``cockpit plot`` command read
logs without loading torch or BackPACK, and ``from cockpit import Cockpit`` loads
torch but not matplotlib.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

#: Where each lazily imported public name lives: ``(module, attribute)``; an
#: attribute of ``None`` means the module itself.
_LAZY = {
    "Cockpit": ("cockpit.cockpit", "Cockpit"),
    "CockpitPlotter": ("cockpit.plotting", "CockpitPlotter"),
    "History": ("cockpit.history", "History"),
    "quantities": ("cockpit.quantities", None),
}

__all__ = ["Cockpit", "CockpitPlotter", "History", "quantities", "__version__"]


def _version() -> str:
    from importlib import metadata

    try:
        return metadata.version("cockpit-debugger")
    except metadata.PackageNotFoundError:  # running from a source tree
        return "0+unknown"


def __getattr__(name: str) -> Any:
    if name == "__version__":
        value = _version()
    elif name in _LAZY:
        module_name, attribute = _LAZY[name]
        module = importlib.import_module(module_name)
        value = module if attribute is None else getattr(module, attribute)
    elif not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}"):
        value = importlib.import_module(f"{__name__}.{name}")  # any submodule
    else:
        raise AttributeError(f"module 'cockpit' has no attribute {name!r}")
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
