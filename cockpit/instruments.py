"""cockpit-for-pytorch 1.0.2's module of gauge functions (a re-export shim).

The functions live in :mod:`cockpit.plotting.gauges_102`.
"""

from cockpit.plotting.gauges_102 import (
    alpha_gauge,
    cabs_gauge,
    distance_gauge,
    early_stopping_gauge,
    grad_norm_gauge,
    gradient_tests_gauge,
    histogram_1d_gauge,
    histogram_2d_gauge,
    hyperparameter_gauge,
    max_ev_gauge,
    mean_gsnr_gauge,
    performance_gauge,
    tic_gauge,
    trace_gauge,
)

__all__ = [
    "alpha_gauge",
    "cabs_gauge",
    "distance_gauge",
    "early_stopping_gauge",
    "grad_norm_gauge",
    "gradient_tests_gauge",
    "histogram_1d_gauge",
    "histogram_2d_gauge",
    "hyperparameter_gauge",
    "max_ev_gauge",
    "mean_gsnr_gauge",
    "performance_gauge",
    "tic_gauge",
    "trace_gauge",
]
