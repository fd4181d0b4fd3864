"""The dashboard: lays the gauges out on one (or two) figures, live or from a log."""

from __future__ import annotations

import glob
import os
import re
import warnings
from typing import Any

import matplotlib
import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure, SubFigure

from cockpit.errors import CockpitWarning
from cockpit.history import History
from cockpit.log.files import empty_run_cause
from cockpit.plotting import instruments
from cockpit.plotting.data import DashboardData, as_history, read_log
from cockpit.plotting.runs import (
    RUN_COLORS,
    Run,
    check_labels,
    default_labels,
    is_several,
)
from cockpit.plotting.style import (
    COLORS,
    ITERATION_CMAP,
    PANEL_COLORS,
    dashboard_style,
)

_NON_INTERACTIVE = {"agg", "cairo", "pdf", "pgf", "ps", "svg", "template"}


def _display_kind() -> str:
    """``"gui"`` for a window backend, ``"inline"`` for notebooks, else ``"none"``."""
    import matplotlib

    backend = str(matplotlib.get_backend()).lower()
    if "inline" in backend:
        return "inline"
    try:
        from matplotlib.backends import BackendFilter, backend_registry

        non_interactive = set(
            backend_registry.list_builtin(BackendFilter.NON_INTERACTIVE)
        )
    except ImportError:  # matplotlib < 3.9
        from matplotlib import rcsetup

        non_interactive = {b.lower() for b in rcsetup.non_interactive_bk}
    if backend in non_interactive | _NON_INTERACTIVE:
        return "none"
    return "gui"


def _layer_grid(n: int) -> tuple[int, int]:
    """Rows and columns for ``n`` layer histograms: 2x2, growing alternately."""
    rows, cols = 2, 2
    while rows * cols < n:
        if cols <= rows:
            cols += 1
        else:
            rows += 1
    return rows, cols


def log_stem(path: str | os.PathLike) -> str:
    """Return a log path without its ``.json``/``.jsonl`` suffix (1.0.2's naming)."""
    path = os.fspath(path)
    for suffix in (".jsonl", ".json"):
        if path.endswith(suffix):
            return path[: -len(suffix)]
    return path


def resolve_source(
    source: Any, read: DashboardData | None = None
) -> tuple[History, str, str | None]:
    """Return the history, default title and default save folder of a source.

    Args:
        source: What :meth:`CockpitPlotter.plot` accepts.
        read: The data of a log path ``source``, read already.

    Returns:
        The history; ``"Cockpit for <optimizer>"`` for a cockpit that saw an
        optimizer, ``"Cockpit: <file name>"`` for a log, else ``"Cockpit"``; for a
        log, its path without ``.json`` (as cockpit-for-pytorch 1.0.2: images of
        ``logs/run.json`` go to the folder ``logs/run``), else ``None``.

    Raises:
        LogFileError: If a log cannot be read or has no tracked steps.
        ValueError: If any other source has no tracked steps.
    """
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        history = as_history(path) if read is None else read.history  # not empty
        return history, f"Cockpit: {os.path.basename(path)}", log_stem(path)
    history = as_history(source)
    if not history.steps:
        last_step = getattr(source, "last_step", False)  # a Cockpit's; else unknown
        closed = None if last_step is False else last_step is not None
        raise ValueError(
            f"Nothing to plot: the {type(source).__name__} has no tracked steps. "
            f"{empty_run_cause(closed)}"
        )
    optimizer = getattr(source, "optimizer_name", None)
    title = f"Cockpit for {optimizer}" if optimizer else "Cockpit"
    return history, title, None


class CockpitPlotter:
    """Draw cockpit's dashboard from a running cockpit or from a log.

    The primary screen has three tinted panels (STEP SIZE, GRADIENTS, CURVATURE)
    with three gauges each, above a gray row with the learning rate (of every
    parameter group) and the loss / accuracy, what practitioners already watch, and
    the Diagnosis panel: the findings of :func:`cockpit.diagnosis.diagnose`, or "no
    problems found". Steps whose loss or gradients were not finite are shaded red
    on every gauge drawn against the iteration. The secondary screen
    (``secondary_screen=True``) shows the mean GSNR, CABS and the early-stopping
    criterion, and one 2-D histogram per parameter tensor (needs
    ``GradHist2d(..., keep_individual=True)``).

    Call :meth:`plot` as often as you like during training: the figures and a
    cache of the data are kept, so an update reads only the new steps, draws at
    most a bounded number of points per gauge, never steals focus, and works
    headless (Agg). Global matplotlib state (rcParams, backend, interactive mode,
    pyplot's current figure) is left as it was.

    The gauge functions of 1.0.2 (:mod:`cockpit.instruments`, called as
    ``alpha_gauge(plotter, fig, gridspec)``) draw from the data of the last
    :meth:`plot` or :meth:`load`.

    Args:
        secondary_screen: Also draw the secondary screen.
        figsize: Size of each figure in inches.
        dpi: Resolution of each figure (and of saved images).

    Attributes:
        fig: The primary figure (``None`` before the first :meth:`plot`).
        fig_secondary: The secondary figure, if requested.
        data: The loaded run (``None`` before the first :meth:`plot` or :meth:`load`).
        title: The figure title of the loaded run.
        discard: Steps after this one are not drawn (``None``: all).
        show_log_iter: Symmetric-log iteration axes (set by :meth:`plot`).
        debug: Warn about gauges without data (set by :meth:`plot`).
    """

    def __init__(
        self,
        secondary_screen: bool = False,
        figsize: tuple[float, float] = (16.0, 9.0),
        dpi: float = 100.0,
    ):
        self.secondary_screen = secondary_screen
        self.figsize = tuple(figsize)
        self.dpi = dpi
        self.fig: Figure | None = None
        self.fig_secondary: Figure | None = None
        self.data: DashboardData | None = None
        self.title = "Cockpit"
        self.discard: int | None = None
        self.show_log_iter = False
        self.debug = False
        self._default_savedir: str | None = None
        self._managed = False  # figures live in pyplot (a window shows them)
        self._shown = False
        self._gauge_axes: list[tuple[Any, Axes]] = []
        self._aux_axes: list[tuple[Any, Axes]] = []
        self._layer_panel: SubFigure | None = None
        self._layer_axes: list[Axes] = []
        self._step_texts: list[Any] = []
        #: The loaded runs (one, or several side by side); see :meth:`load`.
        self.runs: list[Run] = []
        #: Whether several runs were loaded (a list passed to :meth:`plot`).
        self.several = False
        self._configured: list[set[str]] = []
        self._layout: tuple | None = None
        self._key_axes: list[Axes] = []
        self._notes: list[Any] = []

    # --- public --------------------------------------------------------------------
    def plot(
        self,
        source: Any,
        show_plot: bool = True,
        block: bool = False,
        save_plot: bool = False,
        savedir: str | os.PathLike | None = None,
        savename: str = "cockpit",
        savename_append: str | None = None,
        savefig_kwargs: dict[str, Any] | None = None,
        show_log_iter: bool = False,
        discard: int | None = None,
        plot_title: str | None = None,
        debug: bool = False,
        labels: list[str] | None = None,
    ) -> list[str]:
        """Draw (or update) the dashboard.

        Args:
            source: A :class:`~cockpit.Cockpit` (live), a
                :class:`~cockpit.history.History`, a ``{step: {key: value}}`` dict,
                or the path of a log: ours (also streamed) or one written by
                cockpit-for-pytorch 1.0.2 (with or without ``.json``); or a list
                of these: several runs side by side, one colour each on every
                gauge, aligned by step (live cockpits among them are updated
                like one).
            show_plot: Show the figures: in a window on a GUI backend (opened on
                the first call, then updated without raising it), inline in a
                notebook; nothing to show on a non-interactive backend such as Agg.
            block: Block until the windows are closed (GUI backends only).
            save_plot: Save the figures to ``savedir``.
            savedir: Folder of saved images, created if missing. For a log it
                defaults to the log's path without ``.json`` (as 1.0.2: the images
                of ``logs/run.json`` go to ``logs/run/``); required otherwise.
            savename: File name stem; files are ``<savename>__primary`` and
                ``<savename>__secondary``.
            savename_append: Appended to the file names (e.g. ``"__epoch_3"``;
                ``"__"`` is added in front if it starts with neither ``_`` nor
                ``-``).
            savefig_kwargs: Passed to ``Figure.savefig``; ``format`` (default
                ``"png"``) also sets the file extension.
            show_log_iter: Symmetric-log iteration axes.
            discard: Plot only steps up to this global step (inclusive).
            plot_title: Figure title; default ``"Cockpit for <optimizer>"`` for a
                cockpit, the file name for a log.
            debug: Warn about every gauge that has no data or is left out.
            labels: Names of several runs in the legends (default: the log
                files' names, ``run k`` for other sources).

        Returns:
            Paths of the saved images (empty unless ``save_plot``; empty on the
            processes of a data-parallel run other than the Cockpit's
            ``log_rank``, which draw nothing).

        Raises:
            LogFileError: If a log cannot be read or has no tracked steps.
            ValueError: If another source has no tracked steps, ``save_plot``
                has no ``savedir`` for a non-path source, or the labels do not
                fit the runs.
        """
        if getattr(source, "is_writer", True) is False:
            return []  # a data-parallel run draws on its log_rank process only
        self.load(
            source, discard=discard, plot_title=plot_title, stream=True, labels=labels
        )
        if save_plot and savedir is None:
            if self._default_savedir is None:
                raise ValueError(
                    "save_plot=True needs savedir= when plotting a Cockpit or a "
                    "History (there is no log file to save next to), e.g. "
                    "plotter.plot(cockpit, save_plot=True, savedir='plots')."
                )
            savedir = self._default_savedir
        self.show_log_iter, self.debug = show_log_iter, debug
        display = _display_kind() if (show_plot or block) else "none"
        paths: list[str] = []
        with dashboard_style():
            self._ensure_figures(managed=display == "gui")
            self.draw()
            if save_plot:
                paths = self._save(savedir, savename, savename_append, savefig_kwargs)
            if display != "none":
                for fig in self.figures:
                    fig.canvas.draw()
        if debug:
            self._warn_empty()
        self._show(display, block)
        return paths

    def load(
        self,
        source: Any,
        discard: int | None = None,
        plot_title: str | None = None,
        stream: bool = False,
        labels: list[str] | None = None,
    ) -> DashboardData:
        """Read a run (or several) without drawing (:meth:`plot` calls this first).

        Afterwards :attr:`data` holds the (first) run and :attr:`runs` all of them,
        for :meth:`draw` and for the gauge functions of :mod:`cockpit.instruments`.
        Loading the same cockpit or history again reads only the steps added since.

        Args:
            source: What :meth:`plot` accepts (one run or a list of runs).
            discard: Draw only steps up to this global step (inclusive).
            plot_title: Figure title (default as in :meth:`plot`).
            stream: For a log path, read the file step by step and keep only what
                the dashboard draws up to ``discard``
                (:func:`~cockpit.plotting.data.read_log`); :meth:`plot` does.
            labels: Names of several runs (see :meth:`plot`).

        Returns:
            :attr:`data`.

        Raises:
            LogFileError: If a log cannot be read or has no tracked steps.
            ValueError: If another source has no tracked steps, or the labels do
                not fit the runs.
        """
        several = is_several(source)
        sources = list(source) if several else [source]
        if several and not sources:
            raise ValueError("Nothing to plot: the list of runs is empty.")
        names = (check_labels(labels, len(sources)) if several else None) or (
            default_labels(sources)
        )
        known = {id(run.data.history): run.data for run in self.runs}
        runs, titles, folders, configured = [], [], [], []
        for index, item in enumerate(sources):
            thin = None
            if stream and isinstance(item, (str, os.PathLike)):  # only what is drawn
                thin = read_log(item, upto=discard)
            history, title, default_dir = resolve_source(item, thin)
            if isinstance(item, DashboardData) or thin is not None:
                data = item if thin is None else thin
            else:
                data = known.get(id(history))
                if data is None or data.history is not history:
                    data = DashboardData(history)
            data.refresh()
            color = RUN_COLORS[index % len(RUN_COLORS)] if several else None
            runs.append(Run(names[index], data, color, index))
            titles.append(title)
            folders.append(default_dir)
            quantities = getattr(item, "quantities", None)
            keys = {getattr(q, "key", None) for q in quantities or ()} - {None}
            configured.append(keys)
        self.runs = runs
        self.several = several
        self._configured = configured
        self.data = runs[0].data
        if plot_title is not None:
            self.title = plot_title
        elif not several:
            self.title = titles[0]
        elif len(runs) <= 3:
            self.title = "Cockpit: " + " vs ".join(run.label for run in runs)
        else:
            self.title = f"Cockpit: {len(runs)} runs"
        self.discard = discard
        self._default_savedir = folders[0]
        return self.data

    def write_html(self, path: str | os.PathLike) -> str:
        """Write the loaded run(s) as an interactive HTML dashboard.

        The same gauges, laid out as on the primary (and, where something was
        tracked for it, the secondary) screen, in one file that opens without
        a server or network access: zoom and pan on steps, values on hover,
        runs switched on and off, the diagnosis with its evidence (see
        :mod:`cockpit.plotting.html`).

        Args:
            path: The ``.html`` file (parent folders are created).

        Returns:
            The path written.

        Raises:
            RuntimeError: If nothing was loaded yet.
        """
        from cockpit.plotting.html import payload, render, save_page

        self._require_data("write_html()")
        data = payload(self.runs, self.layout(), self.title, self.discard,
                       self.left_out("primary"))  # fmt: skip
        return save_page(render(data), path)

    def gauge_source(self) -> Any:
        """What the gauges draw: :attr:`data` for one run, :attr:`runs` for several.

        Raises:
            RuntimeError: If nothing was loaded yet.
        """
        self._require_data("gauge_source()")
        return list(self.runs) if self.several else self.data

    @property
    def tracking_data(self):
        """The loaded steps as a pandas DataFrame, as 1.0.2's plotter held them.

        One row per step up to :attr:`discard`, the step in column ``iteration``,
        one column per key (missing values ``NaN``).

        Raises:
            RuntimeError: If nothing was loaded yet.
        """
        self._require_data("tracking_data")
        whole = self.data.history if self.data.log is None else None
        if whole is None:  # read step by step for drawing: histograms are left out
            whole = History.from_json(self.data.log)
        frame = whole.to_dataframe()
        if self.discard is not None:
            frame = frame[frame.index <= self.discard]
        return frame.rename_axis("iteration").reset_index()

    def _require_data(self, what: str) -> None:
        if self.data is None:
            raise RuntimeError(
                f"{what} needs a loaded run: call plotter.plot(source) or "
                "plotter.load(source) first."
            )

    def save(
        self,
        path: str | os.PathLike | None,
        secondary_path: str | os.PathLike | None = None,
        **savefig_kwargs: Any,
    ) -> list[str]:
        """Save the figures drawn by the last :meth:`plot` to the given files.

        Args:
            path: File for the primary screen (``None``: skip it). The format
                follows the suffix unless ``format=`` is given.
            secondary_path: File for the secondary screen (``None``: skip it).
            **savefig_kwargs: Passed to ``Figure.savefig`` (e.g. ``dpi``).

        Returns:
            The paths written (a path without a suffix gets the default format's,
            ``.png``, as ``savefig`` adds it).

        Raises:
            RuntimeError: If nothing was plotted yet, or a secondary path is given
                but the plotter has no secondary screen.
        """
        if self.fig is None:
            raise RuntimeError("Nothing to save yet: call plotter.plot(source) first.")
        if secondary_path is not None and self.fig_secondary is None:
            raise RuntimeError(
                "This plotter has no secondary screen; create it with "
                "CockpitPlotter(secondary_screen=True)."
            )
        written = []
        with dashboard_style():
            for fig, target in ((self.fig, path), (self.fig_secondary, secondary_path)):
                if target is None:
                    continue
                target = os.fspath(target)
                if not os.path.splitext(target)[1] and "format" not in savefig_kwargs:
                    # what savefig writes: the default format's suffix is added
                    target += "." + matplotlib.rcParams["savefig.format"]
                parent = os.path.dirname(target)
                if parent:
                    os.makedirs(parent, exist_ok=True)
                fig.savefig(target, **savefig_kwargs)
                written.append(target)
        return written

    @property
    def figures(self) -> list[Figure]:
        """The figures drawn so far (primary first)."""
        return [f for f in (self.fig, self.fig_secondary) if f is not None]

    def draw(self, upto: int | None = None) -> list[Figure]:
        """Draw the loaded run(s) onto the figures (made headless if there are none).

        :meth:`plot` calls this; call it yourself after :meth:`load` to draw
        without showing or saving, or repeatedly with growing ``upto`` for frames
        of an animation. Only the gauges of what was tracked are laid out (a
        gauge of a quantity a live cockpit tracks but has not recorded yet is
        laid out and says so); the figure names what was left out. When more
        gets tracked, the figures are laid out anew.

        Args:
            upto: Draw only steps up to this one (default: :attr:`discard`).

        Returns:
            The figures (primary first).

        Raises:
            RuntimeError: If nothing was loaded yet.
        """
        self._require_data("draw()")
        upto = self.discard if upto is None else upto
        options = {"show_log_iter": self.show_log_iter, "upto": upto}
        source = self.gauge_source()
        last = max(r.data.last_step for r in self.runs if r.data.last_step is not None)
        last = last if upto is None else min(upto, last)
        with dashboard_style():
            if self.fig is None:
                self._ensure_figures(managed=False)
            if self.layout() != self._layout:
                self._build(self._managed)
            self.fig.suptitle(self.title)
            for gauge, ax in self._gauge_axes:
                gauge(ax, source, **options)
            if self.fig_secondary is not None:
                self.fig_secondary.suptitle(f"{self.title}: secondary screen")
                for gauge, ax in self._aux_axes:
                    gauge(ax, source, **options)
                self._draw_layers(source, options)
            for text in self._step_texts:
                text.set_text(f"step {last}")
            self._draw_step_keys(upto)
        return self.figures

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

    def build_animation(
        self, logpath: str | os.PathLike, duration: int = 200, loop: int = 0
    ) -> list[str]:
        """Stitch dashboards saved during training into animated GIFs (as 1.0.2).

        The frames are the images that :meth:`plot` saved with
        ``save_plot=True, savename_append="__epoch__<k>"`` (PNG), found either
        as 1.0.2 names them, ``<log>__<screen>__epoch__<k>.png``, or where
        :meth:`plot` saves them by default,
        ``<log>/<savename>__<screen>__epoch__<k>.png`` (``<log>``: the log path
        without ``.json``). Frames are ordered by ``k`` as a number. Each screen
        (primary, and secondary if this plotter has one) becomes
        ``<log>__<screen>.gif``.

        Args:
            logpath: The log (with or without ``.json``).
            duration: Time each frame is shown, in milliseconds.
            loop: How often the GIF repeats (0: forever).

        Returns:
            The GIFs written.

        Raises:
            FileNotFoundError: If a screen has no frames.
            ValueError: If frames of several runs (savenames) match.
        """
        from PIL import Image

        stem = log_stem(logpath)
        screens = ["primary"] + (["secondary"] if self.secondary_screen else [])
        written = []
        for screen in screens:
            frames = _animation_frames(stem, screen)
            target = f"{stem}__{screen}.gif"
            images = [Image.open(frame) for frame in frames]
            try:
                images[0].save(target, format="GIF", save_all=True, loop=loop,
                               append_images=images[1:], duration=duration)  # fmt: skip
            finally:
                for image in images:
                    image.close()
            written.append(target)
        return written

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


def _animation_frames(stem: str, screen: str) -> list[str]:
    """The frames of one screen for :meth:`CockpitPlotter.build_animation`."""
    tail = f"__{screen}__epoch__*.png"
    groups: dict[str, list[str]] = {}
    for pattern in (
        glob.escape(stem) + tail,
        os.path.join(glob.escape(stem), "*" + tail),
    ):
        for path in glob.glob(pattern):
            groups.setdefault(path.rsplit(f"__{screen}__epoch__", 1)[0], []).append(
                path
            )
    if not groups:
        raise FileNotFoundError(
            f"No frames for the {screen} screen: no {stem}{tail} and no "
            f"{os.path.join(stem, '<savename>' + tail)}. Fix: during training call "
            f"plotter.plot(..., save_plot=True, savename_append=f'__epoch__{{k}}') "
            "with k growing, then build the animation from the same log path."
        )
    if len(groups) > 1:
        raise ValueError(
            f"Frames of {len(groups)} runs match for the {screen} screen: "
            f"{sorted(groups)}. Fix: keep one run's frames (one savename) there."
        )
    (frames,) = groups.values()

    def order(path: str) -> tuple[float, str]:
        number = re.match(r"-?\d+(\.\d+)?", path.rsplit("__epoch__", 1)[1])
        return (float(number.group()) if number else float("inf"), path)

    return sorted(frames, key=order)
