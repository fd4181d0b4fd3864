"""Real training loops: what makes a quantity wrong at a step, and what to do then.

Training loops do things a quantity cannot see: gradient accumulation over
micro-batches, gradient clipping between the backward pass and ``optimizer.step()``,
an optimizer that updates other parameters than the cockpit tracks. Where that makes
a value wrong, :class:`LoopChecks` leaves the quantity out of the step and records it
as missing with the reason (under ``missing``), warning once with a
:class:`~cockpit.errors.CockpitWarning` that names the fix. It also records the
learning rate of every parameter group on tracked steps.
"""

from __future__ import annotations

import weakref
from typing import Sequence

import torch
from torch import Tensor

from cockpit.log.keys import LEARNING_RATES_KEY
from cockpit.needs import Need
from cockpit.quantities.base import Quantity
from cockpit.step.plan import StepPlan

#: Needs that read ``.grad`` or the optimizer's update, which gradient accumulation
#: changes (quantities with them are left out of an accumulating step).
READS_GRAD = frozenset(
    {Need.GRADIENT, Need.HESSIAN_VECTOR_PRODUCTS, Need.OPTIMIZER_UPDATE}
)

ACCUMULATION_REASON = (
    "gradients of earlier backward passes were in .grad when this step's backward "
    "began (gradient accumulation), so .grad is not this mini-batch's gradient. Fix: "
    "track the first micro-batch after optimizer.zero_grad() (its .grad starts at "
    "zero), or zero the gradients before every tracked backward"
)


def _learning_rate(value) -> float:
    return float(value.item() if hasattr(value, "item") else value)


def learning_rates(optimizer) -> list[float] | None:
    """The learning rate of every parameter group, or ``None`` if there is none."""
    groups = getattr(optimizer, "param_groups", None)
    if not groups or any("lr" not in group for group in groups):
        return None
    return [_learning_rate(group["lr"]) for group in groups]


def grads_accumulated(params: Sequence[Tensor]) -> bool:
    """Whether any ``.grad`` holds a non-zero value (one device sync, if any grad)."""
    grads = [p.grad.detach() for p in params if p.grad is not None]
    if not grads:
        return False
    with torch.no_grad():
        return bool(torch.stack([g.abs().amax() for g in grads if g.numel()]).max() > 0)


def optimizer_mismatch(optimizer, params: Sequence[Tensor]) -> str | None:
    """Describe how the optimizer's trainable parameters differ from ``params``."""
    groups = getattr(optimizer, "param_groups", None)
    if groups is None:
        return None
    theirs = {id(p) for g in groups for p in g["params"] if p.requires_grad}
    mine = {id(p) for p in params}
    if theirs == mine:
        return None
    extra, absent = len(theirs - mine), len(mine - theirs)
    return (
        f"the optimizer updates {extra} parameter(s) the cockpit does not track and "
        f"the cockpit tracks {absent} the optimizer does not update, so the update "
        "direction seen by the cockpit is not the step the optimizer takes. Fix: "
        "pass the same parameters to the Cockpit and to the optimizer"
    )


def grad_changed_message(count: int) -> str:
    """Why the update cockpit replayed is not the step taken (``.grad`` changed)."""
    return (
        f".grad of {count} parameter(s) changed between the backward pass and "
        "optimizer.step() (e.g. gradient clipping or a gradient scaler), so the "
        "update cockpit replayed is not the step taken. Fix: leave .grad unchanged "
        "on tracked steps (clip on untracked steps only), or drop Alpha"
    )


def grad_norms(params: Sequence[Tensor]) -> Tensor | None:
    """The norm of every ``.grad`` (no device sync), or ``None`` if one is missing."""
    grads = [p.grad for p in params]
    if any(g is None for g in grads) or not grads:
        return None
    with torch.no_grad():
        return torch.stack(
            [torch.linalg.vector_norm(g.detach()).to(grads[0].device) for g in grads]
        )


def _version(grad: Tensor | None) -> int | None:
    return None if grad is None else grad._version


class GradSnapshot:
    """What the ``.grad`` of some parameters held, to tell later if they changed.

    Taking it costs no device sync: it keeps each ``.grad`` object, its version
    counter and (on the device) its norm.

    Args:
        params: The parameters.
    """

    def __init__(self, params: Sequence[Tensor]):
        self.params = list(params)
        self._seen = [(p.grad, _version(p.grad)) for p in self.params]
        self._norms = grad_norms(self.params)

    def changed(self) -> int:
        """How many ``.grad`` changed in value since the snapshot.

        One that was not written to (same object, same version) has not; one that
        was is compared by its norm (one device sync): clipping below its threshold
        multiplies by exactly 1.0 and leaves the values, so the update, alone.
        """
        touched = [
            i
            for i, (p, (grad, version)) in enumerate(
                zip(self.params, self._seen, strict=True)
            )
            if p.grad is not grad or _version(p.grad) != version
        ]
        if not touched:
            return 0
        now = grad_norms(self.params)
        if now is None or self._norms is None or now.shape != self._norms.shape:
            return len(touched)
        index = torch.tensor(touched, device=now.device)
        return int((now[index] != self._norms[index]).sum())


class UpdateWatch:
    """Notices ``.grad`` changing between the backward pass and ``optimizer.step()``.

    Quantities that need the optimizer's update (Alpha) replay the update from the
    gradients the backward pass produced. Gradient clipping, a gradient scaler's
    unscale, or any other in-place change of ``.grad`` before ``optimizer.step()``
    makes the real update differ. A step pre-hook on the optimizer compares every
    ``.grad`` with what the step left (:class:`GradSnapshot`); on a change it calls
    ``on_change(reason)`` once.

    The optimizer holds the hook, and the hook holds ``on_change`` only weakly: a
    cockpit dropped between the backward pass and ``optimizer.step()`` is freed at
    once (with its log and checks), and its hook removes itself at that step.

    Args:
        optimizer: The optimizer of the step.
        params: The cockpit's parameters.
        on_change: A bound method, called with the reason when ``.grad`` was
            changed (if its object is still alive).
    """

    def __init__(self, optimizer, params: Sequence[Tensor], on_change):
        self._grads = GradSnapshot(params)
        self._on_change = weakref.WeakMethod(on_change)
        self._handle = optimizer.register_step_pre_hook(self._check)

    def _check(self, optimizer, args, kwargs) -> None:
        self.remove()
        on_change = self._on_change()
        if on_change is None:  # the cockpit is gone
            return
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
        if closure is not None:  # args[0] is the optimizer itself
            # optimizer.step(closure): the backward runs inside this call, after
            # this hook (Lightning's loop); this .grad belongs to the last step and
            # is no evidence about this one
            return
        changed = self._grads.changed()
        if changed:
            on_change(grad_changed_message(changed))

    def remove(self) -> None:
        """Stop watching (the optimizer did not step, or it has been checked)."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None


class LoopChecks:
    """The checks of a cockpit's steps against what the training loop does.

    Args:
        params: The cockpit's parameters.
        recorder: Where missing values are noted.
        diagnostics: For warnings given once.
    """

    def __init__(self, params: Sequence[Tensor], recorder, diagnostics):
        self._params = list(params)
        self._recorder = recorder
        self._diagnostics = diagnostics
        self._watch: UpdateWatch | None = None
        self._watched: tuple[int, list[Quantity]] | None = None

    def before(self, plan: StepPlan, step_info) -> StepPlan:
        """Return the plan without quantities that cannot be right at this step.

        Records the learning rate of every parameter group on tracked steps.
        Gradient accumulation (``.grad`` not zero when the backward begins) makes
        quantities that read ``.grad`` or the optimizer's update wrong; an optimizer
        that updates other parameters than the cockpit tracks makes the update
        wrong. Those quantities are recorded as missing, with the reason.
        """
        if self._watch is not None:  # the last step's optimizer.step() never came
            self._watch.remove()
            self._watch = self._watched = None
        if not plan.active:
            return plan
        step = plan.global_step
        optimizer = step_info.get("optimizer")
        rates = learning_rates(optimizer) if optimizer is not None else None
        if rates is not None and any(q.should_compute(step) for q in plan.active):
            self._recorder.record(step, LEARNING_RATES_KEY, rates)
        reasons: dict[Quantity, str] = {}
        if any(plan.needs_of(q) & READS_GRAD for q in plan.active):
            if grads_accumulated(self._params):
                for q in plan.active:
                    if plan.needs_of(q) & READS_GRAD:
                        reasons[q] = ACCUMULATION_REASON
        updating = _updating(plan)
        if updating and optimizer is not None:
            mismatch = optimizer_mismatch(optimizer, self._params)
            for q in updating if mismatch else ():
                reasons.setdefault(q, mismatch)
        if not reasons:
            return plan
        for q, reason in reasons.items():
            self._missing(q, step, reason)
        # re-planned without them: their extensions must not run either (a layer
        # routed to the autograd engine has no BackPACK rule to run)
        return plan.without(reasons)

    def after(self, plan: StepPlan, step_info) -> None:
        """Watch ``.grad`` until ``optimizer.step()`` if a quantity replays it."""
        step = plan.global_step
        updating = _updating(plan)
        optimizer = step_info.get("optimizer")
        if not updating or not hasattr(optimizer, "register_step_pre_hook"):
            return
        self._watched = (step, updating)
        self._watch = UpdateWatch(optimizer, self._params, self._grad_changed)

    def _grad_changed(self, reason: str) -> None:
        """The watched step's update is not the one replayed: drop its values."""
        if self._watched is None:
            return
        step, updating = self._watched
        for q in updating:
            if q.discard_start(step):
                self._missing(q, step, reason)
        self._recorder.flush()

    def close(self) -> None:
        """Stop watching the optimizer (the run ends or is restored)."""
        if self._watch is not None:
            self._watch.remove()
            self._watch = self._watched = None

    def _missing(self, quantity: Quantity, step: int, reason: str) -> None:
        """Record ``quantity`` as missing at ``step`` (and its pending start)."""
        steps = [step]
        if quantity.finishes(step):
            steps.append(step - 1)  # a two-step value that cannot be finished
        self._diagnostics.missing(
            self._recorder,
            steps,
            quantity.key,
            reason,
            once=("missing", quantity.key, reason),
        )


def _updating(plan: StepPlan) -> list[Quantity]:
    """The active quantities that replay the optimizer's update."""
    return [q for q in plan.active if Need.OPTIMIZER_UPDATE in plan.needs_of(q)]
