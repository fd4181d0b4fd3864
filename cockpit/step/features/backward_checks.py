"""The checks of the user's backward pass, after it and before any tracking.

Built-in step features, in the order they run (each sets its ``order``):

* :class:`RepeatedBackward`: several backward passes inside one tracked step leave
  per-sample results of one and ``.grad`` of several: the step has no values, one
  warning;
* :class:`NonFinite`: a non-finite loss or gradient is recorded under
  ``nonfinite`` and training goes on; on such a step a quantity that fails is
  recorded as missing (with the reason) instead of stopping the training loop;
* :class:`LossScale`: the gradient that reaches ``info["loss"]`` in the backward
  pass is 1 unless the loss was scaled (a GradScaler, gradient accumulation); the
  quantities that read gradients then have no value;
* :class:`EngineChecks`: each engine that ran checks its own work
  (:meth:`cockpit.engines.base.Engine.after_backward`);
* :class:`Unreached`: parameters no engine reached; unused ones read as exact
  zeros, others fail;
* :class:`Failures`: errors of quantities inside the backward pass are kept
  (:class:`Guarded`) instead of aborting the user's ``loss.backward()``; after it,
  a finite step re-raises the first (a bug), and a non-finite step records the
  quantity as missing with the reason.
"""

from __future__ import annotations

import torch
from torch import Tensor

from cockpit.engines.base import Engine, zero_results
from cockpit.log.keys import NONFINITE_KEY
from cockpit.needs import Need
from cockpit.quantities.base import Quantity
from cockpit.step.features.base import STOP, StepFeature, register_feature
from cockpit.step.state import Produced

REPEATED = (
    "several backward passes ran inside one tracked step, so the per-sample "
    "results and .grad describe different mini-batches"
)
_WARNING = (
    f"A tracked step had no values: {REPEATED}. Fix: call loss.backward() once "
    "inside `with cockpit(step, ...)`; accumulate micro-batches outside tracked "
    "steps, or track one micro-batch per optimizer step. (Recorded under "
    "'missing'; warned once.)"
)


@register_feature
class RepeatedBackward(StepFeature):
    """Per-sample results of one backward pass and ``.grad`` of several: stop."""

    order = 10

    def after_backward(self, produced):
        """Work after it, before tracking (see the module)."""
        state = self.state
        if not state.dispatcher.repeated:
            return None
        state.ledger.leave_out(list(state.plan.active), REPEATED, once=False)
        state.checks.warn_once("repeated-backward", _WARNING)
        return STOP


#: What a non-finite step hands on: quantities that fail are left out.
_TOLERANT = Produced(tolerant=True)


@register_feature
class NonFinite(StepFeature):
    """Check the loss and gradients once; make the step tolerant if not finite."""

    order = 20

    def after_backward(self, produced) -> Produced | None:
        """Work after it, before tracking (see the module)."""
        state = self.state
        found = state.checks.nonfinite(state.info)
        if not found:
            return None
        state.recorder.record(state.step, NONFINITE_KEY, found)
        return _TOLERANT


def failed_reason(step: int, error: Exception) -> str:
    """Why a quantity that failed on the non-finite ``step`` has no value."""
    return (
        f"it failed on the non-finite step {step} ({type(error).__name__}: "
        f"{error}); training goes on. Fix: see the warning about non-finite values"
    )


def scaled_reason(scale: float) -> str:
    """Why gradients of a backward pass scaled by ``scale`` are not the loss's."""
    return (
        f"the backward pass differentiated {scale:.6g} times info['loss'] (a "
        "GradScaler's scaled loss, or a loss divided for gradient accumulation), so "
        f".grad and the per-sample gradients are {scale:.6g} times the gradients of "
        "the loss. Fix: on tracked steps call loss.backward() on the unscaled "
        "mean loss (instead of scaler.scale(loss).backward() and "
        "scaler.step(optimizer): loss.backward() and optimizer.step(); bfloat16 "
        "autocast needs no GradScaler), and accumulate micro-batches outside "
        "tracked steps"
    )


@register_feature
class LossScale(StepFeature):
    """Catch the backward pass's seed at ``info["loss"]``; drop what it scaled."""

    order = 30

    def __init__(self, state):
        super().__init__(state)
        self._seeds: list[Tensor] = []
        self._handle = None

    def before_backward(self) -> None:
        """Work before the user's backward pass (see the module)."""
        state = self.state
        loss = state.info.get("loss")
        if isinstance(loss, Tensor) and loss.requires_grad and state.plan.active:
            self._handle = loss.register_hook(self._seen)

    def _seen(self, grad: Tensor) -> None:
        self._seeds.append(grad.detach().reshape(-1)[:1].clone())

    def scale(self) -> float | None:
        """The factor the backward pass scaled ``info["loss"]`` by (``None``: 1)."""
        if not self._seeds:
            return None
        seeds = torch.cat([s.to(torch.float64) for s in self._seeds])
        if bool((seeds == 1).all()):
            return None
        return float(seeds[seeds != 1][0])

    def after_backward(self, produced) -> None:
        """Work after it, before tracking (see the module)."""
        self.close()
        scale = self.scale()
        if scale is None:
            return
        state, reason = self.state, scaled_reason(scale)
        for q in state.plan.active:
            if state.plan.needs_of(q) - {Need.PARAMETERS} or q.extensions(state.step):
                state.ledger.leave_out(q, reason, once=("scaled", q.key))

    def close(self) -> None:
        """Remove what the feature hooked."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None


@register_feature
class EngineChecks(StepFeature):
    """E.g. BackPACK names a layer it skipped although the quantities need it."""

    order = 35

    def after_backward(self, produced) -> None:
        """Work after it, before tracking (see the module)."""
        for engine in self.state.engines:
            if type(engine).after_backward is not Engine.after_backward:
                engine.after_backward(self.state.engine)


@register_feature
class Unreached(StepFeature):
    """Show unused parameters with zero results; name unextended modules."""

    order = 40

    def before_backward(self) -> None:
        """Work before the user's backward pass (see the module)."""
        params = self.state.params
        self._before = [
            (p.grad, p.grad._version if p.grad is not None else None) for p in params
        ]

    def after_backward(self, produced) -> None:
        """Work after it, before tracking (see the module)."""
        state = self.state
        unused = state.checks.unreached(state.plan, state.dispatcher, self._before)
        batch_size = state.dispatcher.batch_size
        if batch_size is None and state.info.has("batch_size"):
            batch_size = int(state.info.get("batch_size"))
        for index in unused:
            results = zero_results(state.engines, index, batch_size)
            state.dispatcher.show(index, state.params[index], results)


class Guarded:
    """Runs a quantity's ``accumulate`` and keeps its first error for later."""

    __slots__ = ("quantity", "error")

    def __init__(self, quantity: Quantity):
        self.quantity = quantity
        self.error: Exception | None = None

    def accumulate(self, global_step: int, view) -> None:
        """Read one parameter's results; keep the first error."""
        if self.error is not None:
            return
        try:
            self.quantity.accumulate(global_step, view)
        except Exception as error:  # re-raised after the backward
            self.error = error


@register_feature
class Failures(StepFeature):
    """Raise the first failure of a finite step; leave out those of others."""

    order = 50

    def after_backward(self, produced) -> None:
        """Work after it, before tracking (see the module)."""
        state = self.state
        failed = [
            g
            for g in produced.guards
            if g.error is not None and not state.ledger.out(g.quantity)
        ]
        if failed and not produced.tolerant:
            raise failed[0].error
        for guard in failed:
            state.ledger.leave_out(
                guard.quantity,
                failed_reason(state.step, guard.error),
                once=("dropped", guard.quantity.key),
            )
