"""Cockpit's values in an experiment tracker: the subscriber every tracker shares.

A :class:`TrackerLog` subscribes to a cockpit's recorder (``on_record`` and
``close``, :mod:`cockpit.step.recorder`): each tracked step's values are named by
:class:`~cockpit.integrations.series.Series` (the names of the TensorBoard export)
and handed to a *sink*, the few lines that speak one tracker's API:

* ``send(step, items)``: one step's :class:`~cockpit.integrations.series.Scalar`,
  :class:`~cockpit.integrations.series.Histogram` and
  :class:`~cockpit.integrations.series.Samples` items (called in step order);
* ``finish(outputs)`` (optional): the run's :class:`Outputs` once it is over: the
  dashboard PNG, the HTML dashboard, the cockpit log and the diagnosis findings;
* ``close()`` (optional): flush; end what the sink opened.

The sinks: :mod:`cockpit.integrations.wandb`, :mod:`cockpit.integrations.mlflow`
(bare loops and logs written earlier) and :mod:`cockpit.integrations.loggers`
(Lightning's loggers, Hugging Face's ``report_to`` callbacks).

Each step's values are sent once, when the next step's arrive (a step's values are
recorded in parts: the quantities, ``Cockpit.log``'s metrics, Alpha with the next
step). With ``background=True`` the sink runs in a worker thread (for sinks that
wait on the network, such as an MLflow server's); a sink that computes in Python
runs best in the loop's thread, where it does not compete for the GIL
(``benchmarks/tracker_overhead.py``).
"""

from __future__ import annotations

import os
import queue
import tempfile
import threading
import warnings
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from cockpit.history import History
from cockpit.integrations.series import Series

#: The file names of the run's outputs (in the tracker: under ``<prefix>/``).
DASHBOARD_PNG = "dashboard.png"
DASHBOARD_HTML = "dashboard.html"
LOG_JSON = "cockpit_log.json"


@dataclass
class Outputs:
    """What a finished run hands its tracker.

    Attributes:
        folder: Where the files are (a temporary folder, removed afterwards).
        dashboard: The dashboard PNG (``None`` if it could not be drawn).
        html: The interactive HTML dashboard (``None`` likewise).
        log: The cockpit log as JSON (``cockpit plot`` reads it; it holds the
            histograms, which some trackers cannot show).
        findings: The diagnosis of the run (:func:`cockpit.diagnosis.diagnose`).
        problems: Why an output is missing (one line each).
        names: The parameter tensors' names (for sinks that name values again).
    """

    folder: str
    dashboard: str | None = None
    html: str | None = None
    log: str | None = None
    findings: list = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    names: list = field(default_factory=list)


def make_outputs(history: History, folder: str, title: str | None = None) -> Outputs:
    """Draw the dashboard, write the log and diagnose the run into ``folder``.

    Nothing here stops a run: an output that fails is left out and its reason
    noted in :attr:`Outputs.problems`.
    """
    from cockpit.diagnosis import diagnose

    outputs = Outputs(folder)
    if not history.steps:
        outputs.problems.append("the run tracked no step: no dashboard, no log")
        return outputs
    outputs.log = history.write_json(os.path.join(folder, LOG_JSON))
    try:
        outputs.findings = diagnose(history)
    except Exception as error:  # a log with values of an odd shape
        outputs.problems.append(f"diagnosis failed: {type(error).__name__}: {error}")
    try:
        import matplotlib

        if matplotlib.get_backend().lower() not in ("agg", "pdf", "svg", "ps"):
            matplotlib.use("Agg", force=False)
        from cockpit.plotting import CockpitPlotter

        plotter = CockpitPlotter()
        plotter.plot(history, show_plot=False, plot_title=title)
        (outputs.dashboard,) = plotter.save(os.path.join(folder, DASHBOARD_PNG))
        outputs.html = plotter.write_html(os.path.join(folder, DASHBOARD_HTML))
        import matplotlib.pyplot as plt

        for figure in plotter.figures:
            plt.close(figure)
    except Exception as error:
        outputs.problems.append(f"dashboard failed: {type(error).__name__}: {error}")
    return outputs


def findings_text(findings: Sequence) -> str:
    """The findings as Markdown lines (``- **error** id, steps a-b: message``)."""
    if not findings:
        return "No findings."
    lines = []
    for f in findings:
        lines.append(
            f"- **{f.severity}** `{f.id}`, steps {f.steps[0]}-{f.steps[1]}: "
            f"{f.message} {f.advice}".rstrip()
        )
    return "\n".join(lines)


class _Worker:
    """Runs calls in one daemon thread, in order; the first error is kept."""

    _STOP = object()

    def __init__(self, name: str):
        self._queue: queue.Queue = queue.Queue()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is self._STOP:
                return
            if self.error is None:
                try:
                    job[0](*job[1:])
                except BaseException as error:  # raised in close()
                    self.error = error

    def put(self, function, *args) -> None:
        """Call ``function(*args)`` in the thread (after the calls before it)."""
        self._queue.put((function, *args))

    def close(self) -> None:
        """Wait for every call; raise the first error."""
        self._queue.put(self._STOP)
        self._thread.join()
        if self.error is not None:
            raise self.error


class TrackerLog:
    """A recorder subscriber that shows a cockpit's values in a tracker.

    Args:
        sink: What speaks the tracker's API (see the module).
        names: The parameter tensors' names, in the cockpit's order.
        prefix: First part of every name (default ``"cockpit"``).
        history: The run's :class:`~cockpit.history.History`; when given, the run's
            :class:`Outputs` are made at :meth:`close` and handed to the sink's
            ``finish``.
        title: The dashboard's title.
        background: Run the sink in a worker thread.

    Attributes:
        series: The names (:class:`~cockpit.integrations.series.Series`); its
            ``skipped`` lists keys without a form.
        outputs: The :class:`Outputs` handed over at :meth:`close`.
    """

    def __init__(
        self,
        sink,
        names: Sequence[str | None] | None = None,
        prefix: str = "cockpit",
        history: History | None = None,
        title: str | None = None,
        background: bool = False,
    ):
        self.sink = sink
        self.series = Series(names, prefix)
        self.history = history
        self.title = title
        self.outputs: Outputs | None = None
        self.steps = 0
        self._pending_step: int | None = None
        self._pending: dict[str, Any] = {}
        self._closed = False
        self._worker = _Worker(f"cockpit-{type(sink).__name__}") if background else None

    def on_record(self, global_step: int, values: Mapping[str, Any]) -> None:
        """Keep the step's values; send the step before once a later one arrives.

        A step's values come in parts (the quantities at the step's end, the
        metrics of ``Cockpit.log``, Alpha with the next step): they are sent
        together, one ``send`` per step.
        """
        step = int(global_step)
        if self._pending_step is not None and step != self._pending_step:
            self._send_pending()
        self._pending_step = step
        self._pending.update(values)

    def _send_pending(self) -> None:
        step, values = self._pending_step, self._pending
        self._pending_step, self._pending = None, {}
        items = list(self.series.items(values))
        if step is None or not items:
            return
        self.steps += 1
        self._call(self.sink.send, step, items)

    def _call(self, function, *args) -> None:
        if self._worker is None:
            function(*args)
        else:
            self._worker.put(function, *args)

    def close(self) -> None:
        """Hand over the run's outputs (with a ``history``), then close the sink."""
        if self._closed:
            return
        self._closed = True
        try:
            self._send_pending()
            finish = getattr(self.sink, "finish", None)
            wanted = getattr(self.sink, "wants_outputs", True)
            if self.history is not None and finish is not None and wanted:
                with tempfile.TemporaryDirectory(prefix="cockpit-") as folder:
                    self.outputs = make_outputs(self.history, folder, self.title)
                    self.outputs.names = list(self.series.names)
                    self._call(_finish_safely, finish, self.outputs)
                    if self._worker is not None:  # the files go before the folder
                        worker, self._worker = self._worker, None
                        worker.close()
        finally:
            if self._worker is not None:
                worker, self._worker = self._worker, None
                worker.close()
            close = getattr(self.sink, "close", None)
            if close is not None:
                close()

    def replay(self, history: History) -> TrackerLog:
        """Send a whole history, step by step (a log written earlier); then close."""
        self.history = history if self.history is None else self.history
        for step, values in history.items():
            self.on_record(step, values)
        self.close()
        return self


def _finish_safely(finish, outputs: Outputs) -> None:
    """``finish(outputs)``; a failure is a warning (every step was sent already)."""
    try:
        finish(outputs)
    except Exception as error:
        from cockpit.errors import CockpitWarning

        warnings.warn(
            f"cockpit could not hand the dashboard and diagnosis to the tracker "
            f"({type(error).__name__}: {error}); every step's values were sent.",
            CockpitWarning,
            stacklevel=2,
        )


class Fanout:
    """One sink that hands everything to several (e.g. every logger of a trainer)."""

    def __init__(self, sinks: Sequence):
        self.sinks = list(sinks)

    @property
    def wants_outputs(self) -> bool:
        """Whether a sink takes the run's outputs (else none are drawn)."""
        return any(hasattr(sink, "finish") for sink in self.sinks)

    def send(self, step: int, items) -> None:
        """Each sink's ``send``."""
        for sink in self.sinks:
            sink.send(step, items)

    def finish(self, outputs: Outputs) -> None:
        """Each sink's ``finish`` (where it has one; one failing spares the rest)."""
        for sink in self.sinks:
            finish = getattr(sink, "finish", None)
            if finish is not None:
                _finish_safely(finish, outputs)

    def close(self) -> None:
        """Each sink's ``close`` (where it has one)."""
        for sink in self.sinks:
            close = getattr(sink, "close", None)
            if close is not None:
                close()


def export_source(log, name: str | None) -> tuple[History, str | None]:
    """What an export of a log sends: its history, and the run's name.

    Args:
        log: A log file (read with :func:`~cockpit.log.files.open_log`) or a
            :class:`~cockpit.history.History`.
        name: The run's name, or ``None`` for the log file's name (a history
            has none).

    Returns:
        ``(history, name)``.
    """
    from cockpit.log.files import open_log

    if isinstance(log, History):
        return log, name
    if name is None:
        name = os.path.splitext(os.path.basename(os.fspath(log)))[0]
    return open_log(log), name


def attach(cockpit, sink, prefix: str = "cockpit", **options: Any) -> TrackerLog:
    """Subscribe a :class:`TrackerLog` of ``sink`` to ``cockpit``'s recorder.

    The cockpit's parameter names name the per-tensor values; its history makes
    the outputs handed over at ``cockpit.close()``. On data-parallel processes
    other than the log's writer nothing is subscribed (their values are rank 0's).

    Returns:
        The subscriber (``close()`` it yourself if you never close the cockpit).
    """
    log = TrackerLog(
        sink, list(cockpit.param_names or []) or None, prefix,
        history=cockpit.history, **options,
    )  # fmt: skip
    if getattr(cockpit, "is_writer", True):
        cockpit.recorder.subscribe(log)
    return log


def missing_extra(package: str, extra: str, purpose: str) -> ImportError:
    """The one-line error for a tracker package that is not installed."""
    return ImportError(
        f"{purpose} needs the {package} package. Fix: pip install {package} (or "
        f'cockpit\'s extra: pip install -c constraints.txt -e ".[{extra}]").'
    )
