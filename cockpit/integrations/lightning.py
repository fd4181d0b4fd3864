"""Cockpit as a Lightning 2.x callback: ``Trainer(callbacks=[CockpitCallback()])``.

::

    from lightning import Trainer
    from cockpit.integrations.lightning import CockpitCallback
    from cockpit.utils.configuration import configuration

    trainer = Trainer(callbacks=[CockpitCallback(quantities=configuration("economy"))])
    trainer.fit(model, loader)   # log: <trainer.log_dir>/cockpit.jsonl

What your ``LightningModule`` needs (nothing else changes):

* The loss is computed by a mean-reduced ``torch.nn`` loss **module** held as an
  attribute, e.g. ``self.loss_fn = nn.CrossEntropyLoss()`` and
  ``loss = self.loss_fn(logits, y)`` in ``training_step`` (BackPACK sees modules,
  not ``F.cross_entropy``). Layers are modules as usual.

Per-sample losses (Alpha, CABS and the reduction check read them) come from that
loss module: a forward hook re-evaluates its training-mode call on the detached
inputs with ``reduction="none"`` (averaged over non-batch dimensions), a cheap
second evaluation of the loss only. This needs no change to ``training_step`` and
no second loss function. A loss that adds several mean-reduced loss modules of one
batch gets the sum of their per-sample losses.

What the callback does: at ``on_fit_start`` it ``backpack.extend``-s the module's
leaf modules (layers, activations, loss; not containers) and creates the
:class:`~cockpit.Cockpit` on the trainable parameters (with their names);
``on_before_backward`` opens the step
(:meth:`~cockpit.Cockpit.begin` with the loss, per-sample losses, batch size and the
optimizer) and ``on_after_backward`` closes it (:meth:`~cockpit.Cockpit.end`) and
records the learning rate (after LR schedulers). Steps are ``trainer.global_step``
(optimizer steps). The log streams to ``<trainer.log_dir>/cockpit.jsonl`` (readable
by ``cockpit plot``, ``History.from_json`` and the live ``CockpitPlotter`` via
``callback.cockpit``); with a ``TensorBoardLogger`` the run is also exported to its
directory when training ends (:mod:`cockpit.integrations.tensorboard`).

``HessMaxEV`` (configuration ``"full"``) needs ``backward(create_graph=True)`` on its
steps: the callback passes ``create_graph=True`` to ``LightningModule.backward`` on
those steps. If you override ``backward``, forward the keyword arguments
(``def backward(self, loss, *args, **kwargs): loss.backward(*args, **kwargs)``);
an override without ``**kwargs`` gets a warning and HessMaxEV fails on its step.

Not supported (the callback says so): ``accumulate_grad_batches > 1`` (gradients
of several micro-batches are summed into one step, so per-sample statistics of one
micro-batch do not describe the step: the callback warns and tracks nothing),
manual optimisation (warns, tracks nothing) and multi-process strategies such as
DDP (error at setup). A checkpoint holds the cockpit's state; resuming from it
continues the run and appends to the same log.
"""

from __future__ import annotations

import inspect
import os
from typing import Any, Iterable, Mapping

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import SingleDeviceStrategy

from cockpit.cockpit import LOG_KEYS, Cockpit
from cockpit.integrations._common import (
    LossCapture,
    default_logpath,
    default_quantities,
    extend_for_backpack,
    learning_rate,
    loss_modules,
    trainable_named_parameters,
    warn,
)
from cockpit.quantities.base import Quantity

__all__ = ["CockpitCallback"]

#: Keys of :meth:`cockpit.Cockpit.log` that ``metrics=`` can fill, in its order
#: (all but ``epoch_count`` and ``learning_rate``, which the callback fills).
METRIC_KEYS = LOG_KEYS[1:-1]
DEFAULT_METRICS = {"valid_loss": "val_loss", "valid_accuracy": "val_acc"}


class CockpitCallback(Callback):
    """Track cockpit quantities during ``Trainer.fit`` (automatic optimisation).

    Args:
        quantities: The quantities (default: ``configuration("economy")``).
        logpath: Where to stream the log (``.jsonl`` is appended unless it ends
            in ``.json``/``.jsonl``); default ``<trainer.log_dir>/cockpit``.
        tensorboard: Export the log to the ``TensorBoardLogger``'s directory
            when training ends (``None``: if the trainer has one).
        log_learning_rate: Record the learning rate of the first parameter group
            at every step (``learning_rate``, the dashboard's LR gauge).
        metrics: Values you ``self.log`` that the dashboard's performance gauges
            show, as ``{cockpit key: Lightning metric name}``; cockpit keys are
            ``train_loss``, ``valid_loss``, ``test_loss``, ``train_accuracy``,
            ``valid_accuracy`` and ``test_accuracy``. Read after each validation
            and recorded at the last training step. Default:
            ``{"valid_loss": "val_loss", "valid_accuracy": "val_acc"}`` (names
            that are not logged are left out).

    Attributes:
        cockpit: The :class:`~cockpit.Cockpit` (created at ``on_fit_start``), e.g.
            for ``CockpitPlotter().plot(callback.cockpit)`` or ``get_output()``.
    """

    def __init__(
        self,
        quantities: Iterable[Quantity] | None = None,
        logpath: str | os.PathLike | None = None,
        tensorboard: bool | None = None,
        log_learning_rate: bool = True,
        metrics: Mapping[str, str] | None = None,
    ):
        self.quantities = default_quantities(quantities)
        self.logpath = None if logpath is None else os.fspath(logpath)
        self.tensorboard = tensorboard
        self.log_learning_rate = log_learning_rate
        self.metrics = dict(DEFAULT_METRICS if metrics is None else metrics)
        unknown = sorted(set(self.metrics) - set(METRIC_KEYS))
        if unknown:
            raise ValueError(
                f"Unknown cockpit metric key(s) {unknown} in metrics=. Choose from "
                f"{list(METRIC_KEYS)}, e.g. metrics={{'valid_loss': 'val_loss'}}."
            )
        self._last_log: tuple[int, int, float | None] | None = None
        self.cockpit: Cockpit | None = None
        self._capture: LossCapture | None = None
        self._tracking = False
        self._open_step: int | None = None
        self._patched = None
        self._pending_state: dict[str, Any] | None = None

    # --- set-up ----------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str):
        """Refuse strategies the cockpit cannot follow (several processes)."""
        if stage != "fit":
            return
        if trainer.world_size > 1 or not isinstance(
            trainer.strategy, SingleDeviceStrategy
        ):
            raise RuntimeError(
                f"CockpitCallback supports single-device training only, got the "
                f"{type(trainer.strategy).__name__} strategy with "
                f"{trainer.world_size} process(es): per-sample statistics of one "
                "process do not describe the step of a data-parallel run. Fix: "
                "debug on one device (Trainer(devices=1)), then train at scale "
                "without the callback."
            )

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule):
        """Extend the model for BackPACK, create the cockpit, hook the loss."""
        self._tracking = self._can_track(trainer, pl_module)
        extend_for_backpack(pl_module)
        losses = loss_modules(pl_module)
        if not losses:
            warn(
                "CockpitCallback found no torch.nn loss module in your "
                f"{type(pl_module).__name__}; BackPACK needs one and cockpit reads "
                "per-sample losses from it. Fix: self.loss_fn = "
                "nn.CrossEntropyLoss() in __init__ and loss = self.loss_fn(logits, "
                "y) in training_step."
            )
        self._capture = LossCapture(losses)
        self.cockpit = Cockpit(
            trainable_named_parameters(pl_module),
            quantities=self.quantities,
            logpath=self.logpath or default_logpath(trainer.log_dir),
        )
        if self._pending_state is not None:
            self.cockpit.load_state_dict(self._pending_state)
            self._pending_state = None

    def _can_track(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> bool:
        if not pl_module.automatic_optimization:
            warn(
                "CockpitCallback supports automatic optimisation only and tracks "
                "nothing in this run (manual optimisation). Fix: use a plain "
                "training loop with `with cockpit(step, info=...)` around your "
                "manual_backward, or automatic optimisation."
            )
            return False
        if trainer.accumulate_grad_batches > 1:
            warn(
                f"CockpitCallback tracks nothing in this run: accumulate_grad_"
                f"batches={trainer.accumulate_grad_batches} sums the gradients of "
                "several micro-batches into one optimizer step, and cockpit's "
                "per-sample statistics see one micro-batch only. Fix: while "
                "debugging, use accumulate_grad_batches=1 with a larger batch size "
                "(the effective batch) or a smaller one."
            )
            return False
        if str(trainer.precision).startswith("16"):
            warn(
                f"CockpitCallback with precision={trainer.precision!r}: the loss is "
                "scaled before the backward pass, so gradient-based quantities are "
                "scaled too. Fix: debug with precision='32-true' or 'bf16-mixed'."
            )
        return True

    # --- the step --------------------------------------------------------------------
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        """Start capturing the batch's per-sample losses."""
        if self._capture is not None:
            self._capture.reset(armed=self._tracking)

    def on_before_backward(self, trainer, pl_module, loss):
        """Open the cockpit step around the backward pass."""
        if not self._tracking or self.cockpit is None:
            return
        step = trainer.global_step
        optimizer = trainer.optimizers[0]
        info: dict[str, Any] = {"loss": loss, "optimizer": optimizer}
        individual = self._capture.individual_losses()
        self._capture.reset(armed=False)
        if individual is not None:
            info["individual_losses"] = individual
            info["batch_size"] = individual.shape[0]
        else:
            self._require_individual_losses(step, pl_module)
        if self.cockpit.create_graph(step):
            self._patch_backward(pl_module)
        self.cockpit.begin(step, info=info)
        self._open_step = step

    def _require_individual_losses(self, step: int, pl_module) -> None:
        needing = [
            q.key
            for q in self.cockpit.quantities
            if q.is_active(step) and "individual_losses" in q.required_info(step)
        ]
        if needing:
            raise RuntimeError(
                f"{', '.join(needing)} need per-sample losses at step {step}, but no "
                f"torch.nn loss module of your {type(pl_module).__name__} was called "
                "in training_step. Fix: compute the loss with a mean-reduced loss "
                "module attribute (self.loss_fn = nn.CrossEntropyLoss(); loss = "
                "self.loss_fn(logits, y)), not with torch.nn.functional."
            )

    def on_after_backward(self, trainer, pl_module):
        """Close the step: the cockpit tracks its quantities; record the LR."""
        if self._open_step is None:
            return
        step, self._open_step = self._open_step, None
        self._unpatch_backward(pl_module)
        self.cockpit.end()
        lr = learning_rate(trainer.optimizers[0]) if self.log_learning_rate else None
        self._last_log = (step, trainer.current_epoch, lr)
        if self.log_learning_rate:
            self._log(self._last_log, {})

    def _log(self, where: tuple[int, int, float | None], values: dict) -> None:
        step, epoch, lr = where
        self.cockpit.log(step, epoch, *(values.get(k) for k in METRIC_KEYS), lr)

    def on_validation_end(self, trainer, pl_module):
        """Record the ``metrics`` at the last training step."""
        if trainer.sanity_checking or self._last_log is None or not self.metrics:
            return
        found = trainer.callback_metrics
        values = {
            key: float(found[name])
            for key, name in self.metrics.items()
            if name in found
        }
        if values:
            self._log(self._last_log, values)

    def on_exception(self, trainer, pl_module, exception):
        """Abandon an open step (buffers freed, BackPACK context left)."""
        if self._open_step is not None:
            self._open_step = None
            self._unpatch_backward(pl_module)
            try:
                self.cockpit.end(exception)
            except BaseException:  # Lightning re-raises the original error
                pass
        self._finish()

    def on_train_end(self, trainer, pl_module):
        """Close the log; export it to TensorBoard if the trainer logs there."""
        self._finish()
        if self.cockpit is None:
            return
        writer = self._tensorboard_writer(trainer)
        if writer is not None:
            from cockpit.integrations.tensorboard import export_tensorboard

            export_tensorboard(self.cockpit, writer=writer)

    def _finish(self) -> None:
        if self._capture is not None:
            self._capture.remove()
            self._capture = None
        if self.cockpit is not None:
            self.cockpit.close()

    def _tensorboard_writer(self, trainer):
        if self.tensorboard is False:
            return None
        from lightning.pytorch.loggers import TensorBoardLogger

        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                return logger.experiment
        if self.tensorboard:
            warn(
                "CockpitCallback(tensorboard=True) found no TensorBoardLogger. Fix: "
                "Trainer(logger=TensorBoardLogger(...)), or export the log later "
                "with `cockpit export LOG --tensorboard DIR`."
            )
        return None

    # --- create_graph for HessMaxEV ---------------------------------------------------
    def _patch_backward(self, pl_module: pl.LightningModule) -> None:
        """Make Lightning's call of ``pl_module.backward`` pass ``create_graph``."""
        method = type(pl_module).backward
        accepts = method is pl.LightningModule.backward or any(
            p.kind is inspect.Parameter.VAR_KEYWORD or p.name == "create_graph"
            for p in inspect.signature(method).parameters.values()
        )
        if not accepts:
            warn(
                f"{type(pl_module).__name__}.backward takes no keyword arguments, so "
                "CockpitCallback cannot pass create_graph=True, which HessMaxEV "
                "needs. Fix: def backward(self, loss, *args, **kwargs): "
                "loss.backward(*args, **kwargs)."
            )
            return

        def backward(loss, *args, **kwargs):
            kwargs["create_graph"] = True
            return method(pl_module, loss, *args, **kwargs)

        pl_module.__dict__["backward"] = backward
        self._patched = pl_module

    def _unpatch_backward(self, pl_module) -> None:
        if self._patched is not None:
            self._patched.__dict__.pop("backward", None)
            self._patched = None

    # --- checkpoints ------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The cockpit's state, saved in Lightning checkpoints."""
        return {} if self.cockpit is None else {"cockpit": self.cockpit.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the cockpit's state when ``fit`` resumes from a checkpoint."""
        if "cockpit" not in state_dict:
            return
        if self.cockpit is None:  # restored before on_fit_start creates it
            self._pending_state = state_dict["cockpit"]
        else:
            self.cockpit.load_state_dict(state_dict["cockpit"])
