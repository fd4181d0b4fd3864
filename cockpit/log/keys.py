"""The names of the history entries that are not a quantity's own value.

A history maps each step to ``{key: value}``; most keys are quantities' keys
(``"Loss"``, ``"GradNorm"``), but the cockpit also writes entries of its own, which
the readers (the dashboard, the diagnosis, the exporters) look up by name. Their
names live here, in one module that imports nothing (no torch, no numpy), so that
every writer and reader, with or without torch, spells them the same way.
"""

from __future__ import annotations

#: Quantities without a value at a step: ``{quantity key: reason}``.
MISSING_KEY = "missing"

#: What was NaN or infinite at a tracked step: ``["loss"]``, ``["gradients"]`` or
#: both.
NONFINITE_KEY = "nonfinite"

#: The learning rate of every parameter group at a tracked step (a list).
LEARNING_RATES_KEY = "learning_rates"

#: Suffix of an estimate's description: a step where ``<key>`` was estimated (not
#: computed exactly) also holds ``<key>_estimate``, a mapping with ``"method"``
#: (``"hutchinson"``, ``"ggn_monte_carlo"``, ``"ggn_exact"``), ``"probes"``
#: (Hessian-vector products, or backward passes of the GGN), ``"curvature"`` (the
#: curvature used: ``"hessian"`` or ``"ggn"``, which stands in for the Hessian on
#: models BackPACK cannot serve, see :mod:`cockpit.curvature.source`),
#: ``"stderr"`` (the standard error of each per-parameter value; 0 where the GGN
#: was formed exactly) and ``"stderr_sum"`` (the standard
#: error of their sum; the parameters' estimates share the probes, so their errors
#: are correlated and the sum's error is not the root of their summed squares; for
#: a single value, e.g. TICTrace, both are its standard error). Logs written before
#: ``"stderr_sum"`` existed lack it. Readers that keep only the latest mapping per
#: key (histograms) keep every step's estimate.
ESTIMATE_SUFFIX = "_estimate"

#: The keys written by ``Cockpit.log``, in the order of its arguments.
LOG_KEYS = (
    "epoch_count",
    "train_loss",
    "valid_loss",
    "test_loss",
    "train_accuracy",
    "valid_accuracy",
    "test_accuracy",
    "learning_rate",
)

__all__ = [
    "ESTIMATE_SUFFIX",
    "LEARNING_RATES_KEY",
    "LOG_KEYS",
    "MISSING_KEY",
    "NONFINITE_KEY",
]
