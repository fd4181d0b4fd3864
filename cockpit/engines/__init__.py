"""Engines: what computes per-sample statistics and curvature in the backward pass.

:mod:`cockpit.engines.backpack` (with its rules in
:mod:`cockpit.engines.backpack_rules`) is the one place that knows BackPACK.
"""
