"""The Cockpit: wraps each training step's backward pass and records quantities."""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterable, Sequence

import torch
from backpack import backpack, disable
from backpack.core.derivatives.convnd import weight_jac_t_save_memory
from backpack.extensions.backprop_extension import BackpropExtension

from cockpit.context import StepInfo, missing_info_message
from cockpit.history import History, json_path
from cockpit.hooks import ModuleHook, free_buffers, merge_extensions
from cockpit.needs import extensions_for
from cockpit.quantities.base import Quantity, TrackContext

_LOG = logging.getLogger("cockpit")

#: The keys written by :meth:`Cockpit.log`, in argument order.
LOG_KEYS = (
    "epoch_count",
    "train_loss",
    "valid_loss",
    "test_loss",
    "train_accuracy",
    "valid_accuracy",
    "test_accuracy",
    "learning_rate",
)


class Cockpit:
    """Track quantities about the training during a single backward pass per step.

    Typical use (the loss and model must be ``backpack.extend``-ed)::

        cockpit = Cockpit(model.parameters(), quantities=configuration("economy"))
        for step, (x, y) in enumerate(loader):
            opt.zero_grad()
            outputs = model(x)
            losses = individual_loss_fn(outputs, y)     # reduction="none"
            loss = loss_fn(outputs, y)                  # reduction="mean"
            with cockpit(step, info={"batch_size": x.shape[0],
                                     "individual_losses": losses,
                                     "loss": loss, "optimizer": opt}):
                loss.backward(create_graph=cockpit.create_graph(step))
            opt.step()

    Args:
        params: The parameters to observe (all must require gradients).
        quantities: Quantities to track; more can be added with :meth:`add`.

    Raises:
        ValueError: If a parameter does not require gradients.
    """

    #: Use BackPACK's low-memory algorithm for convolution weight Jacobians.
    BACKPACK_CONV_SAVE_MEMORY = True

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        quantities: Iterable[Quantity] | None = None,
    ):
        self.params = list(params)
        for i, p in enumerate(self.params):
            if not p.requires_grad:
                raise ValueError(
                    f"Parameter #{i} (shape {tuple(p.shape)}) does not require "
                    "gradients. Pass only trainable parameters, e.g. "
                    "[p for p in model.parameters() if p.requires_grad]."
                )
        self.quantities: list[Quantity] = []
        self.history = History()
        self.optimizer_name: str | None = None
        for quantity in quantities or []:
            self.add(quantity)

    # --- configuration -------------------------------------------------------------
    def add(self, quantity: Quantity) -> None:
        """Add a quantity (order is kept).

        Raises:
            ValueError: If it is not a :class:`Quantity` instance, or its key is
                already taken by another quantity.
        """
        if not isinstance(quantity, Quantity):
            hint = (
                " (a class was passed: instantiate it, e.g. GradNorm(linear(1)))"
                if isinstance(quantity, type)
                else ""
            )
            raise ValueError(
                f"Only cockpit.quantities.Quantity instances can be added, got "
                f"{quantity!r}{hint}."
            )
        for other in self.quantities:
            if other.key == quantity.key:
                raise ValueError(
                    f"Two quantities share the key {quantity.key!r}: {other!r} and "
                    f"{quantity!r}. Give one a distinct key, e.g. "
                    f"{type(quantity).__name__}(..., key='{quantity.key}2')."
                )
        self.quantities.append(quantity)

    def create_graph(self, global_step: int) -> bool:
        """Return whether ``loss.backward`` needs ``create_graph=True`` at this step."""
        return any(q.create_graph(global_step) for q in self.quantities)

    # --- the step ------------------------------------------------------------------
    @contextlib.contextmanager
    def __call__(
        self,
        global_step: int,
        *extensions: BackpropExtension,
        info: dict[str, Any] | None = None,
        debug: bool = False,
    ):
        """Context manager around ``loss.backward()`` of step ``global_step``.

        Args:
            global_step: The training step (an int).
            *extensions: Extra BackPACK extensions to run in the same backward pass;
                their results stay on the parameters for you.
            info: The step's ``batch_size``, ``individual_losses``, ``loss`` and
                ``optimizer`` (each quantity reads only what it needs).
            debug: Print the step's plan and turn on BackPACK's debug output.

        Yields:
            Nothing; run the backward pass inside the ``with`` block.

        Raises:
            KeyError: If an active quantity needs an ``info`` key that is missing.
            ValueError: On conflicting BackPACK extensions.
        """
        global_step = int(global_step)
        step_info = StepInfo(global_step, dict(info or {}))
        active = [q for q in self.quantities if q.is_active(global_step)]
        self._check_info(active, step_info)
        if step_info.has("optimizer"):
            self.optimizer_name = type(step_info.get("optimizer")).__name__

        needs = (
            set().union(*(q.needs(global_step) for q in active)) if active else set()
        )
        requested = extensions_for(needs)
        for q in active:
            requested.extend(q.extensions(global_step))
        merged = merge_extensions(list(extensions), requested)
        protected = {ext.savefield for ext in extensions}
        owned = [ext.savefield for ext in merged if ext.savefield not in protected]
        consumers = [
            q for q in active if q.needs(global_step) or q.extensions(global_step)
        ]
        hook = ModuleHook(self.params, consumers, global_step, owned)

        if debug:
            print(
                f"[cockpit] step {global_step}: quantities {[q.key for q in active]}, "
                f"extensions {merged}, create_graph {self.create_graph(global_step)}, "
                f"protected {sorted(protected)}"
            )

        for q in active:
            q.begin_step(global_step)
        try:
            with contextlib.ExitStack() as stack:
                if merged:
                    stack.enter_context(
                        weight_jac_t_save_memory(self.BACKPACK_CONV_SAVE_MEMORY)
                    )
                    stack.enter_context(
                        backpack(*merged, extension_hook=hook, debug=debug)
                    )
                yield
        except BaseException:
            for q in active:
                q.abort_step(global_step)
            self._free_all(owned)
            raise
        try:
            self._check_coverage(hook, consumers)
            self._track(global_step, active, step_info)
        finally:
            self._free_all(owned)
            if self.create_graph(global_step):
                self._release_graph()

    def _check_info(self, active: Sequence[Quantity], step_info: StepInfo) -> None:
        for q in active:
            for key in q.required_info(step_info.global_step):
                if not step_info.has(key):
                    raise KeyError(
                        missing_info_message(key, q.key, step_info.global_step)
                    )

    def _check_coverage(self, hook: ModuleHook, consumers: Sequence[Quantity]) -> None:
        if not consumers:
            return
        missed = [i for i in range(len(self.params)) if i not in hook.visited]
        if missed:
            shapes = ", ".join(f"#{i} {tuple(self.params[i].shape)}" for i in missed)
            names = ", ".join(q.key for q in consumers)
            raise RuntimeError(
                f"BackPACK produced no results for parameter(s) {shapes}, which "
                f"{names} need. Fix: call backpack.extend() on the model and on the "
                "loss function before the forward pass, and make sure every "
                "parameter handed to the Cockpit is used in the loss."
            )

    def _track(self, global_step: int, active, step_info: StepInfo) -> None:
        ctx = TrackContext(global_step, self.params, step_info)
        first = [q for q in active if not q.after_cleanup]
        last = [q for q in active if q.after_cleanup]
        for q in first:
            self._store(q, q.track(global_step, ctx))
        if last:
            with disable():
                for q in last:
                    self._store(q, q.track(global_step, ctx))

    def _store(self, quantity: Quantity, results) -> None:
        for save_step, value in results:
            if value is not None:
                self.history.add(save_step, quantity.key, value)

    def _free_all(self, savefields: Sequence[str]) -> None:
        for p in self.params:
            free_buffers(p, savefields)

    def _release_graph(self) -> None:
        """Detach ``.grad`` after a ``create_graph`` backward.

        This breaks the parameter -> grad -> graph -> parameter cycle that would
        otherwise keep the double-backward graph alive; the values are unchanged.
        """
        for p in self.params:
            if p.grad is not None and p.grad.grad_fn is not None:
                p.grad = p.grad.detach()

    # --- output ----------------------------------------------------------------------
    def log(
        self,
        global_step,
        epoch_count,
        train_loss,
        valid_loss,
        test_loss,
        train_accuracy,
        valid_accuracy,
        test_accuracy,
        learning_rate,
    ) -> None:
        """Record evaluation metrics (shown in the dashboard's bottom row)."""
        values = (
            epoch_count,
            train_loss,
            valid_loss,
            test_loss,
            train_accuracy,
            valid_accuracy,
            test_accuracy,
            learning_rate,
        )
        for key, value in zip(LOG_KEYS, values, strict=True):
            self.history.add(global_step, key, value)

    def get_output(self) -> dict[int, dict[str, Any]]:
        """Return everything recorded so far as ``{step: {key: value}}``."""
        return self.history.to_dict()

    def write(self, logpath) -> str:
        """Write the history to ``logpath + ".json"`` (standard JSON).

        A bare file name writes to the working directory; missing parent directories
        are created.

        Returns:
            The path written.
        """
        path = self.history.write_json(json_path(logpath))
        _LOG.info("Cockpit log written to %s", path)
        return path
