"""The quantity base classes under cockpit-for-pytorch 1.0.2's import path.

1.0.2 defines ``Quantity``, ``SingleStepQuantity``, ``TwoStepQuantity`` and
``ByproductQuantity`` in ``cockpit.quantities.quantity``, and its documentation
tells users to subclass them from there to write their own quantities. This module
re-exports the classes of :mod:`cockpit.quantities.base` under those names so such
imports keep working.
"""

from cockpit.quantities.base import (
    ByproductQuantity,
    Quantity,
    SingleStepQuantity,
    TwoStepQuantity,
)

__all__ = ["ByproductQuantity", "Quantity", "SingleStepQuantity", "TwoStepQuantity"]
