"""Engines: what computes per-sample results and curvature for the quantities.

:mod:`cockpit.engines.base` defines the interface and the registry; the built-in
engines (:mod:`cockpit.engines.builtin`: BackPACK, replay, batched autograd) are
registered when this package is first imported. :mod:`cockpit.engines.backpack.api`,
:mod:`cockpit.engines.backpack.engine`, :mod:`cockpit.engines.backpack.routing` and
:mod:`cockpit.engines.backpack.rules` are the one place that knows BackPACK.
"""

from cockpit.engines import builtin  # noqa: F401  (registers the built-in engines)
