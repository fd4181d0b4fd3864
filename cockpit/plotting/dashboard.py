"""The dashboard: lays the gauges out on one (or two) figures, live or from a log."""

from __future__ import annotations

import os
from typing import Any

import matplotlib
from matplotlib.axes import Axes
from matplotlib.figure import Figure, SubFigure

from cockpit.history import History
from cockpit.plotting.data import DashboardData
from cockpit.plotting.runs import (
    Run,
    is_several,
)
from cockpit.plotting.screens import Screens, _layer_grid  # noqa: F401 - _layer_grid: tests
from cockpit.plotting.sources import log_stem, read_runs
from cockpit.plotting.style import (
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


class CockpitPlotter(Screens):
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
        runs, titles, folders, configured = read_runs(
            source, labels, self.runs, stream=stream, discard=discard
        )
        several = is_several(source)
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
        from cockpit.plotting.animation import write_gifs

        screens = ["primary"] + (["secondary"] if self.secondary_screen else [])
        return write_gifs(log_stem(logpath), screens, duration, loop)
