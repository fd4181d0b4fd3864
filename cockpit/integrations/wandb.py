"""Cockpit's gauges in Weights & Biases: a bare loop's run, or a log written earlier.

::

    import wandb
    from cockpit.integrations.wandb import log_to

    run = wandb.init(project="my-project")
    cockpit = Cockpit(model.named_parameters(), quantities=configuration("economy"))
    log_to(cockpit, run)           # default: wandb.run
    ...                            # train as usual
    cockpit.close()                # the dashboard, the diagnosis: then run.finish()

``cockpit export LOG --wandb PROJECT`` (or :func:`export_wandb`) sends a log
written earlier as a new run. ``WANDB_MODE=offline`` works without a server
(``wandb sync`` uploads later).

What the run receives (names as the TensorBoard export's,
:mod:`cockpit.integrations.series`):

* every tracked step: the scalars (``cockpit/Loss``, one ``cockpit/GradNorm/<name>``
  per parameter tensor and the total ``cockpit/GradNorm``, ...) and the gradient
  histograms as W&B histograms (``cockpit/GradHist1d``, the marginals of
  ``GradHist2d``), against the x-axis ``cockpit/global_step`` (``define_metric``),
  so cockpit's rows never collide with the steps of your own ``run.log``; W&B groups
  every ``cockpit/...`` chart into one section;
* at ``cockpit.close()``: the dashboard as the image ``cockpit/dashboard`` and the
  HTML dashboard as ``cockpit/dashboard_html``, both with the cockpit log in the
  artifact ``cockpit-<run id>`` (type ``cockpit``); the per-tensor values of each
  quantity as one line chart (``cockpit/<key>/per_tensor``, one line per tensor);
  the diagnosis in the run's summary (``cockpit/diagnosis``: the worst severity,
  ``cockpit/diagnosis/<id>``: each finding's message) and, for each finding of
  severity ``error``, a W&B alert.

``import cockpit`` does not import wandb; this module imports it when used (extra
``wandb``).
"""

from __future__ import annotations

import os
from typing import Any

from cockpit.integrations.series import Histogram, Samples, Scalar
from cockpit.integrations.trackers import (
    TrackerLog,
    attach,
    export_source,
    missing_extra,
)

__all__ = ["WandbSink", "export_wandb", "log_to"]


def _wandb():
    try:
        import wandb
    except ImportError as error:
        raise missing_extra("wandb", "wandb", "Logging to W&B") from error
    return wandb


def media(item: Histogram | Samples):
    """A series item as a ``wandb.Histogram`` (the log's edges and counts)."""
    wandb = _wandb()
    if isinstance(item, Samples):
        return wandb.Histogram(item.values)
    return wandb.Histogram(np_histogram=(item.counts, item.edges))


class WandbSink:
    """Sends cockpit's values to a W&B run (see the module).

    Args:
        run: The ``wandb`` run (``wandb.init()``'s result).
        prefix: The names' first part (for the x-axis ``<prefix>/global_step``).
        step_key: Name of the x-axis logged with each row; ``None`` logs no x-axis
            of its own (e.g. ``"trainer/global_step"`` of Lightning's logger is
            passed instead with ``extra``).
        extra: More values logged with every row (``{name: step}`` is filled in
            for every key whose value is ``None``).
        owns: End the run (``run.finish()``) on :meth:`close`.
    """

    def __init__(
        self,
        run,
        prefix: str = "cockpit",
        step_key: str | None = "global_step",
        extra: dict[str, Any] | None = None,
        owns: bool = False,
    ):
        self.run = run
        self.prefix = prefix
        self.step_key = None
        if step_key is not None:
            self.step_key = "/".join(p for p in (prefix, step_key) if p)
            run.define_metric(self.step_key)
            run.define_metric(f"{prefix}/*" if prefix else "*",
                              step_metric=self.step_key)  # fmt: skip
        self.extra = dict(extra or {})
        self.owns = owns
        #: ``{key: {tensor name: {step: value}}}`` for the per-tensor line charts.
        self.per_tensor: dict[str, dict[str, dict[int, float]]] = {}

    def row(self, step: int, items) -> dict[str, Any]:
        """One ``run.log`` row of a step's items."""
        row: dict[str, Any] = {}
        for item in items:
            if isinstance(item, Scalar):
                row[item.tag] = item.value
                self._keep(step, item)
            elif not isinstance(item, Histogram) or item.counts.any():
                row[item.tag] = media(item)
        if self.step_key is not None:
            row[self.step_key] = step
        for key, value in self.extra.items():
            row[key] = step if value is None else value
        return row

    def _keep(self, step: int, item: Scalar) -> None:
        parts = item.tag.split("/")
        base = 1 if self.prefix else 0
        if len(parts) == base + 2:  # <prefix>/<key>/<name>
            key, name = parts[base], parts[base + 1]
            self.per_tensor.setdefault(key, {}).setdefault(name, {})[step] = item.value

    def send(self, step: int, items) -> None:
        """Log one row."""
        self.run.log(self.row(step, items))

    def finish(self, outputs) -> None:
        """The dashboard, the HTML page, the log artifact, the diagnosis."""
        wandb = _wandb()
        tag = f"{self.prefix}/" if self.prefix else ""
        rows: dict[str, Any] = {}
        if outputs.dashboard is not None:
            rows[f"{tag}dashboard"] = wandb.Image(outputs.dashboard)
        if outputs.html is not None:
            with open(outputs.html, encoding="utf-8") as page:
                rows[f"{tag}dashboard_html"] = wandb.Html(page.read(), inject=False)
        for key, tensors in self.per_tensor.items():
            if len(tensors) < 2:
                continue
            steps = sorted({s for series in tensors.values() for s in series})
            names = sorted(tensors)
            ys = [[tensors[n].get(s, float("nan")) for s in steps] for n in names]
            rows[f"{tag}{key}/per_tensor"] = wandb.plot.line_series(
                xs=steps, ys=ys, keys=names, title=f"{key} per tensor", xname="step"
            )
        if rows:
            self.run.log(rows)
        files = [p for p in (outputs.dashboard, outputs.html, outputs.log) if p]
        if files:
            artifact = wandb.Artifact(f"cockpit-{self.run.id}", type="cockpit")
            for path in files:
                artifact.add_file(path, name=os.path.basename(path))
            self.run.log_artifact(artifact)
        self.summary(outputs.findings)

    def summary(self, findings) -> None:
        """The diagnosis in the run's summary; an alert per ``error`` finding."""
        from cockpit.diagnosis import worst

        wandb = _wandb()
        tag = "/".join(p for p in (self.prefix, "diagnosis") if p)
        shown = [f for f in findings if f.severity != "info"]
        self.run.summary[tag] = worst(shown) or "ok"
        for finding in findings:
            self.run.summary[f"{tag}/{finding.id}"] = (
                f"{finding.severity}, steps {finding.steps[0]}-{finding.steps[1]}: "
                f"{finding.message}"
            )
            if finding.severity == "error":
                self.run.alert(
                    title=f"cockpit: {finding.id}",
                    text=f"{finding.message} Advice: {finding.advice}",
                    level=wandb.AlertLevel.ERROR,
                )

    def close(self) -> None:
        """End the run if this sink started it."""
        if self.owns:
            self.run.finish()


def log_to(
    cockpit, run=None, *, prefix: str = "cockpit", background: bool = False
) -> TrackerLog:
    """Show ``cockpit``'s values in a W&B run, step by step (see the module).

    Args:
        cockpit: The :class:`~cockpit.Cockpit`.
        run: The run (default: ``wandb.run``, the run of ``wandb.init()``).
        prefix: First part of every name.
        background: Log from a worker thread (``run.log`` is Python work, about
            a millisecond per step, that a thread would only make compete for the
            GIL: off by default; ``benchmarks/tracker_overhead.py``).

    Returns:
        The subscriber; ``cockpit.close()`` closes it (the outputs), not the run.

    Raises:
        ImportError: If wandb is not installed (one line, the install command).
        ValueError: If there is no run.
    """
    wandb = _wandb()
    run = run if run is not None else wandb.run
    if run is None:
        raise ValueError(
            "log_to found no W&B run. Fix: run = wandb.init(project=...) first, "
            "then log_to(cockpit, run)."
        )
    return attach(cockpit, WandbSink(run, prefix), prefix, background=background)


def export_wandb(
    log,
    project: str,
    *,
    name: str | None = None,
    param_names=None,
    prefix: str = "cockpit",
    **init: Any,
) -> TrackerLog:
    """Send a log written earlier to a new W&B run of ``project`` (then finished).

    Args:
        log: A log file (read with :func:`~cockpit.log.files.open_log`) or a
            :class:`~cockpit.history.History`.
        project: The W&B project.
        name: The run's name (default: the log file's name).
        param_names: Names of the parameter tensors (default ``param_<i>``).
        prefix: First part of every name.
        **init: More arguments of ``wandb.init`` (``dir``, ``mode``, ...).

    Returns:
        What was sent (``.steps``, ``.series.skipped``, ``.outputs``, and the run
        as ``.sink.run``).
    """
    history, name = export_source(log, name)
    wandb = _wandb()
    run = wandb.init(project=project, name=name, reinit="create_new", **init)
    sink = WandbSink(run, prefix, owns=True)
    return TrackerLog(sink, param_names, prefix, title=name).replay(history)
