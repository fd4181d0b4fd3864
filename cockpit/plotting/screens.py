"""The dashboard's screens: which gauges the loaded runs need, laid out on figures.

:class:`Screens` is the part of :class:`~cockpit.plotting.dashboard.CockpitPlotter`
that builds the figures: panels, gauge axes, the step text, the colour key and the
per-layer histograms of the secondary screen; saving, showing and the warnings
about gauges left out.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import numpy as np
from matplotlib.figure import Figure, SubFigure

from cockpit.errors import CockpitWarning
from cockpit.plotting import instruments
from cockpit.plotting.style import (
    COLORS,
    ITERATION_CMAP,
    PANEL_COLORS,
)


def _layer_grid(n: int) -> tuple[int, int]:
    """Rows and columns for ``n`` layer histograms: 2x2, growing alternately."""
    rows, cols = 2, 2
    while rows * cols < n:
        if cols <= rows:
            cols += 1
        else:
            rows += 1
    return rows, cols


class Screens:
    """The figure building of :class:`~cockpit.plotting.dashboard.CockpitPlotter`."""

    def layout(self) -> tuple:
        """What the figures show: the gauges of what the loaded runs tracked.

        Returns:
            ``(primary, bottom, auxiliary, layers)``: the primary screen's
            panels as ``(panel name, gauge names)`` (panels without a tracked
            gauge are left out), the bottom row's and the secondary screen's
            gauge names, and whether per-layer histograms were recorded.
        """
        self._require_data("layout()")
        primary = []
        for panel, gauges in instruments.PRIMARY_GAUGES.items():
            names = tuple(name for name in map(_name, gauges) if self._tracked(name))
            if names:
                primary.append((panel, names))
        bottom = tuple(
            name
            for name in map(_name, instruments.BOTTOM_GAUGES)
            if name == "findings" or self._tracked(name)
        )
        aux = tuple(
            name for name in map(_name, instruments.AUXILIARY_GAUGES)
            if self._tracked(name)
        )  # fmt: skip
        layers = any(instruments.layer_count(run.data) for run in self.runs)
        return tuple(primary), bottom, aux, layers

    def left_out(self, screen: str = "primary") -> list[tuple[str, str]]:
        """The gauges a screen leaves out because no run tracked their quantities.

        Args:
            screen: ``"primary"`` or ``"secondary"``.

        Returns:
            ``(title, what to track)`` of each gauge left out (for the
            secondary screen, also the per-layer histograms).
        """
        self._require_data("left_out()")
        if screen == "primary":
            gauges = [g for gs in instruments.PRIMARY_GAUGES.values() for g in gs]
            gauges += list(instruments.BOTTOM_GAUGES[:-1])
        else:
            gauges = list(instruments.AUXILIARY_GAUGES)
        found = []
        for name in map(_name, gauges):
            if not self._tracked(name):
                gauge = instruments.GAUGES[name]
                found.append((_plain_title(gauge), _plain_hint(gauge)))
        if screen != "primary" and not self.layout()[3]:
            found.append(
                ("Per-layer histograms", "track GradHist2d with keep_individual=True")
            )
        return found

    def _tracked(self, name: str) -> bool:
        """Whether a run recorded (a value, or its absence), or a cockpit tracks it."""
        gauge = instruments.GAUGES[name]
        keys = {role: key for role, key, _ in gauge.keys}
        reads = set(instruments.gauge_reads(gauge, keys))
        for run, configured in zip(self.runs, self._configured):
            if reads & configured or instruments.run_has(run, gauge, keys):
                return True
            if instruments.missing_record(run, reads) is not None:
                return True  # tracked, without a value: the gauge says why
        return False

    # --- internals -------------------------------------------------------------------
    def _ensure_figures(self, managed: bool) -> None:
        if self.fig is not None and managed and self._managed:
            if not self._window_open(self.fig):  # the user closed the window
                self.fig = None
        if self.fig is not None and (self._managed or not managed):
            return
        self._managed = managed
        self._shown = False
        self.fig = self._new_figure("Cockpit")
        self.fig_secondary = None
        if self.secondary_screen:
            self.fig_secondary = self._new_figure("Cockpit: secondary screen")
        self._build(managed)

    def _build(self, managed: bool) -> None:
        """Lay the figures out anew for what the loaded runs tracked."""
        self._layout = self.layout() if self.runs else None
        self._step_texts = []
        self._key_axes = []
        self._notes = []
        self.fig.clear()
        self._build_primary(self.fig)
        if self.fig_secondary is not None:
            self.fig_secondary.clear()
            self._build_secondary(self.fig_secondary)

    def _new_figure(self, window_title: str) -> Figure:
        kwargs = {"figsize": self.figsize, "dpi": self.dpi, "layout": "constrained"}
        if not self._managed:
            from matplotlib.backends.backend_agg import FigureCanvasAgg

            fig = Figure(**kwargs)
            FigureCanvasAgg(fig)
            return fig
        import matplotlib.pyplot as plt

        previous = plt.gcf() if plt.get_fignums() else None
        fig = plt.figure(**kwargs)
        if previous is not None:
            plt.figure(previous)  # give the user's current figure back
        manager = fig.canvas.manager
        if manager is not None:
            manager.set_window_title(window_title)
        return fig

    @staticmethod
    def _window_open(fig: Figure) -> bool:
        import matplotlib.pyplot as plt

        number = getattr(fig, "number", None)
        return number is not None and plt.fignum_exists(number)

    def _panel(self, sub: SubFigure, name: str, color: str) -> None:
        sub.set_facecolor(color)
        sub.suptitle(name, fontsize=10, fontweight="bold", color="#444444")

    def _build_primary(self, fig: Figure) -> None:
        primary, bottom_names, _, _ = self._layout or self._everything()
        self._gauge_axes = []
        rows = [fig]
        if primary:
            rows = fig.subfigures(2, 1, height_ratios=[3.0, 1.1])
            widths = [1.0] * len(primary)
            top = rows[0].subfigures(1, len(primary), wspace=0.01, width_ratios=widths)
            top = [top] if len(primary) == 1 else list(top)
            for sub, (name, gauges) in zip(top, primary):
                self._panel(sub, name, PANEL_COLORS[name.lower()])
                axes = sub.subplots(len(gauges), 1, squeeze=False)[:, 0]
                for gauge, ax in zip(gauges, axes):
                    self._gauge_axes.append((_function(gauge), ax))
        ratios = {"hyperparameters": 1.0, "performance": 1.4, "findings": 1.2}
        holder = rows[-1]
        bottom = holder.subfigures(
            1, len(bottom_names), wspace=0.01,
            width_ratios=[ratios[name] for name in bottom_names],
        )  # fmt: skip
        bottom = [bottom] if len(bottom_names) == 1 else list(bottom)
        for sub, name in zip(bottom, bottom_names):
            sub.set_facecolor(PANEL_COLORS["bottom"])
            self._gauge_axes.append((_function(name), sub.subplots(1, 1)))
        self._step_texts.append(self._step_text(fig))
        self._note_left_out(fig, "primary")

    def _everything(self) -> tuple:
        """The full layout (before anything was loaded)."""
        primary = tuple(
            (panel, tuple(map(_name, gauges)))
            for panel, gauges in instruments.PRIMARY_GAUGES.items()
        )
        aux = tuple(map(_name, instruments.AUXILIARY_GAUGES))
        return primary, tuple(map(_name, instruments.BOTTOM_GAUGES)), aux, True

    def _build_secondary(self, fig: Figure) -> None:
        _, _, aux, layers = self._layout or self._everything()
        self._aux_axes = []
        self._layer_panel = None
        self._layer_axes = []
        parts = (["aux"] if aux else []) + (["layers"] if layers else [])
        if not parts:
            fig.text(0.5, 0.5, "nothing to show on the secondary screen:\n"
                     + _left_out_text(self.left_out("secondary")), ha="center",
                     va="center", color=COLORS["gray"], fontsize=11)  # fmt: skip
            self._step_texts.append(self._step_text(fig))
            return
        ratios = {"aux": 1.0, "layers": 2.2}
        rows = fig.subfigures(len(parts), 1, height_ratios=[ratios[p] for p in parts])
        rows = [rows] if len(parts) == 1 else list(rows)
        for part, sub in zip(parts, rows):
            if part == "aux":
                self._panel(sub, "AUXILIARY", PANEL_COLORS["auxiliary"])
                axes = sub.subplots(1, len(aux), squeeze=False)[0]
                self._aux_axes = [(_function(n), ax) for n, ax in zip(aux, axes)]
            else:
                self._panel(sub, "LAYERWISE", PANEL_COLORS["layerwise"])
                self._layer_panel = sub
        self._step_texts.append(self._step_text(fig))
        self._note_left_out(fig, "secondary")

    def _note_left_out(self, fig: Figure, screen: str) -> None:
        """Name, at the top left, the gauges left out because nothing was tracked."""
        if not self.runs:
            return
        missing = self.left_out(screen)
        if missing:
            text = fig.text(0.005, 0.995, "not tracked, so not shown: "
                            + _left_out_text(missing), ha="left", va="top",
                            fontsize=7.5, color=COLORS["gray"],
                            style="italic")  # fmt: skip
            text.set_in_layout(False)
            self._notes.append(text)

    @staticmethod
    def _step_text(fig: Figure):
        return fig.text(0.995, 0.995, "", ha="right", va="top", fontsize=8)

    def _draw_step_keys(self, upto: int | None) -> None:
        """The key of the points' colour: iteration (one run) at the top right.

        Several runs have one colour each (named in every legend): no key.
        """
        for bar in self._key_axes:
            bar.remove()
        self._key_axes = []
        if self.several:
            return
        steps = self.data.history.steps
        first = steps[0]
        last = self.data.last_step if upto is None else min(upto, self.data.last_step)
        for fig in self.figures:
            bar = fig.add_axes((0.855, 0.974, 0.05, 0.012))
            bar.set_in_layout(False)
            gradient = np.linspace(0.0, 1.0, 128)[None, :]
            bar.imshow(gradient, cmap=ITERATION_CMAP, aspect="auto")
            bar.set_xticks([])
            bar.set_yticks([])
            for spine in bar.spines.values():
                spine.set_linewidth(0.4)
            ends = ((-0.06, f"point colour = iteration {first}", "right"),
                    (1.06, str(last), "left"))  # fmt: skip
            for x, text, align in ends:
                bar.text(x, 0.5, text, transform=bar.transAxes, ha=align,
                         va="center", fontsize=7, color=COLORS["dark"])  # fmt: skip
            self._key_axes.append(bar)

    def _draw_layers(self, source: Any, options: dict[str, Any]) -> None:
        if self._layer_panel is None:
            return
        upto = options["upto"]
        n = max(instruments.layer_count(run.data, upto=upto) for run in self.runs)
        cells = max(n, 1)
        rows, cols = _layer_grid(cells)
        if len(self._layer_axes) != rows * cols:
            self._layer_panel.clear()
            self._panel(self._layer_panel, "LAYERWISE", PANEL_COLORS["layerwise"])
            grid = self._layer_panel.subplots(rows, cols, squeeze=False)
            self._layer_axes = list(grid.flat)
        for index, ax in enumerate(self._layer_axes):
            if n == 0 and index == 0:
                instruments.plot_hist_2d(ax, source, param=0, **options)
            elif index < n:
                instruments.plot_hist_2d(ax, source, param=index, **options)
            else:
                instruments.clear_gauge(ax)
                ax.set_axis_off()

    def _save(
        self,
        savedir: str | os.PathLike,
        savename: str,
        savename_append: str | None,
        savefig_kwargs: dict[str, Any] | None,
    ) -> list[str]:
        kwargs = dict(savefig_kwargs or {})
        fmt = kwargs.get("format", "png")
        suffix = savename_append or ""
        if suffix and not suffix.startswith(("_", "-")):
            suffix = "__" + suffix
        names = [
            f"{savename}__{screen}{suffix}.{fmt}" for screen in ("primary", "secondary")
        ]
        primary, secondary = (os.path.join(os.fspath(savedir), n) for n in names)
        return self.save(
            primary, secondary if self.fig_secondary is not None else None, **kwargs
        )

    def _warn_empty(self) -> None:
        axes = [ax for _, ax in self._gauge_axes + self._aux_axes] + self._layer_axes
        for ax in axes:
            instruments.warn_if_empty(ax, stacklevel=4)
        screens = ["primary"] + (["secondary"] if self.fig_secondary else [])
        for screen in screens:
            for title, hint in self.left_out(screen):
                warnings.warn(
                    f"Gauge {title!r} is not shown: nothing tracked it ({hint}).",
                    CockpitWarning,
                    stacklevel=4,
                )

    def _show(self, display: str, block: bool) -> None:
        if display == "gui":
            import matplotlib.pyplot as plt

            for fig in self.figures:
                if not self._shown:
                    fig.show()  # opens the window once; later updates do not raise it
                fig.canvas.draw_idle()
                fig.canvas.flush_events()
            self._shown = True
            if block:
                plt.show(block=True)
        elif display == "inline":
            from IPython.display import clear_output, display

            clear_output(wait=True)
            for fig in self.figures:
                display(fig)


def _name(gauge: Any) -> str:
    """The gauge's name of a public gauge function (``plot_alpha``: ``"alpha"``)."""
    return gauge if isinstance(gauge, str) else gauge.__name__[len("plot_") :]


def _function(name: str):
    """The public gauge function of a gauge's name."""
    return getattr(instruments, f"plot_{name}")


def _plain_title(gauge: Any) -> str:
    title = gauge.title
    if callable(title):
        title = title({"param": None, "key": ""})
    return title


def _plain_hint(gauge: Any) -> str:
    keys = {role: key for role, key, _ in gauge.keys}
    context = {**keys, **gauge.options}
    hint = gauge.hint(context) if callable(gauge.hint) else gauge.hint.format(**context)
    return hint or "track " + " or ".join(keys.values())


def _left_out_text(missing: list[tuple[str, str]]) -> str:
    """What to track for the gauges left out: ``"HessMaxEV, HessTrace, ..."``."""
    hints = [hint.removeprefix("track ") for _, hint in missing]
    return ", ".join(dict.fromkeys(hints))
