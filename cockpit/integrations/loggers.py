"""Cockpit's values through the frameworks' own logging (Lightning, Hugging Face).

The Lightning callback (:mod:`cockpit.integrations.lightning`) hands every tracked
step to *every* logger of the trainer, the Hugging Face mixin
(:mod:`cockpit.integrations.transformers`) to every ``report_to`` callback, with
the names of the TensorBoard export (:mod:`cockpit.integrations.series`) at
cockpit's step (the trainer's global step of the tracked batch):

* scalars through the framework's API: ``logger.log_metrics(metrics, step)``
  (Lightning), ``callback.on_log(...)`` of every ``report_to`` callback (Hugging
  Face, which names them ``train/cockpit/...``);
* what a logger shows besides scalars, where it has it: histograms (TensorBoard,
  W&B), the dashboard as an image (TensorBoard, W&B), the HTML dashboard, the
  log and the diagnosis (W&B: media, artifact, summary and alerts; MLflow:
  artifacts and tags; TensorBoard: the findings as text).

Which logger gets what is a table of sinks by class name (:data:`SINKS`); a
logger it does not name gets the scalars. Add a tracker with a module holding
its sink and one entry here, or at run time with :func:`register`.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any, Callable

from cockpit.integrations.series import Histogram, Samples, Scalar

#: Sinks by the class name of a Lightning logger or a Hugging Face callback, as
#: ``"module:function"`` (called with the logger/callback, returns a sink).
SINKS: dict[str, str] = {
    "TensorBoardLogger": "cockpit.integrations.loggers:TensorBoardLoggerSink",
    "WandbLogger": "cockpit.integrations.loggers:WandbLoggerSink",
    "MLFlowLogger": "cockpit.integrations.loggers:MLFlowLoggerSink",
    "TensorBoardCallback": "cockpit.integrations.loggers:TensorBoardCallbackSink",
    "WandbCallback": "cockpit.integrations.loggers:WandbCallbackSink",
    "MLflowCallback": "cockpit.integrations.loggers:MLflowCallbackSink",
}


def register(class_name: str, factory: Callable[[Any], Any] | str) -> None:
    """Use ``factory(logger)`` as the sink of loggers of class ``class_name``."""
    SINKS[class_name] = factory


def sink_for(logger) -> Any:
    """The sink of a Lightning logger or Hugging Face callback (by class name)."""
    for cls in type(logger).__mro__:
        factory = SINKS.get(cls.__name__)
        if factory is None:
            continue
        if isinstance(factory, str):
            module, name = factory.split(":")
            factory = getattr(importlib.import_module(module), name)
        return factory(logger)
    return LoggerSink(logger)


def _scalars(items) -> dict[str, float]:
    return {i.tag: i.value for i in items if isinstance(i, Scalar)}


class LoggerSink:
    """Any Lightning logger: the scalars through ``log_metrics(metrics, step)``."""

    def __init__(self, logger):
        self.logger = logger

    def send(self, step: int, items) -> None:
        """``log_metrics`` of the scalars; the rest through :meth:`extra`."""
        metrics = _scalars(items)
        if metrics:
            self.logger.log_metrics(metrics, step=step)
        others = [i for i in items if not isinstance(i, Scalar)]
        if others:
            self.extra(step, others)

    def extra(self, step: int, items) -> None:
        """Histograms and raw values (a plain logger has no place for them)."""


class TensorBoardLoggerSink(LoggerSink):
    """Lightning's ``TensorBoardLogger``: histograms, the dashboard, the findings."""

    def extra(self, step: int, items) -> None:
        """Histograms through the logger's ``SummaryWriter``."""
        from cockpit.integrations.tensorboard import write_item

        for item in items:
            write_item(self.logger.experiment, item, step)

    def finish(self, outputs) -> None:
        """The dashboard as an image and the findings as text, at the last step."""
        tensorboard_outputs(self.logger.experiment, outputs)


def tensorboard_outputs(writer, outputs, step: int | None = None) -> None:
    """The dashboard image and the findings' text in a ``SummaryWriter``."""
    from cockpit.integrations.trackers import findings_text

    if outputs.dashboard is not None:
        import matplotlib.image

        image = matplotlib.image.imread(outputs.dashboard)[..., :3]
        writer.add_image("cockpit/dashboard", image, step, dataformats="HWC")
    writer.add_text("cockpit/diagnosis", findings_text(outputs.findings), step)
    writer.flush()


class WandbLoggerSink(LoggerSink):
    """Lightning's ``WandbLogger``: histograms, media, artifact, summary, alerts.

    Rows carry ``trainer/global_step`` as the logger's own do (its x-axis).
    """

    def __init__(self, logger):
        super().__init__(logger)
        from cockpit.integrations.wandb import WandbSink

        self.wandb = WandbSink(logger.experiment, step_key=None,
                               extra={"trainer/global_step": None})  # fmt: skip

    def send(self, step: int, items) -> None:
        """Scalars through ``log_metrics``; histograms with the run's ``log``."""
        super().send(step, items)
        for item in items:
            if isinstance(item, Scalar):
                self.wandb._keep(step, item)

    def extra(self, step: int, items) -> None:
        """The histograms as W&B histograms."""
        row = self.wandb.row(step, items)
        if len(row) > 1:
            self.logger.experiment.log(row)

    def finish(self, outputs) -> None:
        """Media, the artifact, the diagnosis (:meth:`WandbSink.finish`)."""
        self.wandb.finish(outputs)


class MLFlowLoggerSink(LoggerSink):
    """Lightning's ``MLFlowLogger``: batched metrics, artifacts and tags.

    ``MLFlowLogger.log_metrics`` sends one request per call; the metrics go in
    batches to the logger's own client and run instead
    (:class:`~cockpit.integrations.mlflow.MlflowSink`).
    """

    def __init__(self, logger):
        super().__init__(logger)
        from cockpit.integrations.mlflow import MlflowSink

        self.mlflow = MlflowSink(logger.experiment, logger.run_id)

    def send(self, step: int, items) -> None:
        """Buffer the scalars (sent with ``log_batch``)."""
        self.mlflow.send(step, items)

    def finish(self, outputs) -> None:
        """Artifacts and tags (:meth:`MlflowSink.finish`)."""
        self.mlflow.finish(outputs)

    def close(self) -> None:
        """Send what is buffered."""
        self.mlflow.close()


# --- Hugging Face: the callbacks of report_to --------------------------------------
#: Hugging Face callbacks that print, not track: ``on_log`` would flood the console.
CONSOLE_CALLBACKS = ("ProgressCallback", "PrinterCallback", "NotebookProgressCallback")


class TrainerLog:
    """The scalars to every tracking callback of a Hugging Face ``Trainer``.

    Calls ``on_log`` of each callback of ``trainer.callback_handler`` (as
    ``Trainer.log`` does) except the console's (:data:`CONSOLE_CALLBACKS`) and
    cockpit's own, with ``state.global_step`` set to the cockpit's step for the
    call; not through ``Trainer.log`` itself, which would print every value and keep
    it in ``state.log_history`` (saved in every checkpoint). At the end each
    callback's sink (:data:`SINKS`) gets the run's outputs.
    """

    def __init__(self, trainer):
        self.trainer = trainer

    def callbacks(self) -> list:
        """The callbacks that receive the values."""
        return [
            c
            for c in self.trainer.callback_handler.callbacks
            if type(c).__name__ not in CONSOLE_CALLBACKS
            and not type(c).__module__.startswith("cockpit.")
        ]

    def send(self, step: int, items) -> None:
        """``on_log`` with the scalars, at ``step``."""
        logs = _scalars(items)
        if not logs:
            return
        trainer, handler = self.trainer, self.trainer.callback_handler
        state, saved = trainer.state, trainer.state.global_step
        everyone = handler.callbacks
        state.global_step = step
        handler.callbacks = self.callbacks()
        try:
            handler.call_event("on_log", trainer.args, state, trainer.control,
                               logs=logs)  # fmt: skip
        finally:
            handler.callbacks = everyone
            state.global_step = saved

    def finish(self, outputs) -> None:
        """Each callback's sink gets the outputs (and the histograms)."""
        for callback in self.callbacks():
            name = next((c.__name__ for c in type(callback).__mro__
                         if c.__name__ in SINKS), None)  # fmt: skip
            if name is None:
                continue
            try:
                sink = sink_for(callback)
                if sink is not None:
                    sink.finish(outputs)
            except Exception as error:  # a tracker's failure must not stop train()
                from cockpit.errors import CockpitWarning

                warnings.warn(
                    f"cockpit could not hand the dashboard and diagnosis to "
                    f"{type(callback).__name__}: {type(error).__name__}: {error}. "
                    "The values of every step were sent; the log file has all.",
                    CockpitWarning,
                    stacklevel=2,
                )


class TensorBoardCallbackSink:
    """``report_to=["tensorboard"]``: histograms, the dashboard and the findings."""

    def __init__(self, callback):
        self.callback = callback

    def finish(self, outputs) -> None:
        """Write the histograms of every step, then the dashboard and findings."""
        writer = getattr(self.callback, "tb_writer", None)
        if writer is None or outputs.log is None:
            return
        from cockpit.history import History
        from cockpit.integrations.series import Series
        from cockpit.integrations.tensorboard import write_item

        history = History.from_json(outputs.log)
        series = Series(getattr(outputs, "names", None))
        for step, values in history.items():
            for item in series.items(values):
                if isinstance(item, (Histogram, Samples)):
                    write_item(writer, item, step)
        tensorboard_outputs(writer, outputs, history.steps[-1])


class WandbCallbackSink:
    """``report_to=["wandb"]``: histograms, media, artifact, summary, alerts."""

    def __init__(self, callback):
        self.callback = callback

    def finish(self, outputs) -> None:
        """Through the callback's run, against its ``train/global_step`` axis."""
        run = getattr(getattr(self.callback, "_wandb", None), "run", None)
        if run is None or outputs.log is None:
            return
        from cockpit.history import History
        from cockpit.integrations.series import Series
        from cockpit.integrations.wandb import WandbSink

        sink = WandbSink(run, step_key=None, extra={"train/global_step": None})
        history = History.from_json(outputs.log)
        series = Series(getattr(outputs, "names", None))
        for step, values in history.items():
            items = list(series.items(values))
            for item in items:
                if isinstance(item, Scalar):
                    sink._keep(step, item)
            row = sink.row(step, [i for i in items if not isinstance(i, Scalar)])
            if len(row) > 1:
                run.log(row)
        sink.finish(outputs)


class MLflowCallbackSink:
    """``report_to=["mlflow"]``: artifacts and tags in the callback's active run."""

    def __init__(self, callback):
        self.callback = callback

    def finish(self, outputs) -> None:
        """Artifacts and tags (:meth:`MlflowSink.finish`)."""
        mlflow = getattr(self.callback, "_ml_flow", None)
        active = mlflow.active_run() if mlflow is not None else None
        if active is None:
            return
        from cockpit.integrations.mlflow import MlflowSink

        MlflowSink(mlflow.MlflowClient(), active.info.run_id).finish(outputs)
