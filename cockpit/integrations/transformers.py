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
``reduction="none"`` on the detached logits, so no extra forward pass runs. For
classification (logits ``[N, C]``) and token classification (``[N, T, C]``,
moved to ``[N, C, T]``) this is the loss the model computes itself (for tokens:
when no label is ignored). The step is opened (:meth:`~cockpit.Cockpit.begin`)
after ``compute_loss`` and closed (:meth:`~cockpit.Cockpit.end`) when
``training_step`` returns, i.e. around ``accelerator.backward``; the learning rate
is recorded at every step.

Which parameters are tracked: per-sample gradients exist in BackPACK for some layer
types only, and transformers also hold LayerNorm, position embeddings (shared by
all samples of a batch) and the like. By default the cockpit tracks the trainable
parameters of ``nn.Linear`` and ``nn.ConvNd`` layers (:data:`TRACKED_LAYERS`) and
says once how many tensors it leaves out; all parameters are still trained.
``cockpit_params=`` chooses others. Quantities then describe the tracked
parameters: norms, tests and histograms over those tensors, and Alpha along the
update of those tensors. First-order quantities (``economy``) work for any model;
curvature quantities (``business``, ``full``) need BackPACK to differentiate
through every layer, which attention blocks do not allow.

With ``report_to=["tensorboard"]`` the cockpit's values are exported into the run's
TensorBoard directory when training ends (:mod:`cockpit.integrations.tensorboard`).

Not supported (the trainer says so): ``gradient_accumulation_steps > 1`` (warns,
tracks nothing), several processes or GPUs (error), and models whose output has no
``logits``. A run resumed from a checkpoint starts a fresh cockpit and a second log
(``cockpit_from_step_<k>.jsonl``), so the first run's log is kept.
"""

from __future__ import annotations

import os
from typing import Any, Iterable

from backpack import extend
from torch import Tensor, nn
from transformers import Trainer

from cockpit.cockpit import Cockpit
from cockpit.integrations._common import (
    default_logpath,
    default_quantities,
    learning_rate,
    per_sample_losses,
    warn,
)
from cockpit.quantities.base import Quantity

__all__ = ["CockpitTrainer", "CockpitTrainerMixin", "TRACKED_LAYERS"]

#: Layer types whose trainable parameters are tracked by default.
TRACKED_LAYERS: tuple[type[nn.Module], ...] = (
    nn.Linear,
    nn.Conv1d,
    nn.Conv2d,
    nn.Conv3d,
)


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
            (default: those of :data:`TRACKED_LAYERS`).
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
        **kwargs: Any,
    ):
        super().__init__(*args, **kwargs)
        self.cockpit_quantities = default_quantities(cockpit_quantities)
        self.cockpit_logpath = cockpit_logpath
        self.cockpit_loss_fn = cockpit_loss_fn or nn.CrossEntropyLoss()
        self.cockpit_params = None if cockpit_params is None else list(cockpit_params)
        self.cockpit: Cockpit | None = None
        self._cockpit_tracking = True
        self._cockpit_in_step = False
        self._cockpit_open: int | None = None
        self._cockpit_backward = None
        self._cockpit_warned_labels = False

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
        if args.gradient_accumulation_steps > 1:
            warn(
                f"CockpitTrainer tracks nothing in this run: gradient_accumulation_"
                f"steps={args.gradient_accumulation_steps} sums the gradients of "
                "several micro-batches into one step and cockpit's per-sample "
                "statistics see one micro-batch. Fix: while debugging, use "
                "gradient_accumulation_steps=1 and per_device_train_batch_size set "
                "to the effective batch size (or smaller)."
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
            params = _layer_parameters(model)
        _extend_owners(model, params)
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

    # --- the step ---------------------------------------------------------------------
    def training_step(self, model, inputs, *args, **kwargs):
        """Run Trainer's training step with the cockpit step around its backward."""
        if self.cockpit is None:
            self._cockpit_setup(model)
        self._cockpit_in_step = self._cockpit_tracking
        try:
            loss = super().training_step(model, inputs, *args, **kwargs)
        except BaseException as error:
            self._cockpit_in_step = False
            self._cockpit_restore_backward()
            if self._cockpit_open is not None:
                self._cockpit_open = None
                self.cockpit.end(error)  # abandons the step, re-raises the error
            raise
        self._cockpit_in_step = False
        self._cockpit_restore_backward()
        if self._cockpit_open is not None:
            step, self._cockpit_open = self._cockpit_open, None
            self.cockpit.end()
            lr = learning_rate(self.optimizer)
            epoch = int(self.state.epoch or 0)
            self.cockpit.log(step, epoch, None, None, None, None, None, None, lr)
        return loss

    def compute_loss(self, model, inputs, return_outputs=False, **kwargs):
        """Compute the loss with ``cockpit_loss_fn`` and open the cockpit step.

        Outside training steps (evaluation) this is the ``Trainer``'s own loss.
        """
        if self._cockpit_in_step and "labels" not in inputs:
            self._cockpit_in_step = False
            if not self._cockpit_warned_labels:
                self._cockpit_warned_labels = True
                warn(
                    "CockpitTrainer found no 'labels' in the training batch (keys: "
                    f"{sorted(inputs)}) and tracks nothing on such steps. Fix: name "
                    "the targets 'labels' in your dataset or data collator."
                )
        if not self._cockpit_in_step:
            return super().compute_loss(model, inputs, return_outputs, **kwargs)
        self._cockpit_in_step = False  # one cockpit step per training step
        inputs = dict(inputs)
        labels = inputs.pop("labels")
        outputs = model(**inputs)
        logits = outputs["logits"] if isinstance(outputs, dict) else outputs[0]
        if logits.dim() > 2:  # [N, T, C] -> [N, C, T], as CrossEntropyLoss wants it
            logits = logits.movedim(-1, 1)
        loss = self.cockpit_loss_fn(logits, labels)
        individual = per_sample_losses(self.cockpit_loss_fn, (logits, labels))
        step = self.state.global_step
        if self.cockpit.create_graph(step):
            self._cockpit_create_graph()
        optimizer = getattr(self.optimizer, "optimizer", self.optimizer)
        info = {"loss": loss, "individual_losses": individual,
                "batch_size": individual.shape[0], "optimizer": optimizer}  # fmt: skip
        self.cockpit.begin(step, info=info)
        self._cockpit_open = step
        return (loss, outputs) if return_outputs else loss

    def _cockpit_create_graph(self) -> None:
        """Let this step's ``accelerator.backward`` keep the graph (HessMaxEV)."""
        accelerator = self.accelerator
        original = accelerator.backward

        def backward(loss: Tensor, **kwargs: Any) -> None:
            return original(loss, create_graph=True, **kwargs)

        accelerator.backward = backward
        self._cockpit_backward = accelerator

    def _cockpit_restore_backward(self) -> None:
        if self._cockpit_backward is not None:
            del self._cockpit_backward.backward  # the class's method again
            self._cockpit_backward = None

    def train(self, *args: Any, **kwargs: Any):
        """Train as ``Trainer.train`` does, then close the log.

        With ``report_to`` including ``"tensorboard"`` the cockpit's values are
        also exported into the run's TensorBoard directory.
        """
        try:
            result = super().train(*args, **kwargs)
        finally:
            if self.cockpit is not None:
                self.cockpit.close()
        logdir = self._cockpit_tensorboard_dir()
        if logdir is not None and self.cockpit is not None:
            from cockpit.integrations.tensorboard import export_tensorboard

            export_tensorboard(self.cockpit, logdir)
        return result

    def _cockpit_tensorboard_dir(self) -> str | None:
        for callback in self.callback_handler.callbacks:
            if type(callback).__name__ == "TensorBoardCallback":
                return getattr(callback, "logging_dir", None)
        return None


class CockpitTrainer(CockpitTrainerMixin, Trainer):
    """``transformers.Trainer`` with cockpit (see :class:`CockpitTrainerMixin`)."""


def _extend_owners(model: nn.Module, params: Iterable) -> None:
    """``backpack.extend`` the modules that own the tracked parameters.

    Only those: BackPACK stores ``module.output`` on every module it extends, which
    clashes with submodules named ``output`` (as in BERT's attention blocks), and
    first-order quantities need no hooks elsewhere.
    """
    ids = {id(p[1] if isinstance(p, tuple) else p) for p in params}
    for module in model.modules():
        if any(id(p) in ids for p in module.parameters(recurse=False)):
            extend(module)


def _layer_parameters(model: nn.Module) -> list[tuple[str, Tensor]]:
    """Trainable parameters of :data:`TRACKED_LAYERS`; warn about the others."""
    tracked: list[tuple[str, Tensor]] = []
    left: dict[str, int] = {}
    for module_name, module in model.named_modules():
        for name, param in module.named_parameters(recurse=False):
            if not param.requires_grad:
                continue
            full = f"{module_name}.{name}" if module_name else name
            if isinstance(module, TRACKED_LAYERS):
                tracked.append((full, param))
            else:
                kind = type(module).__name__
                left[kind] = left.get(kind, 0) + 1
    if left:
        kinds = ", ".join(f"{count} of {kind}" for kind, count in sorted(left.items()))
        warn(
            f"CockpitTrainer tracks the {len(tracked)} parameter tensors of "
            f"{', '.join(t.__name__ for t in TRACKED_LAYERS)} layers and leaves out "
            f"{sum(left.values())} ({kinds}); they are trained but not observed. "
            "Fix: pass cockpit_params=[...] to choose (BackPACK must have per-sample "
            "gradients for their layers)."
        )
    if not tracked:
        raise ValueError(
            "CockpitTrainer found no trainable nn.Linear or nn.Conv layer to track. "
            "Fix: pass cockpit_params=model.named_parameters() (or a selection)."
        )
    return tracked
