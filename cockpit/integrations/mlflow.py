"""Cockpit's gauges in MLflow: a bare loop's run, or a log written earlier.

::

    import mlflow
    from cockpit.integrations.mlflow import log_to

    with mlflow.start_run():
        cockpit = Cockpit(model.named_parameters(), quantities=configuration("economy"))
        log_to(cockpit)                 # default: the active run
        ...                             # train as usual
        cockpit.close()                 # the dashboard and the diagnosis, then

``cockpit export LOG --mlflow URI`` (or :func:`export_mlflow`) sends a log written
earlier as a new run of the experiment ``cockpit`` (``--experiment`` to choose).

What the run receives (names as the TensorBoard export's,
:mod:`cockpit.integrations.series`):

* metrics at each tracked step (``step`` = cockpit's global step): ``cockpit/Loss``,
  one ``cockpit/GradNorm/<name>`` per parameter tensor and the total
  ``cockpit/GradNorm``, ... The MLflow UI groups charts by the names' first part,
  so cockpit's metrics form their own section. Metrics are sent in batches
  (``log_batch``, at most every ``interval`` seconds and at the end) from a worker
  thread, so the training loop does not wait for the server;
* at ``cockpit.close()``: the artifacts ``cockpit/dashboard.png``,
  ``cockpit/dashboard.html`` and ``cockpit/cockpit_log.json`` (the log: MLflow has
  no histogram type, so the gradient histograms are drawn in the dashboards and
  kept in the log, which ``cockpit plot`` reads), the diagnosis as
  ``cockpit/diagnosis.json`` and as tags (``cockpit.diagnosis``: the worst
  severity or ``ok``; ``cockpit.diagnosis.<id>``: each finding's message).

``import cockpit`` does not import mlflow; this module imports it when used (extra
``mlflow``).
"""

from __future__ import annotations

import re
import threading
import time

from cockpit.integrations.series import Scalar
from cockpit.integrations.trackers import (
    TrackerLog,
    attach,
    export_source,
    missing_extra,
)

__all__ = ["MlflowSink", "export_mlflow", "log_to", "metric_name"]

#: Metrics per ``log_batch`` request (MLflow's limit).
BATCH = 1000


def _mlflow():
    try:
        import mlflow
    except ImportError as error:
        raise missing_extra("mlflow", "mlflow", "Logging to MLflow") from error
    return mlflow


def metric_name(tag: str) -> str:
    """``tag`` with the characters MLflow refuses in metric names replaced by ``_``."""
    return re.sub(r"[^0-9A-Za-z_\-. /:]", "_", tag)


class MlflowSink:
    """Sends cockpit's values to one MLflow run (see the module).

    Args:
        client: An ``mlflow.MlflowClient``.
        run_id: The run's id.
        interval: Longest wait in seconds before buffered metrics are sent.
        owns: Mark the run finished (``set_terminated``) on :meth:`close`.
        artifact_path: Folder of the artifacts in the run.
        tag_prefix: First part of the tags.
    """

    def __init__(
        self,
        client,
        run_id: str,
        interval: float = 2.0,
        owns: bool = False,
        artifact_path: str = "cockpit",
        tag_prefix: str = "cockpit",
    ):
        self.client = client
        self.run_id = run_id
        self.interval = interval
        self.owns = owns
        self.artifact_path = artifact_path
        self.tag_prefix = tag_prefix
        self._buffer: list = []
        self._sent_at = time.monotonic()
        self._lock = threading.Lock()

    def send(self, step: int, items) -> None:
        """Buffer the step's scalars; send them when ``interval`` has passed."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [
            Metric(metric_name(i.tag), i.value, now, step)
            for i in items
            if isinstance(i, Scalar)
        ]
        with self._lock:
            self._buffer.extend(metrics)
        if time.monotonic() - self._sent_at >= self.interval:
            self.flush()

    def flush(self) -> None:
        """Send every buffered metric (``log_batch``, :data:`BATCH` at a time)."""
        with self._lock:
            metrics, self._buffer = self._buffer, []
        self._sent_at = time.monotonic()
        for start in range(0, len(metrics), BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[start : start + BATCH])

    def finish(self, outputs) -> None:
        """The dashboards and the log as artifacts, the diagnosis as tags."""
        from cockpit.diagnosis import worst

        self.flush()
        for path in (outputs.dashboard, outputs.html, outputs.log):
            if path is not None:
                self.client.log_artifact(self.run_id, path, self.artifact_path)
        findings = outputs.findings
        self.client.log_dict(
            self.run_id,
            {"findings": [f.to_dict() for f in findings],
             "problems": list(outputs.problems)},
            f"{self.artifact_path}/diagnosis.json",
        )  # fmt: skip
        tag = ".".join(p for p in (self.tag_prefix, "diagnosis") if p)
        shown = [f for f in findings if f.severity != "info"]
        self.client.set_tag(self.run_id, tag, worst(shown) or "ok")
        for f in findings:
            text = f"{f.severity}, steps {f.steps[0]}-{f.steps[1]}: {f.message}"
            self.client.set_tag(self.run_id, f"{tag}.{f.id}", text[:5000])

    def close(self) -> None:
        """Send what is buffered; finish the run if this sink started it."""
        self.flush()
        if self.owns:
            self.client.set_terminated(self.run_id)


def log_to(
    cockpit,
    run_id: str | None = None,
    *,
    tracking_uri: str | None = None,
    prefix: str = "cockpit",
    interval: float = 2.0,
    background: bool = True,
) -> TrackerLog:
    """Show ``cockpit``'s values in an MLflow run (see the module).

    Args:
        cockpit: The :class:`~cockpit.Cockpit`.
        run_id: The run (default: the active run, ``mlflow.start_run()``'s).
        tracking_uri: The tracking server or store (default: MLflow's, e.g.
            ``MLFLOW_TRACKING_URI``).
        prefix: First part of every name.
        interval: Longest wait in seconds before buffered metrics are sent.
        background: Send from a worker thread.

    Returns:
        The subscriber; ``cockpit.close()`` closes it (the outputs), not the run.

    Raises:
        ImportError: If mlflow is not installed (one line, the install command).
        ValueError: If there is no run.
    """
    mlflow = _mlflow()
    if run_id is None:
        active = mlflow.active_run()
        if active is None:
            raise ValueError(
                "log_to found no active MLflow run. Fix: with mlflow.start_run(): "
                "... log_to(cockpit), or log_to(cockpit, run_id)."
            )
        run_id = active.info.run_id
    client = mlflow.MlflowClient(tracking_uri)
    sink = MlflowSink(client, run_id, interval, tag_prefix=prefix,
                      artifact_path=prefix or "cockpit")  # fmt: skip
    return attach(cockpit, sink, prefix, background=background)


def export_mlflow(
    log,
    tracking_uri: str | None = None,
    *,
    experiment: str = "cockpit",
    run_name: str | None = None,
    param_names=None,
    prefix: str = "cockpit",
) -> TrackerLog:
    """Send a log written earlier to a new MLflow run (then finished).

    Args:
        log: A log file (read with :func:`~cockpit.log.files.open_log`) or a
            :class:`~cockpit.history.History`.
        tracking_uri: The tracking server or store (default: MLflow's).
        experiment: The experiment's name (created if missing).
        run_name: The run's name (default: the log file's name).
        param_names: Names of the parameter tensors (default ``param_<i>``).
        prefix: First part of every name.

    Returns:
        What was sent (``.steps``, ``.series.skipped``, ``.outputs``, the run id
        as ``.sink.run_id``).
    """
    history, run_name = export_source(log, run_name)
    client = _mlflow().MlflowClient(tracking_uri)
    found = client.get_experiment_by_name(experiment)
    experiment_id = (
        found.experiment_id
        if found is not None
        else client.create_experiment(experiment)
    )
    run = client.create_run(experiment_id, run_name=run_name)
    sink = MlflowSink(client, run.info.run_id, interval=float("inf"), owns=True,
                      tag_prefix=prefix, artifact_path=prefix or "cockpit")  # fmt: skip
    return TrackerLog(sink, param_names, prefix, title=run_name).replay(history)
