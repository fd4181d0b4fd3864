"""A scaled backward pass (GradScaler, gradient accumulation): gradients unusable.

The gradient that reaches ``info["loss"]`` in the backward pass is 1 unless the
loss was scaled; the quantities that read gradients then have no value.
"""

from __future__ import annotations

import torch
from torch import Tensor

from cockpit.needs import Need
from cockpit.step.features.base import StepFeature, register_feature


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

    def __init__(self, run):
        super().__init__(run)
        self._seeds: list[Tensor] = []
        self._handle = None

    def before_backward(self) -> None:
        """Work before the user's backward pass (see the module)."""
        run = self.run
        loss = run.info.get("loss") if run.info.has("loss") else None
        if isinstance(loss, Tensor) and loss.requires_grad and run.plan.active:
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

    def after_backward(self) -> None:
        """Work after it, before tracking (see the module)."""
        self.close()
        scale = self.scale()
        if scale is None:
            return
        run, reason = self.run, scaled_reason(scale)
        for q in run.plan.active:
            if run.plan.needs_of(q) - {Need.PARAMETERS} or q.extensions(run.step):
                run.ledger.leave_out(q, reason, once=("scaled", q.key))

    def close(self) -> None:
        """Remove what the feature hooked."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
