"""Cockpit where people already train: TensorBoard, Lightning, Hugging Face.

Each integration lives in its own module and imports its framework only when that
module is imported, so ``import cockpit`` never needs them:

* :mod:`cockpit.integrations.tensorboard`: :func:`export_tensorboard` writes a
  cockpit log as TensorBoard scalars and histograms (extra ``tensorboard``).
* :mod:`cockpit.integrations.lightning`: ``CockpitCallback`` for Lightning 2.x
  (extra ``lightning``); :mod:`cockpit.integrations.pytorch_lightning`: the same
  callback for the standalone ``pytorch_lightning`` package.
* :mod:`cockpit.integrations.transformers`: ``CockpitTrainer`` and
  ``CockpitTrainerMixin`` for the Hugging Face ``Trainer`` (extra ``transformers``).
"""
