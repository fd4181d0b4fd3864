"""Cockpit in the Hugging Face ``Trainer``: ``CockpitTrainer`` (or the mixin).

::

    from cockpit.integrations.transformers import CockpitTrainer
    from cockpit.utils.configuration import configuration

    trainer = CockpitTrainer(model=model, args=args, train_dataset=train,
                             cockpit_quantities=configuration("economy"))
    trainer.train()            # log: <args.output_dir>/cockpit.jsonl

``CockpitTrainer`` is ``Trainer`` with :class:`CockpitTrainerMixin`; put the mixin
first to add cockpit to your own subclass
(``class MyTrainer(CockpitTrainerMixin, Trainer)``).

Why a subclass and not a ``TrainerCallback``: callbacks see neither the loss nor
the backward pass, and Hugging Face models compute their loss with functional code
inside ``forward``, which BackPACK cannot see. The mixin therefore computes the
loss itself in ``compute_loss``: it calls the model without ``labels`` and applies
``cockpit_loss_fn`` (default ``nn.CrossEntropyLoss()``, mean-reduced and
``backpack.extend``-ed) to the logits; per-sample losses are the same loss with
``reduction="none"`` on the same logits, so no extra forward pass runs (their
graph is what the cockpit reads to serve layers BackPACK has no rule for). For
classification (logits ``[N, C]``) and token classification (``[N, T, C]``,
moved to ``[N, C, T]``) this is the loss the model computes itself (for tokens:
when no label is ignored). The mixin tells the ``Trainer`` that this loss is the
batch's mean (``loss_is_scaled_for_ga = False`` during the training step; the
Trainer would otherwise take it for a sum over ``num_items_in_batch``). The step is
opened (:meth:`~cockpit.Cockpit.begin`) and closed (:meth:`~cockpit.Cockpit.end`)
inside the Trainer's call of ``accelerator.backward``; the learning rate is recorded
at every step.

Gradient accumulation (``gradient_accumulation_steps=k > 1``): one micro-batch is
tracked per optimizer step, the first of each accumulation window (its ``.grad``
starts at zero: the Trainer zeroes the gradients after each step), under the
optimizer step's ``state.global_step``, as cockpit's own loop rules say. Every
micro-batch's loss is the mixin's mean loss, and the Trainer divides it by the
window's micro-batches (``k``, fewer in the last window of an epoch), so an
optimizer step's gradient is the mean of the micro-batches' mean-loss gradients,
as in Lightning or a plain loop. (The plain ``Trainer`` does the same with the
model's own loss for models without ``**kwargs`` in ``forward``. To models with
them it passes the labels counted over the window, ``num_items_in_batch``, and does
not divide: a loss that divides its sum by that count gives the window's mean (the
same as the mixin's when every micro-batch counts as many labels), one that
ignores it, as BERT's sequence classification does, adds the micro-batches' mean
losses, ``k`` times the mixin's gradient.) On the tracked micro-batch the
backward pass runs on the undivided mean loss inside the cockpit's step, and the
new gradients are multiplied right after by the factor the Trainer put on the loss
(``d loss / d mean``, ``1/k``), before anything else sees them: every value
describes the micro-batch's mean loss, and the optimizer gets what the Trainer
would give it (bit for bit when ``k`` is a power of two, otherwise to the last bit
of rounding). A loss given to ``accelerator.backward`` that is not that mean loss
times a constant (a ``training_step`` override adding terms) is an error. Values
read from the parameters (``Distance``, ``UpdateSize``) span whole optimizer steps.
``Alpha`` replays the optimizer's update from the tracked micro-batch's gradient,
but the step uses the whole window: it is recorded as missing on such steps (with
the reason, :meth:`~cockpit.Cockpit.missing`; a ``CockpitWarning`` names the fix
once); on a window of one micro-batch it has its value.

Gradient clipping (``max_grad_norm``, 1.0 by default in ``TrainingArguments``):
the Trainer clips between the backward pass and ``optimizer.step()``. Where that
changed a tracked step's gradients, ``Alpha``'s value of that step is recorded as
missing, with the reason and the fix (``max_grad_norm=0`` while debugging with
Alpha); clipping that leaves the gradients alone (a norm below the threshold)
costs nothing.

Which parameters are tracked: by default those the Trainer's optimizer updates
(every trainable parameter unless you passed ``optimizers=`` with fewer), embeddings
and LayerNorms included, so ``Alpha`` replays exactly the step the optimizer takes
and norms, tests and histograms describe the whole update. BackPACK serves the
layers it has rules for; the cockpit computes exact per-sample gradients for the
others (embeddings, LayerNorm, a position embedding shared by the batch) from the
per-sample losses' graph (``docs/any_model.md``; ``trainer.cockpit.coverage()``
says which engine serves what). ``cockpit_params=`` chooses others; the quantities
then describe those tensors, and ``Alpha``, which needs the whole update, is
missing unless they are what the optimizer updates. First-order quantities
(``economy``) work for any model; curvature quantities (``business``, ``full``)
need BackPACK to differentiate through every layer, which attention blocks do not
allow.

Every tracked step's values go to the ``report_to`` callbacks (TensorBoard, W&B,
MLflow, ...: their ``on_log``, at the step's ``global_step``; they name them
``train/cockpit/...``), and at the end of training the dashboard, the diagnosis and
the histograms to those cockpit knows (:mod:`cockpit.integrations.loggers`).

Not supported (the trainer says so): several processes or GPUs (error), models
whose output has no ``logits``, and ``gradient_accumulation_steps > 1`` with a
transformers version whose ``Trainer`` has no ``loss_is_scaled_for_ga`` (warns,
tracks nothing). A run resumed from a checkpoint starts a fresh cockpit and a second log
(``cockpit_from_step_<k>.jsonl``), so the first run's log is kept.
"""

from __future__ import annotations

import os
import weakref
from typing import Any, Iterable

import torch
from torch import Tensor, nn

try:
    from transformers import Trainer, TrainerCallback
except Exception as error:  # e.g. a torchvision that cannot load: name the fix
    if getattr(error, "name", None) != "transformers":  # installed
        from cockpit.integrations._common import check_torchvision

        check_torchvision(__name__, "transformers")
    raise

from cockpit.cockpit import Cockpit
from cockpit.engines.backpack.api import extend
from cockpit.integrations._common import (
    ScaleNewGradients,
    default_logpath,
    default_quantities,
    learning_rate,
    per_sample_losses,
    replays_update,
    updated_named_parameters,
    warn,
)
from cockpit.quantities.base import Quantity
from cockpit.step.loop_checks import GradSnapshot

__all__ = ["CockpitTrainer", "CockpitTrainerMixin"]


class CockpitTrainerMixin:
    """Adds a :class:`~cockpit.Cockpit` to a Hugging Face ``Trainer`` (mixin first).

    Args:
        *args: Passed to the ``Trainer``.
        cockpit_quantities: The quantities (default ``configuration("economy")``).
        cockpit_logpath: Where to stream the log; default
            ``<args.output_dir>/cockpit`` (``cockpit.jsonl``).
        cockpit_loss_fn: A mean-reduced ``torch.nn`` loss module applied as
            ``loss_fn(logits, labels)`` (default ``nn.CrossEntropyLoss()``).
        cockpit_params: ``(name, parameter)`` pairs or parameters to track
            (default: those the optimizer updates; Alpha needs exactly those).
        cockpit_report: Send every tracked step's values to the Trainer's
            tracking callbacks (``report_to``: their ``on_log``, at the step's
            ``global_step``), and the dashboard and diagnosis to those cockpit
            knows (TensorBoard, W&B, MLflow; :mod:`cockpit.integrations.loggers`).
        **kwargs: Passed to the ``Trainer``.

    Attributes:
        cockpit: The :class:`~cockpit.Cockpit`, created at the first training step.
    """

    def __init__(
        self,
        *args: Any,
        cockpit_quantities: Iterable[Quantity] | None = None,
        cockpit_logpath: str | os.PathLike | None = None,
        cockpit_loss_fn: nn.Module | None = None,
        cockpit_params: Iterable | None = None,
        cockpit_report: bool = True,
        **kwargs: Any,
    ):
        super().__init__(*args, **kwargs)
        self.cockpit_quantities = default_quantities(cockpit_quantities)
        self.cockpit_logpath = cockpit_logpath
        self.cockpit_loss_fn = cockpit_loss_fn or nn.CrossEntropyLoss()
        self.cockpit_params = None if cockpit_params is None else list(cockpit_params)
        self.cockpit: Cockpit | None = None
        self._cockpit_tracking = True
        self._cockpit_in_step = False  # in training_step: compute_loss is the mixin's
        self._cockpit_track = False  # and this micro-batch is tracked
        self._cockpit_window: int | None = None  # global_step of the last micro-batch
        self._cockpit_model: nn.Module | None = None
        self._cockpit_pending: tuple[int, dict, Tensor] | None = None
        self._cockpit_open: int | None = None
        self._cockpit_backward = None
        self._cockpit_declared: tuple[Any] | None = None
        self._cockpit_warned_labels = False
        self._cockpit_warned_backward = False
        # after a tracked step: (step, quantities to finish, its gradients)
        self._cockpit_watch: tuple[int, list[Quantity], GradSnapshot] | None = None
        self.add_callback(_ClippingWatch(self))
        self.cockpit_report = cockpit_report
        # first, so the log is closed and the trackers get the dashboard before
        # report_to callbacks end their runs in on_train_end
        self.callback_handler.callbacks.insert(0, _CloseAtTrainEnd(self))

    # --- set-up -----------------------------------------------------------------------
    def _cockpit_setup(self, model: nn.Module) -> None:
        args = self.args
        if args.world_size > 1 or args.n_gpu > 1:
            raise RuntimeError(
                f"CockpitTrainer supports one process on one device, got world size "
                f"{args.world_size} with {args.n_gpu} GPU(s): per-sample statistics "
                "of one process do not describe a data-parallel step. Fix: debug "
                "on one device (CUDA_VISIBLE_DEVICES=0, no torchrun)."
            )
        k = args.gradient_accumulation_steps
        if k > 1 and not hasattr(Trainer, "loss_is_scaled_for_ga"):
            warn(
                f"CockpitTrainer tracks nothing in this run: with gradient_"
                f"accumulation_steps={k} it must tell the Trainer that its loss is "
                "a per-micro-batch mean (Trainer.loss_is_scaled_for_ga), which this "
                "transformers version does not have. Fix: upgrade transformers, or "
                "debug with gradient_accumulation_steps=1 and "
                "per_device_train_batch_size set to the effective batch size."
            )
            self._cockpit_tracking = False
        if args.fp16:
            warn(
                "CockpitTrainer with fp16=True: the loss is scaled before the "
                "backward pass, so gradient-based quantities are scaled too. Fix: "
                "debug in float32 or with bf16=True."
            )
        self.cockpit_loss_fn = extend(self.cockpit_loss_fn)
        params = self.cockpit_params
        if params is None:
            params = _updated_parameters(model, self.optimizer)
        extend(model)  # the cockpit keeps BackPACK's hooks from breaking the model
        logpath = self.cockpit_logpath or default_logpath(args.output_dir)
        if self.state.global_step > 0:  # resumed: keep the first run's log
            logpath = f"{logpath}_from_step_{self.state.global_step}"
            warn(
                f"CockpitTrainer resumed at step {self.state.global_step}: the "
                "cockpit starts afresh (Hugging Face checkpoints do not hold its "
                f"state) and logs to {logpath}.jsonl, next to the first run's log. "
                "Distance and UpdateSize restart there."
            )
        self.cockpit = Cockpit(params, quantities=self.cockpit_quantities,
                               logpath=logpath)  # fmt: skip
        if self.cockpit_report:
            from cockpit.integrations.loggers import TrainerLog
            from cockpit.integrations.trackers import attach

            attach(self.cockpit, TrainerLog(self))

    # --- the step ---------------------------------------------------------------------
    def training_step(self, model, inputs, *args, **kwargs):
        """Run Trainer's training step; track the first micro-batch of each step."""
        if self.cockpit is None:
            self._cockpit_setup(model)
        step = self.state.global_step  # counts optimizer steps: new in a new window
        first, self._cockpit_window = step != self._cockpit_window, step
        self._cockpit_in_step = self._cockpit_tracking
        self._cockpit_track = self._cockpit_tracking and first
        self._cockpit_model = model
        try:
            result = super().training_step(model, inputs, *args, **kwargs)
        except BaseException as error:
            if self._cockpit_open is not None:
                self._cockpit_open = None
                self._cockpit_restore_backward()
                self.cockpit.end(error)  # abandons the step, re-raises the error
            raise
        else:
            if self._cockpit_pending is not None:
                self._cockpit_warn_no_backward()
            return result
        finally:
            self._cockpit_in_step = self._cockpit_track = False
            self._cockpit_pending = self._cockpit_model = None
            self._cockpit_restore_backward()
            self._cockpit_undeclare()

    def compute_loss(self, model, inputs, return_outputs=False, **kwargs):
        """Compute the loss with ``cockpit_loss_fn``; prepare the tracked step.

        Outside training steps (evaluation), and for batches without ``labels``,
        this is the ``Trainer``'s own loss.
        """
        if self._cockpit_in_step and "labels" not in inputs:
            self._cockpit_in_step = self._cockpit_track = False
            if not self._cockpit_warned_labels:
                self._cockpit_warned_labels = True
                warn(
                    "CockpitTrainer found no 'labels' in the training batch (keys: "
                    f"{sorted(inputs)}) and tracks nothing on such steps. Fix: name "
                    "the targets 'labels' in your dataset or data collator."
                )
        if not self._cockpit_in_step:
            return super().compute_loss(model, inputs, return_outputs, **kwargs)
        self._cockpit_in_step = False  # one loss per training step
        track, self._cockpit_track = self._cockpit_track, False
        inputs = dict(inputs)
        labels = inputs.pop("labels")
        outputs = model(**inputs)
        logits = outputs["logits"] if isinstance(outputs, dict) else outputs[0]
        if logits.dim() > 2:  # [N, T, C] -> [N, C, T], as CrossEntropyLoss wants it
            logits = logits.movedim(-1, 1)
        loss = self.cockpit_loss_fn(logits, labels)
        self._cockpit_declare_mean()
        if track:
            individual = per_sample_losses(self.cockpit_loss_fn, (logits, labels))
            optimizer = getattr(self.optimizer, "optimizer", self.optimizer)
            info = {"loss": loss, "individual_losses": individual,
                    "batch_size": len(individual), "optimizer": optimizer}  # fmt: skip
            self._cockpit_pending = (self.state.global_step, info, loss)
            self._cockpit_patch_backward()
        return (loss, outputs) if return_outputs else loss

    def _cockpit_warn_no_backward(self) -> None:
        if not self._cockpit_warned_backward:
            self._cockpit_warned_backward = True
            warn(
                f"CockpitTrainer tracked nothing at step {self.state.global_step}: "
                "the training step ran no accelerator.backward, inside which the "
                "cockpit's step runs. Fix: in an override of training_step, call "
                "self.accelerator.backward(loss) (not loss.backward()), or call "
                "super().training_step."
            )

    def _cockpit_declare_mean(self) -> None:
        """Tell the Trainer that the loss is the micro-batch's mean, undivided.

        ``loss_is_scaled_for_ga = False`` until the training step ends: the Trainer
        then divides the loss by the micro-batches of the accumulation window.
        """
        if self._cockpit_declared is None:
            saved = self.__dict__.get("loss_is_scaled_for_ga", _UNSET)
            self._cockpit_declared = (saved,)
            self.loss_is_scaled_for_ga = False

    def _cockpit_undeclare(self) -> None:
        if self._cockpit_declared is not None:
            (saved,), self._cockpit_declared = self._cockpit_declared, None
            if saved is _UNSET:
                self.__dict__.pop("loss_is_scaled_for_ga", None)
            else:
                self.loss_is_scaled_for_ga = saved

    def _cockpit_patch_backward(self) -> None:
        """Make the step's ``accelerator.backward`` the tracked backward pass.

        It backpropagates the micro-batch's mean loss (the loss ``compute_loss``
        returned) inside the cockpit's step, with ``create_graph=True`` where a
        quantity needs it, closes the step, and then multiplies the new gradients
        by the factor the Trainer put on that loss (one over the window's
        micro-batches), so the optimizer gets what the Trainer would give it.
        """
        accelerator = self.accelerator
        original = accelerator.backward

        def backward(loss: Tensor, **kwargs: Any) -> None:
            self._cockpit_restore_backward()
            (step, info, mean), self._cockpit_pending = self._cockpit_pending, None
            factor = _factor(loss, mean)
            if self.cockpit.create_graph(step):
                kwargs["create_graph"] = True
            trained = [p for p in self._cockpit_model.parameters() if p.requires_grad]
            rescale = None if factor is None else ScaleNewGradients(trained, factor)
            self.cockpit.begin(step, info=info)
            self._cockpit_open = step
            original(mean, **kwargs)
            self._cockpit_close(rescale)

        accelerator.backward = backward
        self._cockpit_backward = accelerator

    def _cockpit_close(self, rescale: ScaleNewGradients | None) -> None:
        """End the cockpit's step, hand the Trainer its gradients, record the LR."""
        step, self._cockpit_open = self._cockpit_open, None
        try:
            self.cockpit.end()
        finally:
            if rescale is not None:
                rescale.apply()
        k = self.args.gradient_accumulation_steps
        if getattr(self, "current_gradient_accumulation_steps", k) > 1:
            # the optimizer step uses the whole window: no update to replay
            started = [
                q
                for q in self.cockpit.quantities
                if replays_update(q) and q.finishes(step + 1)  # a value started here
            ]
            self.cockpit.missing(
                step, started, _accumulation_reason(k), cause="accumulation"
            )
        else:  # the Trainer may clip before the update: compare then
            pending = [
                q
                for q in self.cockpit.quantities
                if replays_update(q) and q.finishes(step + 1)
            ]
            if pending:
                self._cockpit_watch = (step, pending, GradSnapshot(self.cockpit.params))
        lr = learning_rate(self.optimizer)
        epoch = int(self.state.epoch or 0)
        self.cockpit.log(step, epoch, None, None, None, None, None, None, lr)

    def _cockpit_check_clipping(self) -> None:
        """Before the optimizer's update: did clipping change the tracked gradients?

        The Trainer clips the gradient norm to ``max_grad_norm`` (1.0 by default)
        between the backward pass and ``optimizer.step()``; where that changed the
        gradients, the update replayed by Alpha is not the step taken, so Alpha's
        value of that step is recorded as missing with the Trainer's fix (the
        cockpit's own check at ``optimizer.step()`` then has nothing left to say).
        """
        watch, self._cockpit_watch = self._cockpit_watch, None
        if watch is None or self.cockpit is None:
            return
        step, pending, grads = watch
        changed = grads.changed()
        started = [q for q in pending if q.discard_start(step)] if changed else []
        if started:
            reason = _clipping_reason(changed, self.args.max_grad_norm)
            self.cockpit.missing(step, started, reason, cause="clipping")

    def _cockpit_restore_backward(self) -> None:
        if self._cockpit_backward is not None:
            del self._cockpit_backward.backward  # the class's method again
            self._cockpit_backward = None

    def train(self, *args: Any, **kwargs: Any):
        """Train as ``Trainer.train`` does, then close the log.

        The log is closed at ``on_train_end`` (before the ``report_to`` callbacks
        end their runs), or here if training stopped with an error.
        """
        try:
            return super().train(*args, **kwargs)
        finally:
            if self.cockpit is not None:
                self.cockpit.close()


class CockpitTrainer(CockpitTrainerMixin, Trainer):
    """``transformers.Trainer`` with cockpit (see :class:`CockpitTrainerMixin`)."""


_UNSET = object()


def _accumulation_reason(k: int) -> str:
    """Why a quantity that replays the optimizer's update has no value (``k > 1``)."""
    return (
        f"with gradient_accumulation_steps={k} the optimizer step uses the gradients "
        "of every micro-batch of the accumulation window, but the cockpit tracks the "
        "first micro-batch only, so the update it replayed from that gradient is not "
        "the step taken. Fix: gradient_accumulation_steps=1 (with "
        "per_device_train_batch_size the effective batch size) while debugging with "
        "Alpha, or drop Alpha"
    )


def _clipping_reason(changed: int, max_grad_norm: float) -> str:
    """Why a quantity that replays the optimizer's update has no value (clipping)."""
    cause = (
        f"the Trainer clipped the gradient norm to max_grad_norm={max_grad_norm}"
        if max_grad_norm and max_grad_norm > 0
        else "e.g. a callback's on_pre_optimizer_step"
    )
    fix = (
        "TrainingArguments(max_grad_norm=0) while debugging with Alpha"
        if max_grad_norm and max_grad_norm > 0
        else "leave .grad unchanged before the optimizer step"
    )
    return (
        f".grad of {changed} parameter(s) changed between the backward pass and the "
        f"optimizer step ({cause}), so the update cockpit replayed is not the step "
        f"taken. Fix: {fix}, or drop Alpha"
    )


class _ClippingWatch(TrainerCallback):
    """Tells the mixin when the Trainer is about to update (after any clipping)."""

    def __init__(self, trainer: CockpitTrainerMixin):
        self._trainer = weakref.ref(trainer)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        """Compare the tracked gradients with what the optimizer will use."""
        trainer = self._trainer()
        if trainer is not None:
            trainer._cockpit_check_clipping()


class _CloseAtTrainEnd(TrainerCallback):
    """Closes the cockpit when training ends, before the tracking callbacks do."""

    def __init__(self, trainer: CockpitTrainerMixin):
        self._trainer = weakref.ref(trainer)

    def on_train_end(self, args, state, control, **kwargs):
        """Close the log: the trackers get the dashboard and the diagnosis."""
        trainer = self._trainer()
        if trainer is not None and trainer.cockpit is not None:
            trainer.cockpit.close()


def _factor(loss: Tensor, mean: Tensor) -> Tensor | None:
    """``d loss / d mean`` where ``loss`` is ``mean`` times or divided by constants.

    ``None`` if ``loss`` is ``mean``. The Trainer divides the mean loss of a
    micro-batch by the accumulation steps before the backward pass.

    Raises:
        RuntimeError: If ``loss`` is anything else of ``mean``: then the gradients
            of ``mean`` are not those the Trainer asked for.
    """
    if loss is mean:
        return None
    node = loss.grad_fn
    while node is not mean.grad_fn:
        inputs = [] if node is None else [f for f, _ in node.next_functions if f]
        if type(node).__name__ not in _SCALINGS or len(inputs) != 1:
            raise RuntimeError(
                "CockpitTrainer: the loss given to accelerator.backward is not the "
                "loss compute_loss returned, multiplied or divided by constants, so "
                "the cockpit cannot describe the micro-batch's mean loss and hand the "
                "Trainer its gradients. Fix: pass the loss of the mixin's "
                "compute_loss unchanged (scaled as you like) to accelerator.backward, "
                "and put other terms into cockpit_loss_fn (a mean-reduced loss "
                "module)."
            )
        node = inputs[0]
    (factor,) = torch.autograd.grad(loss, mean, retain_graph=True)
    return factor


_SCALINGS = ("DivBackward0", "MulBackward0")


def _updated_parameters(model: nn.Module, optimizer) -> list[tuple[str, Tensor]]:
    """What the Trainer's optimizer updates, named as in ``model``."""
    tracked = updated_named_parameters(model, [] if optimizer is None else [optimizer])
    if not tracked:
        raise ValueError(
            "CockpitTrainer found no parameter of the model that the optimizer "
            "updates (none requires gradients, or the optimizer holds other "
            "tensors). Fix: give the Trainer an optimizer of the model's trainable "
            "parameters, or pass cockpit_params=[...] to choose what to track."
        )
    return tracked
