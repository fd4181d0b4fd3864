"""Pieces shared by the framework integrations (no framework imports here)."""

from __future__ import annotations

import os
import warnings
from typing import Any, Iterable, Sequence

import torch
from torch import Tensor
from torch.nn import Module
from torch.nn.modules.loss import _Loss

from cockpit.engines.backpack import extend
from cockpit.errors import CockpitWarning
from cockpit.needs import Need
from cockpit.quantities.base import Quantity
from cockpit.utils.configuration import configuration


def default_quantities(quantities: Iterable[Quantity] | None) -> list[Quantity]:
    """The given quantities, or ``configuration("economy")``."""
    return list(configuration("economy") if quantities is None else quantities)


def extend_for_backpack(model: Module) -> None:
    """``backpack.extend`` every leaf module of ``model`` (layers, activations, loss).

    Containers are left alone, the top module included: a framework's module
    (LightningModule, a Hugging Face model) may not compute in ``forward``, BackPACK
    has no rules for custom containers (second-order extensions would fail on
    them), and it stores ``module.output`` on every module it extends, which
    clashes with submodules named ``output``.
    """
    for module in model.modules():
        if module is not model and next(module.children(), None) is None:
            extend(module)


def loss_modules(model: Module) -> list[_Loss]:
    """The ``torch.nn`` loss modules inside ``model``."""
    return [m for m in model.modules() if isinstance(m, _Loss)]


def per_sample_losses(module: _Loss, inputs: Sequence[Any]) -> Tensor:
    """Per-sample losses of a loss module's call, shape ``[N]``, without a graph.

    Runs the module's ``forward`` (no hooks) on detached inputs with
    ``reduction="none"`` and averages over all but the first (batch) dimension,
    so for a mean-reduced loss their mean is the loss (without class weights or
    ignored targets).
    """
    saved = module.reduction
    detached = [x.detach() if isinstance(x, Tensor) else x for x in inputs]
    with torch.no_grad():
        module.reduction = "none"
        try:
            losses = module.forward(*detached)
        finally:
            module.reduction = saved
    if losses.dim() > 1:
        losses = losses.flatten(start_dim=1).mean(dim=1)
    return losses


class LossCapture:
    """Keeps the per-sample losses of every training-mode call of the loss modules.

    A forward hook on each loss module computes :func:`per_sample_losses` when
    the call happens with gradients enabled (training, not validation) while the
    capture is :attr:`armed`.
    """

    def __init__(self, modules: Sequence[_Loss]):
        self.modules = list(modules)
        self.armed = False
        self.captured: list[Tensor] = []
        self._handles = [m.register_forward_hook(self._hook) for m in self.modules]

    def _hook(self, module: _Loss, inputs, output) -> None:
        if self.armed and torch.is_grad_enabled():
            self.captured.append(per_sample_losses(module, inputs))

    def reset(self, armed: bool = True) -> None:
        """Forget earlier captures and start (or stop) capturing."""
        self.captured = []
        self.armed = armed

    def individual_losses(self) -> Tensor | None:
        """The per-sample losses of this step: the sum over the captured calls.

        A loss that adds several mean-reduced terms of one batch has the sum of
        their per-sample losses as its per-sample losses. ``None`` if nothing was
        captured or the captured batches differ in size.
        """
        if not self.captured:
            return None
        sizes = {losses.shape[0] for losses in self.captured}
        if len(sizes) != 1:
            return None
        return torch.stack(self.captured).sum(dim=0)

    def remove(self) -> None:
        """Remove the hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles = []


def trainable_named_parameters(model: Module) -> list[tuple[str, Tensor]]:
    """``(name, parameter)`` of every parameter that requires gradients."""
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def warn(message: str) -> None:
    """Issue a :class:`~cockpit.errors.CockpitWarning`."""
    warnings.warn(message, CockpitWarning, stacklevel=3)


def default_logpath(directory: str | os.PathLike | None) -> str:
    """``<directory>/cockpit`` (streamed to ``cockpit.jsonl``)."""
    return os.path.join(os.fspath(directory or "."), "cockpit")


def learning_rate(optimizer: torch.optim.Optimizer) -> float:
    """The learning rate of the optimizer's first parameter group."""
    return float(optimizer.param_groups[0]["lr"])


def replays_update(quantity: Quantity) -> bool:
    """Whether ``quantity`` replays the optimizer's update from ``.grad`` (Alpha).

    Its value started at a step is finished at the next one (``discard_start``).
    """
    return Need.OPTIMIZER_UPDATE in frozenset(quantity.needs) and hasattr(
        quantity, "discard_start"
    )


class ScaleNewGradients:
    """Multiplies (or divides) the gradients a coming backward pass adds by ``factor``.

    Made before the backward pass: a ``.grad`` that is ``None`` is scaled in place
    by :meth:`apply`; one that held values keeps them and gets the new part
    scaled.

    Args:
        params: The parameters whose gradients the backward pass adds to.
        factor: A number or a 0-dim tensor (on the gradients' device).
        divide: Divide by ``factor`` instead of multiplying (``g / k`` and
            ``g * (1 / k)`` can differ in the last bit).
    """

    def __init__(
        self, params: Iterable[Tensor], factor: float | Tensor, divide: bool = False
    ):
        self.factor = factor
        self.divide = divide
        self.before = [
            (p, None if p.grad is None else p.grad.detach().clone()) for p in params
        ]

    def _scale(self, grad: Tensor) -> Tensor:
        return grad.div_(self.factor) if self.divide else grad.mul_(self.factor)

    def apply(self) -> None:
        """Scale what the backward pass added (once, after it)."""
        with torch.no_grad():
            for p, old in self.before:
                if p.grad is None:
                    continue
                if old is None:
                    self._scale(p.grad)
                else:
                    self._scale(p.grad.sub_(old)).add_(old)
