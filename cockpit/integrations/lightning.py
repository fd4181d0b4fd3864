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
loss module: a forward hook re-evaluates its training-mode call on the same
inputs with ``reduction="none"`` (averaged over non-batch dimensions), a cheap
second evaluation of the loss only; their graph is what the cockpit reads to serve
layers BackPACK has no rule for (``docs/any_model.md``). This needs no change to
``training_step`` and no second loss function. A loss that adds several
mean-reduced loss modules of one batch gets the sum of their per-sample losses.

What the callback does: at ``on_fit_start`` it ``backpack.extend``-s the module's
leaf modules (layers, activations, loss; not containers) and creates the
:class:`~cockpit.Cockpit` on the parameters the optimizer updates (with their
names; Alpha replays exactly that update);
``on_before_backward`` opens the step
(:meth:`~cockpit.Cockpit.begin` with the loss, per-sample losses, batch size and the
optimizer) and ``on_after_backward`` closes it (:meth:`~cockpit.Cockpit.end`) and
records the learning rate (after LR schedulers). Steps are ``trainer.global_step``
(optimizer steps). The log streams to ``<trainer.log_dir>/cockpit.jsonl`` (readable
by ``cockpit plot``, ``History.from_json`` and the live ``CockpitPlotter`` via
``callback.cockpit``). Every tracked step's values also go to every logger of the
trainer (``log_metrics`` at the step's ``global_step``, named as the TensorBoard
export names them; histograms, the dashboard and the diagnosis where the logger
shows them: :mod:`cockpit.integrations.loggers`).

Gradient accumulation (``accumulate_grad_batches=k > 1``): the callback tracks one
micro-batch per optimizer step, the first of each accumulation window, under the
optimizer step's ``global_step``, as cockpit's own loop rules say (its ``.grad``
starts at zero, so ``.grad`` and the per-sample statistics describe that
micro-batch alone). Lightning divides each micro-batch's loss by ``k`` before the
backward pass; on the tracked micro-batch the callback backpropagates ``k`` times
that loss instead (exactly the micro-batch's own mean loss: the factor ``k / k`` is
1 in floating point) and divides the new gradients by ``k`` right after the
cockpit's step, inside the same ``backward`` call, so every value describes the
micro-batch's mean loss and the optimizer receives what Lightning would give it
(bit for bit when ``k`` is a power of two; otherwise to the last bit of rounding).
Values read from the parameters (``Distance``, ``UpdateSize``) span whole optimizer
steps and are right. ``Alpha`` replays the optimizer's update from the tracked
micro-batch's gradient, but the step uses the whole window: it is recorded as
missing on such steps, with the reason (a ``CockpitWarning`` names the fix once).

Gradient clipping (``Trainer(gradient_clip_val=...)``) and any other change of
``.grad`` between the backward pass and the optimizer's update (in
``on_before_optimizer_step`` or ``configure_gradient_clipping``): Lightning calls
``optimizer.step(closure)``, inside which cockpit's own check cannot look, so the
callback compares the gradients after the optimizer step with those its step saw;
where clipping changed them, ``Alpha``'s value of that step is recorded as missing,
with the reason (clipping that leaves the gradients alone, a norm below the
threshold, costs nothing).

``HessMaxEV`` (configuration ``"full"``) needs ``backward(create_graph=True)`` on its
steps: the callback passes ``create_graph=True`` to ``LightningModule.backward`` on
those steps. If you override ``backward``, forward the keyword arguments
(``def backward(self, loss, *args, **kwargs): loss.backward(*args, **kwargs)``);
an override without ``**kwargs`` gets a warning and HessMaxEV fails on its step.

DDP (``Trainer(strategy="ddp" or "ddp_spawn", devices=N)``): ``on_fit_start`` runs
after the strategy initialised ``torch.distributed`` and wrapped the model, so the
cockpit joins the processes (``docs/distributed.md``): every value describes the
joined batch of all processes, every process holds the same values (the metrics are
rank 0's), and rank 0 alone streams the log, sends to the loggers and warns.
``HessMaxEV`` is computed before the backward pass (DDP cannot run one with
``create_graph=True``). With accumulation the tracked micro-batch runs inside DDP's
``no_sync()``; the cockpit then joins the processes' own gradients itself. With
``ddp_spawn`` the cockpit lives in the spawned processes (``callback.cockpit`` of
the launching process stays ``None``): read the log file after ``fit``.

FSDP2 (``ModelParallelStrategy(data_parallel_size=N, tensor_parallel_size=1)`` with
``fully_shard`` in ``configure_model``): the Cockpit is made after the parameters
were sharded and serves them as in a plain loop (``docs/distributed.md``).

Not supported (the callback says so): manual optimisation (warns, tracks nothing),
``FSDPStrategy`` (FSDP1's flat parameters), DeepSpeed and tensor parallelism (error
at setup). A
checkpoint holds the cockpit's state; resuming from it continues the run and appends
to the same log.

The standalone ``pytorch_lightning`` package (``import pytorch_lightning as pl``)
has classes of its own, and its ``Trainer`` runs only its own callbacks: use
``from cockpit.integrations.pytorch_lightning import CockpitCallback`` there, the
same callback built on ``pytorch_lightning.Callback``. Both are made by
:func:`callback_class` from one implementation; this module imports
``lightning`` only when ``CockpitCallback`` is first used, so either package alone
suffices. Given to the other package's ``Trainer``, the callback fails at setup
with a ``TypeError`` naming the right import.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
from types import ModuleType
from typing import TYPE_CHECKING, Any, Iterable, Mapping

import torch
from torch.nn.parallel import DistributedDataParallel

from cockpit.cockpit import Cockpit
from cockpit.errors import CockpitWarning, quiet_warnings
from cockpit.integrations._common import (
    LossCapture,
    ScaleNewGradients,
    check_torchvision,
    default_logpath,
    default_quantities,
    extend_for_backpack,
    learning_rate,
    loss_modules,
    replays_update,
    updated_named_parameters,
    warn,
)
from cockpit.log.keys import LOG_KEYS
from cockpit.quantities.base import Quantity
from cockpit.step.loop_checks import GradSnapshot

if TYPE_CHECKING:  # lightning is imported when CockpitCallback is first used
    import lightning.pytorch as pl

__all__ = ["CockpitCallback", "callback_class"]

#: ``callback_class(lightning.pytorch, __name__)``, made on first use
#: (:func:`__getattr__`), so that importing this module needs no ``lightning``.
CockpitCallback: type

#: The module of cockpit's callback for each Lightning package.
CALLBACK_MODULES = {
    "lightning.pytorch": "cockpit.integrations.lightning",
    "pytorch_lightning": "cockpit.integrations.pytorch_lightning",
}

#: Keys of :meth:`cockpit.Cockpit.log` that ``metrics=`` can fill, in its order
#: (all but ``epoch_count`` and ``learning_rate``, which the callback fills).
METRIC_KEYS = LOG_KEYS[1:-1]
DEFAULT_METRICS = {"valid_loss": "val_loss", "valid_accuracy": "val_acc"}


def _accumulation_reason(k: int) -> str:
    """Why a quantity that replays the optimizer's update has no value (``k > 1``)."""
    return (
        f"with accumulate_grad_batches={k} the optimizer step uses the gradients of "
        "every micro-batch of the accumulation window, but the cockpit tracks the "
        "first micro-batch only, so the update it replayed from that gradient is not "
        "the step taken. Fix: accumulate_grad_batches=1 (with the effective batch "
        "size as batch_size) while debugging with Alpha, or drop Alpha"
    )


def _clipping_reason(changed: int, clip_val) -> str:
    """Why a quantity that replays the optimizer's update has no value (clipping)."""
    cause = (
        f"Lightning's gradient clipping, gradient_clip_val={clip_val}"
        if clip_val
        else "e.g. gradient clipping in configure_gradient_clipping or a change in "
        "on_before_optimizer_step"
    )
    return (
        f".grad of {changed} parameter(s) changed between the backward pass and the "
        f"optimizer step ({cause}), so the update cockpit replayed is not the step "
        "taken. Fix: Trainer(gradient_clip_val=None) (or leave .grad unchanged) "
        "while debugging with Alpha, or drop Alpha"
    )


def _synchronises(trainer: pl.Trainer) -> bool:
    """Whether DDP all-reduces the coming backward pass (``False`` in ``no_sync``).

    Lightning runs the micro-batches of an accumulation window before the last
    inside ``DistributedDataParallel.no_sync()``, which clears the wrapper's
    ``require_backward_grad_sync`` (checked here, in ``on_before_backward``).
    """
    model = getattr(trainer.strategy, "model", None)
    return bool(getattr(model, "require_backward_grad_sync", True))


def _strategy_message(strategy, world_size: int) -> str:
    return (
        f"CockpitCallback supports single-device training, DDP and FSDP2 "
        f"(ModelParallelStrategy with fully_shard), got the "
        f"{type(strategy).__name__} strategy with {world_size} process(es), which "
        "cockpit cannot follow (it reads every parameter tensor by its name and "
        "each process a shard of the batch; FSDPStrategy flattens the parameters "
        "into FSDP1's FlatParameter). Fix: Trainer(strategy=ModelParallelStrategy("
        "data_parallel_size=N, tensor_parallel_size=1)) with torch.distributed."
        "fsdp.fully_shard(..., mesh=self.device_mesh['data_parallel']) in "
        "configure_model, or Trainer(strategy='ddp') (docs/distributed.md)."
    )


def _model_parallel(trainer) -> bool:
    """Whether ``trainer`` runs Lightning's ModelParallelStrategy (FSDP2)."""
    return type(trainer.strategy).__name__ == "ModelParallelStrategy"


def _tensor_parallel_message(size: int) -> str:
    return (
        f"CockpitCallback got ModelParallelStrategy(tensor_parallel_size={size}): "
        "cockpit joins the processes of a data-parallel run (each a shard of the "
        "batch, the parameters sharded by fully_shard), not tensor parallelism, "
        "where processes hold parts of one sample's computation. Fix: "
        "ModelParallelStrategy(data_parallel_size=N, tensor_parallel_size=1) "
        "while debugging with cockpit."
    )


def _package_of(trainer) -> str | None:
    """The Lightning package (a key of ``CALLBACK_MODULES``) of ``trainer``'s class."""
    for cls in type(trainer).__mro__:
        for package in CALLBACK_MODULES:
            if cls.__module__ == package or cls.__module__.startswith(package + "."):
                return package
    return None


def check_package(callback, trainer) -> None:
    """Fail on the other Lightning package's trainer, naming the right import.

    A ``lightning.pytorch`` callback in a ``pytorch_lightning`` trainer (or the
    other way round) would fail obscurely later (its strategy classes differ).

    Args:
        callback: The cockpit's callback.
        trainer: The trainer it was given to.

    Raises:
        TypeError: If the trainer is the other package's.
    """
    mine, theirs = callback._package.__name__, _package_of(trainer)
    if theirs is None or theirs == mine:
        return
    raise TypeError(
        f"{type(callback).__module__}.CockpitCallback is a {mine} callback, but this "
        f"Trainer is {theirs}'s ({type(trainer).__module__}."
        f"{type(trainer).__qualname__}); lightning.pytorch and the standalone "
        "pytorch_lightning are separate packages with separate classes, and "
        "neither's Trainer can run the other's callbacks. Fix: from "
        f"{CALLBACK_MODULES[theirs]} import CockpitCallback."
    )


def check_data_parallel(trainer: pl.Trainer) -> None:
    """Several processes: a DDP-wrapped model and a process group of them all."""
    if trainer.world_size <= 1:
        return
    model = trainer.strategy.model
    if _model_parallel(trainer):  # fully_shard: the Cockpit checks the layout
        pass
    elif not isinstance(model, DistributedDataParallel):
        raise RuntimeError(
            _strategy_message(trainer.strategy, trainer.world_size)
            + f" (its model is a {type(model).__name__}, not torch's "
            "DistributedDataParallel)"
        )
    dist = torch.distributed
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        raise RuntimeError(
            f"CockpitCallback in a run of {trainer.world_size} processes found no "
            "torch.distributed process group of them when it created the "
            "Cockpit, so each process would describe its own shard only. Fix: "
            "let the strategy initialise torch.distributed (Trainer("
            "strategy='ddp', devices=N)) before fit starts."
        )


class _CockpitCallback:
    """Track cockpit quantities during ``Trainer.fit`` (automatic optimisation).

    Args:
        quantities: The quantities (default: ``configuration("economy")``).
        logpath: Where to stream the log (``.jsonl`` is appended unless it ends
            in ``.json``/``.jsonl``); default ``<trainer.log_dir>/cockpit``.
        tensorboard: Send the values to the trainer's ``TensorBoardLogger``
            (``None``: if it has one; ``True`` warns if it has none; ``False``
            leaves it out).
        log_learning_rate: Record the learning rate of the first parameter group
            at every step (``learning_rate``, the dashboard's LR gauge).
        metrics: Values you ``self.log`` that the dashboard's performance gauges
            show, as ``{cockpit key: Lightning metric name}``; cockpit keys are
            ``train_loss``, ``valid_loss``, ``test_loss``, ``train_accuracy``,
            ``valid_accuracy`` and ``test_accuracy``. Read after each validation
            and recorded at the last training step. Default:
            ``{"valid_loss": "val_loss", "valid_accuracy": "val_acc"}`` (names
            that are not logged are left out).
        loggers: Send every tracked step's values to every logger of the
            trainer (``log_metrics`` at the step's ``global_step``, with the
            names of the TensorBoard export; histograms, the dashboard and the
            diagnosis where the logger shows them, see
            :mod:`cockpit.integrations.loggers`).

    Attributes:
        cockpit: The :class:`~cockpit.Cockpit` (created at ``on_fit_start``), e.g.
            for ``CockpitPlotter().plot(callback.cockpit)`` or ``get_output()``.
            Under DDP one per process, each with the same values (the plotter
            draws on rank 0 only); with ``ddp_spawn`` it lives in the spawned
            processes.
    """

    #: The Lightning package (``lightning.pytorch`` or ``pytorch_lightning``) whose
    #: ``Callback`` the class subclasses; set by :func:`callback_class`.
    _package: ModuleType

    def __init__(
        self,
        quantities: Iterable[Quantity] | None = None,
        logpath: str | os.PathLike | None = None,
        tensorboard: bool | None = None,
        log_learning_rate: bool = True,
        metrics: Mapping[str, str] | None = None,
        loggers: bool = True,
    ):
        self.quantities = default_quantities(quantities)
        self.logpath = None if logpath is None else os.fspath(logpath)
        self.tensorboard = tensorboard
        self.loggers = loggers
        self._trackers = None  # the loggers' subscriber
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
        self._tracked_step: int | None = None  # global_step of the last tracked step
        self._patched = None
        self._pending_state: dict[str, Any] | None = None
        # after a tracked step: (step, quantities to finish, its gradients)
        self._watch: tuple[int, list[Quantity], GradSnapshot] | None = None
        self._speaks = True  # rank 0 of a DDP run (the callback's own warnings)

    # --- set-up ----------------------------------------------------------------------
    _check_data_parallel = staticmethod(check_data_parallel)  # as before (tests)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str):
        """Refuse the other Lightning package's trainer and sharded models."""
        check_package(self, trainer)
        if stage != "fit":
            return
        self._speaks = trainer.is_global_zero
        strategy = trainer.strategy
        strategies = self._package.strategies
        served = (strategies.SingleDeviceStrategy, strategies.DDPStrategy)
        served += tuple(
            filter(None, [getattr(strategies, "ModelParallelStrategy", None)])
        )
        if not isinstance(strategy, served):
            raise RuntimeError(_strategy_message(strategy, trainer.world_size))
        size = getattr(strategy, "_tensor_parallel_size", 1)
        if _model_parallel(trainer) and size != 1:  # (sizes known at this hook)
            raise RuntimeError(_tensor_parallel_message(size))

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule):
        """Extend the model for BackPACK, create the cockpit, hook the loss.

        Under DDP this runs on every process after the strategy initialised the
        process group and wrapped the model, so the Cockpit joins the processes
        (``Cockpit(process_group="auto")``); the leaf modules of the
        ``LightningModule`` inside the wrapper are extended in place.
        """
        self._speaks = trainer.is_global_zero
        check_data_parallel(trainer)  # before anything is created
        self._tracking = self._can_track(trainer, pl_module)
        self._tracked_step = None
        extend_for_backpack(pl_module)
        losses = loss_modules(pl_module)
        if not losses and self._speaks:
            warn(
                "CockpitCallback found no torch.nn loss module in your "
                f"{type(pl_module).__name__}; BackPACK needs one and cockpit reads "
                "per-sample losses from it. Fix: self.loss_fn = "
                "nn.CrossEntropyLoss() in __init__ and loss = self.loss_fn(logits, "
                "y) in training_step."
            )
        self._capture = LossCapture(losses)
        self.cockpit = Cockpit(
            updated_named_parameters(pl_module, trainer.optimizers),
            quantities=self.quantities,
            logpath=self.logpath or default_logpath(trainer.log_dir),
        )  # trainer.log_dir is a collective under DDP: every process asks
        if self._pending_state is not None:
            self.cockpit.load_state_dict(self._pending_state)
            self._pending_state = None
        self._log_to_loggers(trainer)

    def _log_to_loggers(self, trainer: pl.Trainer) -> None:
        """Subscribe the trainer's loggers to the cockpit (rank 0 only).

        Every tracked step's values go to every logger (``log_metrics``; the
        histograms, dashboard and diagnosis where the logger shows them,
        :mod:`cockpit.integrations.loggers`), at the step's ``global_step``.
        """
        loggers = list(trainer.loggers) if self.loggers else []
        tensorboard = self._package.loggers.TensorBoardLogger
        if self.tensorboard is False:
            loggers = [g for g in loggers if not isinstance(g, tensorboard)]
        elif (
            self.tensorboard
            and self._speaks
            and not any(isinstance(g, tensorboard) for g in loggers)
        ):
            warn(
                "CockpitCallback(tensorboard=True) found no TensorBoardLogger. Fix: "
                "Trainer(logger=TensorBoardLogger(...)), or export the log later "
                "with `cockpit export LOG --tensorboard DIR`."
            )
        if not loggers or not self.cockpit.is_writer:
            return
        from cockpit.integrations.loggers import sink_for
        from cockpit.integrations.trackers import Fanout, attach

        self._trackers = attach(self.cockpit, Fanout([sink_for(g) for g in loggers]))

    def _can_track(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> bool:
        if not pl_module.automatic_optimization:
            if self._speaks:
                warn(
                    "CockpitCallback supports automatic optimisation only and tracks "
                    "nothing in this run (manual optimisation). Fix: use a plain "
                    "training loop with `with cockpit(step, info=...)` around your "
                    "manual_backward, or automatic optimisation."
                )
            return False
        if str(trainer.precision).startswith("16") and self._speaks:
            warn(
                f"CockpitCallback with precision={trainer.precision!r}: the loss is "
                "scaled before the backward pass, so gradient-based quantities are "
                "scaled too. Fix: debug with precision='32-true' or 'bf16-mixed'."
            )
        return True

    # --- the step --------------------------------------------------------------------
    def _tracks(self, trainer: pl.Trainer) -> bool:
        """Whether the coming backward pass is tracked: the first of its step.

        With ``accumulate_grad_batches=k`` the first micro-batch of each window
        (``.grad`` zeroed before its backward pass); ``global_step`` counts the
        optimizer steps, so it changes exactly when a new window begins.
        """
        return self._tracking and trainer.global_step != self._tracked_step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        """Start capturing the batch's per-sample losses (if it will be tracked)."""
        if self._capture is not None:
            self._capture.reset(armed=self._tracks(trainer))

    def on_before_backward(self, trainer, pl_module, loss):
        """Open the cockpit step around the backward pass."""
        if self.cockpit is None or not self._tracks(trainer):
            return  # a later micro-batch of an accumulation window is not tracked
        step = trainer.global_step
        self._tracked_step = step
        # Lightning divides the loss by k (accumulate_grad_batches); the tracked
        # micro-batch is described by its own mean loss, k times that
        k = max(1, int(trainer.accumulate_grad_batches))
        optimizer = trainer.optimizers[0]
        info: dict[str, Any] = {"loss": loss * k if k > 1 else loss}
        info["optimizer"] = optimizer
        individual = self._capture.individual_losses()
        self._capture.reset(armed=False)
        if individual is not None:
            info["individual_losses"] = individual
            info["batch_size"] = individual.shape[0]
        else:
            self._require_individual_losses(step, pl_module)
        create_graph = self.cockpit.create_graph(step)  # False under DDP
        # DDP with accumulation: the window's first micro-batch runs in no_sync(),
        # .grad stays each process's own; the cockpit then joins them itself
        no_sync = self.cockpit.data_parallel and not _synchronises(trainer)
        self.cockpit.begin(step, info=info, no_sync=no_sync)
        self._open_step = step
        if create_graph or k > 1:
            self._patch_backward(trainer, pl_module, create_graph, k)

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
        if self._open_step is not None:
            self._close_step(trainer, pl_module)

    def _close_step(
        self, trainer, pl_module, unscale: ScaleNewGradients | None = None
    ) -> None:
        """End the cockpit's step; the gradients become Lightning's; check Alpha."""
        step, self._open_step = self._open_step, None
        self._unpatch_backward(pl_module)
        try:
            self.cockpit.end()
        finally:
            if unscale is not None:
                unscale.apply()
        updating = [q for q in self.cockpit.quantities if replays_update(q)]
        if unscale is not None:  # accumulation: the update is the whole window's
            self._missing(
                [q for q in updating if q.discard_start(step)],
                step,
                _accumulation_reason(unscale.factor),
                "accumulation",
            )
        else:
            pending = [q for q in updating if q.finishes(step + 1)]
            if pending:
                self._watch = (step, pending, GradSnapshot(self.cockpit.params))
        lr = learning_rate(trainer.optimizers[0]) if self.log_learning_rate else None
        self._last_log = (step, trainer.current_epoch, lr)
        if self.log_learning_rate:
            self._log(self._last_log, {})

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        """After the optimizer step: did clipping change the tracked gradients?"""
        watch, self._watch = self._watch, None
        if watch is None or self.cockpit is None:
            return
        step, pending, grads = watch
        changed = grads.changed()
        if changed:
            self._missing(
                [q for q in pending if q.discard_start(step)],
                step,
                _clipping_reason(changed, trainer.gradient_clip_val),
                "clipping",
            )

    def _missing(
        self, quantities: list[Quantity], step: int, reason: str, cause: str
    ) -> None:
        """Record ``quantities`` as missing at ``step`` (:meth:`Cockpit.missing`).

        It warns once per key and cause; on ranks other than the log's writer the
        warning is left out (every rank records the same).
        """
        if not quantities:
            return
        quiet = contextlib.nullcontext()
        if not self._speaks:
            quiet = quiet_warnings("", category=CockpitWarning)
        with quiet:
            self.cockpit.missing(step, quantities, reason, cause=cause)

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
        if self.cockpit is not None and self.cockpit.data_parallel:
            # every process records what the writer (rank 0) records
            values = trainer.strategy.broadcast(values, src=0)
        if values:
            self._log(self._last_log, values)

    def on_exception(self, trainer, pl_module, exception):
        """Abandon an open step (buffers freed, BackPACK context left)."""
        self._watch = None
        if self._open_step is not None:
            self._open_step = None
            self._unpatch_backward(pl_module)
            try:
                self.cockpit.end(exception)
            except BaseException:  # Lightning re-raises the original error
                pass
        self._finish()

    def on_train_end(self, trainer, pl_module):
        """Close the log; the loggers get the dashboard and the diagnosis."""
        self._finish()

    def _finish(self) -> None:
        if self._capture is not None:
            self._capture.remove()
            self._capture = None
        if self.cockpit is not None:
            self.cockpit.close()

    # --- create_graph for HessMaxEV, the loss of an accumulation window ---------------
    def _patch_backward(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, create_graph, k: int
    ) -> None:
        """Make Lightning's call of ``pl_module.backward`` fit the tracked step.

        ``create_graph=True`` is passed where a quantity needs it. With ``k > 1``
        (accumulation) the call backpropagates ``k`` times Lightning's loss (the
        micro-batch's own mean loss), then closes the cockpit's step and divides
        the new gradients by ``k``, before anything else sees them.
        """
        method = type(pl_module).backward
        accepts = method is self._package.LightningModule.backward or any(
            p.kind is inspect.Parameter.VAR_KEYWORD or p.name == "create_graph"
            for p in inspect.signature(method).parameters.values()
        )
        if create_graph and not accepts:
            warn(  # (never under DDP: create_graph is False there)
                f"{type(pl_module).__name__}.backward takes no keyword arguments, so "
                "CockpitCallback cannot pass create_graph=True, which HessMaxEV "
                "needs. Fix: def backward(self, loss, *args, **kwargs): "
                "loss.backward(*args, **kwargs)."
            )
            create_graph = False
        if not create_graph and k == 1:
            return

        def backward(loss, *args, **kwargs):
            if create_graph:
                kwargs["create_graph"] = True
            if k == 1:
                return method(pl_module, loss, *args, **kwargs)
            trained = [p for p in pl_module.parameters() if p.requires_grad]
            unscale = ScaleNewGradients(trained, k, divide=True)
            method(pl_module, loss * k, *args, **kwargs)
            self._close_step(trainer, pl_module, unscale)

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


@functools.cache
def callback_class(package: ModuleType, module: str) -> type:
    """``CockpitCallback`` for one Lightning package: its ``Callback``, cockpit's body.

    Args:
        package: ``lightning.pytorch`` or ``pytorch_lightning`` (the module); its
            ``Callback``, ``Trainer``, ``LightningModule``, strategies and loggers
            are the ones the callback subclasses and checks.
        module: The module the class is found in (for pickling, e.g. ``ddp_spawn``).

    The class is named ``CockpitCallback`` (also its checkpoint ``state_key``), one
    class per package (cached).
    """
    return type(
        "CockpitCallback",
        (_CockpitCallback, package.Callback),
        {
            "__module__": module,
            "__doc__": _CockpitCallback.__doc__,
            "_package": package,
        },
    )


def __getattr__(name: str):
    """``CockpitCallback``, for ``lightning.pytorch``, made on first use.

    So :mod:`cockpit.integrations.pytorch_lightning` imports this module without
    importing ``lightning`` (which need not be installed).
    """
    if name != "CockpitCallback":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        import lightning.pytorch as package
    except ModuleNotFoundError as error:
        if error.name not in ("lightning", "lightning.pytorch"):
            raise
        raise ModuleNotFoundError(
            f"{__name__}.CockpitCallback needs the lightning package: pip install "
            "lightning (or cockpit's extra, see docs/integrations.md). With the "
            "standalone pytorch_lightning package: from "
            "cockpit.integrations.pytorch_lightning import CockpitCallback.",
            name=error.name,
        ) from error
    except Exception:  # e.g. a torchvision that cannot load: say so, with the fix
        check_torchvision(__name__, "Lightning (through torchmetrics)")
        raise
    cls = globals()["CockpitCallback"] = callback_class(package, __name__)
    return cls
