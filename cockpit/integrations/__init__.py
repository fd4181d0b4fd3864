"""Cockpit where people train: TensorBoard, W&B, MLflow, Lightning, Hugging Face.

Each integration lives in its own module and imports its framework only when that
module is imported, so ``import cockpit`` never needs them:

* :mod:`cockpit.integrations.tensorboard`: :func:`export_tensorboard` writes a
  cockpit log as TensorBoard scalars and histograms (extra ``tensorboard``).
* :mod:`cockpit.integrations.wandb`, :mod:`cockpit.integrations.mlflow`: ``log_to``
  shows a bare loop's values in a W&B / MLflow run, ``export_wandb`` /
  ``export_mlflow`` a log written earlier (extras ``wandb``, ``mlflow``); the
  values are named once for every tracker by :mod:`cockpit.integrations.series`
  and sent by the recorder subscriber of :mod:`cockpit.integrations.trackers`.
* :mod:`cockpit.integrations.loggers`: every Lightning logger and Hugging Face
  ``report_to`` callback gets the values (used by the two integrations below).
* :mod:`cockpit.integrations.lightning`: ``CockpitCallback`` for Lightning 2.x
  (extra ``lightning``); :mod:`cockpit.integrations.pytorch_lightning`: the same
  callback for the standalone ``pytorch_lightning`` package.
* :mod:`cockpit.integrations.transformers`: ``CockpitTrainer`` and
  ``CockpitTrainerMixin`` for the Hugging Face ``Trainer`` (extra ``transformers``).
"""
