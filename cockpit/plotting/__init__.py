"""Plotting: the dashboard (:class:`CockpitPlotter`), its gauges and timelapses.

* :class:`CockpitPlotter` draws the dashboard live from a cockpit or from a log.
* :mod:`cockpit.plotting.instruments` declares the gauges as data
  (:data:`~cockpit.plotting.instruments.GAUGES`) and has one function per gauge,
  ``plot_<thing>(ax, data, ...)``, for your own figures.
* :mod:`cockpit.instruments` and :mod:`cockpit.plotter` keep cockpit-for-pytorch
  1.0.2's gauge functions and plotter module working.
* :func:`make_timelapse` turns a run's log into an animated GIF.
"""

from cockpit.plotting import instruments
from cockpit.plotting.dashboard import CockpitPlotter
from cockpit.plotting.data import DashboardData, as_history
from cockpit.plotting.style import dashboard_style
from cockpit.plotting.timelapse import make_timelapse

__all__ = [
    "CockpitPlotter",
    "DashboardData",
    "as_history",
    "dashboard_style",
    "instruments",
    "make_timelapse",
]
