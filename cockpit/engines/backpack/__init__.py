"""The BackPACK engine: the only package that imports BackPACK.

:mod:`~cockpit.engines.backpack.api` (the extensions and savefields relied on),
:mod:`~cockpit.engines.backpack.engine` (the engine), its hook plan
(:mod:`~cockpit.engines.backpack.hooks`), routing rules
(:mod:`~cockpit.engines.backpack.routing`) and per-sample result forms
(:mod:`~cockpit.engines.backpack.rules`).
"""
