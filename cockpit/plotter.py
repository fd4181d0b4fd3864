"""cockpit-for-pytorch 1.0.2's module path of the plotter: ``cockpit.plotter``.

``from cockpit.plotter import CockpitPlotter`` keeps working;
:mod:`cockpit.plotting` is the home of the dashboard and its gauges.
"""

from cockpit.plotting.dashboard import CockpitPlotter

__all__ = ["CockpitPlotter"]
