"""The Cockpit: wraps each training step's backward pass and records quantities."""

from __future__ import annotations

import contextlib
import logging
import operator
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import torch
from backpack import backpack, disable
from backpack.core.derivatives.convnd import weight_jac_t_save_memory
from backpack.extensions.backprop_extension import BackpropExtension
from torch import Tensor
from torch.nn import Module

from cockpit.checks import (
    FIRST_ORDER_SAVEFIELDS,
    CockpitWarning,
    StepHealth,
    batchnorm_message,
    check_step_info,
    find_backpack_failure,
    is_training_batchnorm,
    mismatch_message,
    module_label,
    no_gradient_message,
    nonfinite_message,
    param_label,
    reduction_problem,
    step_health,
    sum_reduced_message,
    unextended_loss_message,
    unsupported_message,
)
from cockpit.context import StepInfo, missing_info_message
from cockpit.history import History, json_path
from cockpit.hooks import ModuleHook, free_buffers, merge_extensions
from cockpit.log_stream import LogStream
from cockpit.needs import extensions_for
from cockpit.param_view import ParamView
from cockpit.quantities.base import Quantity, TrackContext

_LOG = logging.getLogger("cockpit")

#: PyTorch's warning about backward(create_graph=True), silenced on cockpit's steps.
_CREATE_GRAPH_WARNING = r"Using backward\(\) with create_graph=True"

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

#: History key of tracked steps whose loss or gradients were NaN or infinite; the
#: value lists what was not finite (``["loss"]``, ``["gradients"]`` or both).
NONFINITE_KEY = "nonfinite"

#: Version of the dictionary returned by :meth:`Cockpit.state_dict`.
STATE_VERSION = 1

# BackPACK savefields whose results have the parameter's shape (zero for a parameter
# that received no gradient).
_PARAM_SHAPED_SAVEFIELDS = frozenset(
    {"sum_grad_squared", "variance", "diag_h", "diag_ggn_exact", "diag_ggn_mc"}
)


class _GuardedConsumer:
    """Runs a quantity's ``accumulate`` and keeps its first error for later.

    An error inside the backward pass would otherwise abort the user's
    ``loss.backward()``; the cockpit decides after the backward whether to raise it
    (finite step: it is a bug) or to drop the quantity for the step (non-finite
    values, e.g. a histogram of NaNs).
    """

    __slots__ = ("quantity", "error")

    def __init__(self, quantity: Quantity):
        self.quantity = quantity
        self.error: Exception | None = None

    def accumulate(self, global_step: int, view: ParamView) -> None:
        if self.error is not None:
            return
        try:
            self.quantity.accumulate(global_step, view)
        except Exception as error:  # re-raised after the backward
            self.error = error


class _WatchedHook:
    """Wraps the :class:`ModuleHook` and notes modules BackPACK could not handle.

    First-order BackPACK extensions skip a module they have no extension for (with
    a warning); the module's parameters then lack the results the quantities need.
    Such modules are noted (and not shown to the quantities), as are BatchNorm
    layers in train mode. Costs a few attribute lookups per module.
    """

    def __init__(
        self,
        inner: ModuleHook,
        index: Mapping[int, int],
        needed: Sequence[str],
        owned: Sequence[str],
    ):
        self.inner = inner
        self._index = index
        self._needed = tuple(needed)
        self._owned = tuple(owned)
        self.unsupported: list[tuple[Module, list[str], list[int]]] = []
        self.batchnorms: list[Module] = []
        self.batch_size: int | None = None

    def __call__(self, module: Module) -> None:
        mine = [
            (self._index[id(p)], p)
            for p in module.parameters(recurse=False)
            if id(p) in self._index
        ]
        if mine and self._needed:
            if is_training_batchnorm(module):
                self.batchnorms.append(module)
            missing = [
                f for f in self._needed if not all(hasattr(p, f) for _, p in mine)
            ]
            if missing:
                self.unsupported.append((module, missing, [i for i, _ in mine]))
                for _, p in mine:
                    free_buffers(p, self._owned)
                return
            if self.batch_size is None:
                first = mine[0][1]
                for savefield in ("grad_batch", "batch_l2"):
                    if hasattr(first, savefield):
                        self.batch_size = getattr(first, savefield).shape[0]
                        break
        self.inner(module)


@dataclass
class _StepPlan:
    """What one step does: quantities, extensions, and who needs which result."""

    global_step: int
    active: list[Quantity]
    consumers: list[_GuardedConsumer]
    requested: list[BackpropExtension]
    owned: list[str]
    grads_before: list[tuple[Tensor | None, int | None]] = field(default_factory=list)

    def fields_of(self, quantity: Quantity) -> set[str]:
        """BackPACK savefields ``quantity`` reads at this step."""
        extensions = extensions_for(quantity.needs(self.global_step))
        extensions += quantity.extensions(self.global_step)
        return {ext.savefield for ext in extensions}

    def who_needs(self, savefields: Iterable[str]) -> str:
        """Name the quantities that read any of ``savefields`` (for messages)."""
        savefields = set(savefields)
        if savefields & FIRST_ORDER_SAVEFIELDS:
            savefields |= FIRST_ORDER_SAVEFIELDS
        names = [q.key for q in self.active if self.fields_of(q) & savefields]
        return ", ".join(names) if names else "your extra extensions"


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

    Robustness:

    * Inputs are checked early and errors name the problem and the fix: a
      sum-reduced loss, ``batch_size`` disagreeing with ``individual_losses``,
      missing ``info`` keys, models or losses that are not extended, layers
      BackPACK cannot handle (named), BatchNorm in train mode.
    * Steps with a NaN or infinite loss or gradient are recorded under
      :data:`NONFINITE_KEY`, warned about once, and never stop the training.
    * Parameters that receive no gradient (unused layers) count as having zero
      gradient and curvature; a warning names them once.
    * ``logpath`` streams the history to a crash-safe file as the run goes
      (:mod:`cockpit.log_stream`); :meth:`state_dict` and
      :meth:`load_state_dict` resume a run from a checkpoint.

    Args:
        params: The parameters to observe (all must require gradients), e.g.
            ``model.parameters()``. ``model.named_parameters()`` works too and
            lets messages name parameters and layers.
        quantities: Quantities to track; more can be added with :meth:`add`.
        logpath: If given, stream the history to this file while training (one
            JSON record per tracked step, flushed when the step is done). Without
            a ``.json``/``.jsonl`` suffix, ``.jsonl`` is appended. A new run
            replaces the file; a run resumed with :meth:`load_state_dict` appends.

    Raises:
        ValueError: If a parameter does not require gradients or is given twice.
        TypeError: If a parameter is not a tensor, or ``quantities`` is a single
            quantity instead of a list.
        OSError: If ``logpath`` cannot be written.
    """

    #: Use BackPACK's low-memory algorithm for convolution weight Jacobians.
    BACKPACK_CONV_SAVE_MEMORY = True

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        quantities: Iterable[Quantity] | None = None,
        logpath: str | None = None,
    ):
        self.params: list[Tensor] = []
        #: Parameter names where known (``named_parameters()``), else ``None``.
        self.param_names: list[str | None] = []
        index: dict[int, int] = {}
        for i, item in enumerate(params):
            name = None
            if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
                name, item = item
            self._check_param(i, item, name, index)
            index[id(item)] = i
            self.params.append(item)
            self.param_names.append(name)
        self._index = index
        if isinstance(quantities, Quantity):
            raise TypeError(
                f"quantities must be a list of Quantity instances, got the single "
                f"quantity {quantities!r}. Fix: Cockpit(params, quantities=[...])."
            )
        self.quantities: list[Quantity] = []
        self.history = History()
        self.optimizer_name: str | None = None
        self._stream = LogStream(logpath) if logpath is not None else None
        self._last_step: int | None = None
        self._fresh: dict[int, dict[str, Any]] = {}
        self._warned: set = set()
        for quantity in quantities or []:
            self.add(quantity)

    def _check_param(self, i: int, param, name: str | None, index) -> None:
        label = f"Parameter #{i}" + (f" ({name!r})" if name else "")
        if not isinstance(param, Tensor):
            raise TypeError(
                f"{label} is a {type(param).__name__}, not a tensor. Fix: pass "
                "model.parameters() or model.named_parameters()."
            )
        if not param.requires_grad:
            raise ValueError(
                f"{label} (shape {tuple(param.shape)}) does not require "
                "gradients. Pass only trainable parameters, e.g. "
                "[p for p in model.parameters() if p.requires_grad]."
            )
        if id(param) in index:
            raise ValueError(
                f"{label} is the same tensor as parameter #{index[id(param)]}. Fix: "
                "pass each parameter once (model.parameters() already skips tied "
                "weights)."
            )

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
            ValueError: On conflicting BackPACK extensions, a sum-reduced loss, or
                ``batch_size`` disagreeing with ``individual_losses``.
            NotImplementedError: If BackPACK cannot handle a layer (named) for the
                quantities due at this step, e.g. BatchNorm in train mode.
            RuntimeError: If the model or the loss function is not extended.
        """
        global_step = _as_step(global_step)
        step_info = StepInfo(global_step, dict(info or {}))
        check_step_info(step_info)
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
            _GuardedConsumer(q)
            for q in active
            if q.needs(global_step) or q.extensions(global_step)
        ]
        plan = _StepPlan(global_step, active, consumers, requested, owned)
        hook = ModuleHook(self.params, consumers, global_step, owned)
        watched = _WatchedHook(
            hook, self._index, sorted({ext.savefield for ext in requested}), owned
        )
        if active:
            plan.grads_before = [
                (p.grad, p.grad._version if p.grad is not None else None)
                for p in self.params
            ]

        if debug:
            print(
                f"[cockpit] step {global_step}: quantities {[q.key for q in active]}, "
                f"extensions {merged}, create_graph {self.create_graph(global_step)}, "
                f"protected {sorted(protected)}"
            )

        for q in active:
            q.begin_step(global_step, step_info)
        try:
            with contextlib.ExitStack() as stack:
                if self.create_graph(global_step):
                    # PyTorch warns that create_graph makes a parameter <-> .grad
                    # cycle; the cockpit breaks it after the step (_release_graph).
                    stack.enter_context(warnings.catch_warnings())
                    warnings.filterwarnings(
                        "ignore", message=_CREATE_GRAPH_WARNING, category=UserWarning
                    )
                if merged:
                    stack.enter_context(
                        weight_jac_t_save_memory(self.BACKPACK_CONV_SAVE_MEMORY)
                    )
                    stack.enter_context(
                        backpack(*merged, extension_hook=watched, debug=debug)
                    )
                yield
        except BaseException as error:
            for q in active:
                q.abort_step(global_step)
            self._free_all(owned)
            clearer = self._explain_backward_error(error, plan)
            if clearer is not None:
                raise clearer from error
            raise
        try:
            if active:
                tolerant = self._after_backward(plan, watched, step_info)
                dropped = {id(c.quantity) for c in consumers if c.error is not None}
                tracked = [q for q in active if id(q) not in dropped]
                self._track(global_step, tracked, step_info, tolerant)
            self._last_step = global_step
        except BaseException:
            for q in active:
                q.abort_step(global_step)
            raise
        finally:
            self._free_all(owned)
            if self.create_graph(global_step):
                self._release_graph()
            self._flush()

    def begin(
        self,
        global_step: int,
        *extensions: BackpropExtension,
        info: dict[str, Any] | None = None,
        debug: bool = False,
    ) -> None:
        """Start step ``global_step`` without a ``with`` block (for callbacks).

        ``cockpit.begin(step, info=...)``, ``loss.backward(...)``,
        ``cockpit.end()`` is the same as the ``with cockpit(step, info=...)``
        block; arguments as for :meth:`__call__`.

        Raises:
            RuntimeError: If a step is already open.
        """
        if getattr(self, "_open_step", None) is not None:
            raise RuntimeError(
                "Cockpit.begin() was called twice without Cockpit.end() in between. "
                "Fix: call cockpit.end() after the backward pass of each step."
            )
        context = self(global_step, *extensions, info=info, debug=debug)
        context.__enter__()
        self._open_step = context

    def end(self, error: BaseException | None = None) -> None:
        """Finish the step opened by :meth:`begin` and track its quantities.

        Args:
            error: The exception that interrupted the backward pass, if any; the
                step is then abandoned (nothing tracked, buffers freed) and the
                error is re-raised.

        Raises:
            RuntimeError: If no step is open.
        """
        context = getattr(self, "_open_step", None)
        if context is None:
            raise RuntimeError(
                "Cockpit.end() was called without Cockpit.begin(). Fix: call "
                "cockpit.begin(step, info=...) before the backward pass."
            )
        self._open_step = None
        if error is None:
            context.__exit__(None, None, None)
        elif not context.__exit__(type(error), error, error.__traceback__):
            raise error

    def _check_info(self, active: Sequence[Quantity], step_info: StepInfo) -> None:
        for q in active:
            for key in q.required_info(step_info.global_step):
                if not step_info.has(key):
                    raise KeyError(
                        missing_info_message(key, q.key, step_info.global_step)
                    )

    # --- after the backward pass -----------------------------------------------------
    def _after_backward(
        self, plan: _StepPlan, watched: _WatchedHook, step_info: StepInfo
    ) -> bool:
        """Check the step; return whether it was non-finite (tracking is tolerant).

        One device synchronisation reads the loss, the mean per-sample loss and
        whether the gradients are finite.
        """
        step = plan.global_step
        health = step_health(step_info, self.params)
        self._check_reduction(health, step_info)
        nonfinite = health.nonfinite
        if nonfinite:
            self._record(step, NONFINITE_KEY, nonfinite)
            self._warn_once(
                NONFINITE_KEY, nonfinite_message(nonfinite, step, NONFINITE_KEY)
            )
        self._check_modules(plan, watched)
        self._check_coverage(plan, watched, step_info)
        failed = [c for c in plan.consumers if c.error is not None]
        if failed and not nonfinite:
            raise failed[0].error
        for consumer in failed:
            self._drop(consumer.quantity, step, consumer.error)
        return bool(nonfinite)

    def _check_reduction(self, health: StepHealth, step_info: StepInfo) -> None:
        if health.mean_individual is None:
            return
        step = step_info.global_step
        batch_size = step_info.get("individual_losses").shape[0]
        problem = reduction_problem(health, batch_size)
        if problem == "sum":
            where = (
                f"info['loss'] = {health.loss:.6g} is {batch_size} times the mean "
                f"of info['individual_losses'] = {health.mean_individual:.6g}"
            )
            raise ValueError(sum_reduced_message(step, where))
        if problem == "mismatch":
            self._warn_once("loss-mismatch", mismatch_message(health, step))

    def _check_modules(self, plan: _StepPlan, watched: _WatchedHook) -> None:
        step = plan.global_step
        for module in watched.batchnorms:
            label = self._module_label(module)
            who = plan.who_needs(FIRST_ORDER_SAVEFIELDS)
            self._warn_once(
                ("batchnorm", label), batchnorm_message(label, who, step, error=False)
            )
        if watched.unsupported:
            module, missing, _ = watched.unsupported[0]
            names = ", ".join(
                type(e).__name__ for e in plan.requested if e.savefield in missing
            )
            raise NotImplementedError(
                unsupported_message(
                    self._module_label(module),
                    names or ", ".join(missing),
                    plan.who_needs(missing),
                    step,
                    first_order=set(missing) <= FIRST_ORDER_SAVEFIELDS,
                )
            )

    def _check_coverage(
        self, plan: _StepPlan, watched: _WatchedHook, step_info: StepInfo
    ) -> None:
        """Tell unused parameters from parameters of modules that were not extended.

        A parameter BackPACK did not reach whose ``.grad`` this backward pass did
        not write is unused: it is shown to the quantities with zero results. One
        whose ``.grad`` was written belongs to a module that is not extended.
        """
        unwritten = [
            i
            for i, (p, (grad, version)) in enumerate(
                zip(self.params, plan.grads_before, strict=True)
            )
            if p.grad is grad and (grad is None or grad._version == version)
        ]
        if unwritten:
            labels = [self._param_label(i) for i in unwritten]
            self._warn_once(("no-grad", tuple(unwritten)), no_gradient_message(labels))
        if not plan.consumers:
            return
        missed = [i for i in range(len(self.params)) if i not in watched.inner.visited]
        unextended = [i for i in missed if i not in set(unwritten)]
        if unextended:
            shapes = ", ".join(self._param_label(i) for i in unextended)
            names = ", ".join(c.quantity.key for c in plan.consumers)
            raise RuntimeError(
                f"BackPACK produced no results for parameter(s) {shapes}, which "
                f"{names} need, although the backward pass computed their "
                "gradients. Fix: call backpack.extend() on the model and on the "
                "loss function before the forward pass, and use every parameter "
                "through the nn.Module that owns it (BackPACK cannot see parameters "
                "used in functional code, e.g. x @ layer.weight)."
            )
        batch_size = watched.batch_size
        if batch_size is None and step_info.has("batch_size"):
            batch_size = int(step_info.get("batch_size"))
        for i in missed:
            self._show_zero_results(plan, i, batch_size)

    def _show_zero_results(
        self, plan: _StepPlan, index: int, batch_size: int | None
    ) -> None:
        """Show the quantities zero results for a parameter without gradient.

        Exact: the loss does not depend on the parameter. One parameter at a time;
        zero per-sample gradients take as much memory as BackPACK's would if the
        parameter were used, and are freed right after.
        """
        param = self.params[index]
        savefields = {ext.savefield for ext in plan.requested}
        written = []
        with torch.no_grad():
            for savefield in savefields:
                if savefield == "grad_batch" and batch_size is not None:
                    value = param.new_zeros((batch_size, *param.shape))
                elif savefield == "batch_l2" and batch_size is not None:
                    value = param.new_zeros((batch_size,))
                elif savefield in _PARAM_SHAPED_SAVEFIELDS:
                    value = torch.zeros_like(param)
                else:  # N unknown, or an extension whose results we cannot fake
                    continue
                setattr(param, savefield, value)
                written.append(savefield)
        view = ParamView(param, index)
        for consumer in plan.consumers:
            consumer.accumulate(plan.global_step, view)
        view.release()
        free_buffers(param, written)

    def _explain_backward_error(
        self, error: BaseException, plan: _StepPlan
    ) -> Exception | None:
        """Return a clearer error for BackPACK failures inside the backward pass."""
        step = plan.global_step
        if isinstance(error, NotImplementedError):
            module, extension = find_backpack_failure(error.__traceback__)
            if extension is None:
                return None
            label = self._module_label(module) if module is not None else "a layer"
            who = plan.who_needs({extension.savefield})
            if module is not None and is_training_batchnorm(module):
                return NotImplementedError(
                    batchnorm_message(label, who, step, error=True)
                )
            return NotImplementedError(
                unsupported_message(
                    label,
                    type(extension).__name__,
                    who,
                    step,
                    first_order=extension.savefield in FIRST_ORDER_SAVEFIELDS,
                    container=module is not None
                    and any(True for _ in module.children()),
                )
            )
        if isinstance(error, AssertionError) and "backpropagation quantity" in str(
            error
        ):
            _, extension = find_backpack_failure(error.__traceback__)
            savefields = {extension.savefield} if extension is not None else set()
            return RuntimeError(
                unextended_loss_message(plan.who_needs(savefields), step)
            )
        return None

    # --- tracking --------------------------------------------------------------------
    def _track(
        self, global_step: int, active, step_info: StepInfo, tolerant: bool = False
    ) -> None:
        ctx = TrackContext(global_step, self.params, step_info)
        first = [q for q in active if not q.after_cleanup]
        last = [q for q in active if q.after_cleanup]
        for q in first:
            self._track_one(q, global_step, ctx, tolerant)
        if last:
            with disable():
                for q in last:
                    self._track_one(q, global_step, ctx, tolerant)

    def _track_one(
        self, quantity: Quantity, global_step: int, ctx: TrackContext, tolerant: bool
    ) -> None:
        if not tolerant:
            self._store(quantity, quantity.track(global_step, ctx))
            return
        try:
            results = quantity.track(global_step, ctx)
        except Exception as error:  # a non-finite step must not crash
            self._drop(quantity, global_step, error)
            return
        self._store(quantity, results)

    def _drop(self, quantity: Quantity, global_step: int, error: Exception) -> None:
        """Skip a quantity that failed on a non-finite step (warn once per key)."""
        quantity.abort_step(global_step)
        self._warn_once(
            ("dropped", quantity.key),
            f"{quantity.key} failed on the non-finite step {global_step} "
            f"({type(error).__name__}: {error}) and has no value there; training "
            "goes on. Fix: see the warning about non-finite values. (Warned once.)",
        )

    def _store(self, quantity: Quantity, results) -> None:
        for save_step, value in results:
            if value is not None:
                self._record(save_step, quantity.key, value)

    def _record(self, global_step: int, key: str, value: Any) -> None:
        """Add a value to the history and queue it for the streamed log."""
        self.history.add(global_step, key, value)
        if self._stream is not None:
            self._fresh.setdefault(int(global_step), {})[key] = value

    def _flush(self) -> None:
        """Write the values recorded since the last flush to the streamed log."""
        if self._stream is not None and self._fresh:
            fresh, self._fresh = self._fresh, {}
            self._stream.write(fresh)

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

    # --- messages --------------------------------------------------------------------
    def _warn_once(self, key, message: str) -> None:
        if key in self._warned:
            return
        self._warned.add(key)
        warnings.warn(message, CockpitWarning, stacklevel=3)

    def _param_label(self, index: int) -> str:
        return param_label(index, self.params[index], self.param_names[index])

    def _module_label(self, module: Module) -> str:
        owned = [
            (self._index[id(p)], self.param_names[self._index[id(p)]])
            for p in module.parameters(recurse=False)
            if id(p) in self._index
        ]
        return module_label(module, owned)

    # --- checkpoints -----------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Return what a restarted run needs to continue exactly where this one is.

        Holds every quantity's state (keyed by quantity key; e.g. Distance's start
        point and the pending starts of two-step quantities such as UpdateSize),
        the history so far and the last step seen. Save it with ``torch.save``
        together with the model and optimizer state, after ``optimizer.step()``.

        Returns:
            A dictionary of tensors and plain Python values.
        """
        return {
            "version": STATE_VERSION,
            "last_step": self._last_step,
            "optimizer_name": self.optimizer_name,
            "quantities": {q.key: q.state_dict() for q in self.quantities},
            "history": self.history.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any], strict: bool = True) -> None:
        """Restore a state from :meth:`state_dict`; the run continues after it.

        Create the Cockpit with the same quantities (and ``logpath``, to append to
        the same streamed log) and load the model and optimizer states as usual.
        Records that the interrupted run streamed for steps after the checkpoint
        are superseded by those of the resumed run.

        Args:
            state: The dictionary returned by :meth:`state_dict`.
            strict: Require the same quantity keys in ``state`` and this cockpit.

        Raises:
            ValueError: If ``state`` is not a cockpit state, or (with ``strict``)
                the quantity keys differ.
        """
        if not isinstance(state, Mapping) or "quantities" not in state:
            keys = f" with keys {sorted(state)}" if isinstance(state, Mapping) else ""
            raise ValueError(
                f"Expected a dictionary from Cockpit.state_dict(), got "
                f"{type(state).__name__}{keys}. Fix: save cockpit.state_dict() and "
                "pass that dictionary."
            )
        version = state.get("version", STATE_VERSION)
        if version > STATE_VERSION:
            raise ValueError(
                f"The cockpit state has version {version}, newer than this cockpit "
                f"reads ({STATE_VERSION}). Fix: upgrade cockpit."
            )
        saved = state["quantities"]
        keys = [q.key for q in self.quantities]
        missing = sorted(set(keys) - set(saved))
        unexpected = sorted(set(saved) - set(keys))
        if strict and (missing or unexpected):
            raise ValueError(
                f"The cockpit state does not match the quantities: missing "
                f"{missing}, unexpected {unexpected}. Fix: create the Cockpit with "
                "the quantities (and keys) of the saved run, or pass strict=False "
                "to start the missing ones afresh and ignore the unexpected ones."
            )
        for quantity in self.quantities:
            if quantity.key in saved:
                quantity.load_state_dict(saved[quantity.key])
        self.history.load_state_dict(state.get("history") or {})
        self._last_step = state.get("last_step")
        self.optimizer_name = state.get("optimizer_name", self.optimizer_name)
        if self._stream is not None:
            self._stream.resume(self._last_step)

    def close(self) -> None:
        """Close the streamed log (everything is on disk already after each step)."""
        if self._stream is not None:
            self._stream.close()

    @property
    def logpath(self) -> str | None:
        """The file the history is streamed to, or ``None``."""
        return self._stream.path if self._stream is not None else None

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
            self._record(global_step, key, value)
        self._flush()

    def get_output(self) -> dict[int, dict[str, Any]]:
        """Return everything recorded so far as ``{step: {key: value}}``."""
        return self.history.to_dict()

    def write(self, logpath) -> str:
        """Write the history to ``logpath + ".json"`` (standard JSON).

        A bare file name writes to the working directory; missing parent directories
        are created. The file is replaced atomically.

        Returns:
            The path written.

        Raises:
            OSError: If the path cannot be written (the message names it and the
                fix); the history stays in memory, so call ``write`` again.
        """
        path = self.history.write_json(json_path(logpath))
        _LOG.info("Cockpit log written to %s", path)
        return path


def _as_step(global_step) -> int:
    """Return ``global_step`` as an int, or say how to pass it."""
    try:
        return operator.index(global_step)
    except TypeError:
        raise TypeError(
            f"global_step must be an int, got {global_step!r}. Fix: pass the "
            "iteration counter, e.g. cockpit(step, info=...) with step an int."
        ) from None
