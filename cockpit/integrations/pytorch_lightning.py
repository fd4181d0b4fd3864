"""Cockpit as a callback of the standalone ``pytorch_lightning`` 2.x package.

::

    import pytorch_lightning as pl
    from cockpit.integrations.pytorch_lightning import CockpitCallback

    trainer = pl.Trainer(callbacks=[CockpitCallback()])

``pytorch_lightning.Trainer`` runs only subclasses of ``pytorch_lightning.Callback``,
a class of its own, not ``lightning.pytorch.Callback``; this module's
``CockpitCallback`` is :mod:`cockpit.integrations.lightning`'s callback (same
arguments, behaviour and limits, documented there) built on it by
:func:`~cockpit.integrations.lightning.callback_class`. It needs ``pytorch_lightning``
only, not ``lightning``.
"""

from __future__ import annotations

try:
    import pytorch_lightning
except Exception as error:  # e.g. a torchvision that cannot load: name the fix
    if getattr(error, "name", None) != "pytorch_lightning":  # installed
        from cockpit.integrations._common import check_torchvision

        check_torchvision(__name__, "pytorch_lightning (through torchmetrics)")
    raise

from cockpit.integrations.lightning import callback_class

__all__ = ["CockpitCallback"]

CockpitCallback = callback_class(pytorch_lightning, __name__)
