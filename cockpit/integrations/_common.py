"""Pieces shared by the framework integrations (no framework imports here)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shlex
import sys
import warnings
from typing import Any, Iterable, Sequence

import torch
from torch import Tensor
from torch.nn import Module
from torch.nn.modules.loss import _Loss

from cockpit.engines.backpack.api import extend
from cockpit.errors import CockpitWarning
from cockpit.needs import Need
from cockpit.quantities.base import Quantity
from cockpit.utils.configuration import configuration


def uninstall_torchvision_command() -> str:
    """The command that removes torchvision from the running Python's environment."""
    return f"{shlex.quote(sys.executable)} -m pip uninstall -y torchvision"


def check_torchvision(integration: str, framework: str) -> None:
    """Raise one clear ``ImportError`` if an installed torchvision cannot be imported.

    BackPACK depends on torchvision, so pip installs it next to cockpit, but the
    torchvision on PyPI is built for PyPI's CUDA torch and does not load next to a
    CPU build of the same torch (``RuntimeError: operator torchvision::nms does not
    exist``). cockpit and BackPACK train without it; Lightning (through
    torchmetrics) and transformers import it if it is installed, and then fail with
    that error. The integrations call this where importing their framework failed,
    so the user reads the fix instead of the framework's traceback.

    Args:
        integration: The cockpit module, for the message.
        framework: What imports torchvision, for the message.

    Returns:
        ``None`` if torchvision is not installed, already imported, or imports; the
        caller then re-raises its own error.

    Raises:
        ImportError: If torchvision is installed and importing it fails; the
            message names the error and the one command that fixes it.
    """
    if "torchvision" in sys.modules:  # imported already, or blocked (``None``)
        return
    try:
        if importlib.util.find_spec("torchvision") is None:
            return
    except (ImportError, ValueError):
        return
    try:
        import torchvision  # noqa: F401
    except Exception as error:
        problem = f"{type(error).__name__}: {error}"
    else:
        return

    def version(name: str) -> str:
        try:
            return " " + importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return ""

    installed = f"torchvision{version('torchvision')}"
    raise ImportError(
        f"{integration} cannot be used: the installed {installed} does not load "
        f"next to torch{version('torch')} ({problem}), and {framework} "
        "imports it. It came with BackPACK; cockpit and BackPACK train without it. "
        f"Fix: {uninstall_torchvision_command()}",
        name="torchvision",
    ) from None


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
    """Per-sample losses of a loss module's call, shape ``[N]``, with their graph.

    Runs the module's ``forward`` (no hooks, so BackPACK sees nothing of it) with
    ``reduction="none"`` on the same inputs and averages over all but the first
    (batch) dimension, so for a mean-reduced loss their mean is the loss (without
    class weights or ignored targets). No forward pass of the model runs again:
    the loss is evaluated once more on the logits.

    The losses keep their autograd graph (nothing backpropagates through it): the
    cockpit reads from it which parameters each sample's loss uses, checks the
    sample axis of every layer (a position embedding called with a batch of one,
    as BERT's, is not per-sample in BackPACK) and computes exact per-sample
    gradients where BackPACK has no rule (embeddings, LayerNorm, attention).
    """
    saved = module.reduction
    module.reduction = "none"
    try:
        losses = module.forward(*inputs)
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


def updated_named_parameters(
    model: Module, optimizers: Iterable[torch.optim.Optimizer]
) -> list[tuple[str, Tensor]]:
    """``(name, parameter)`` of what the optimizers update, in the model's order.

    The parameters that require gradients and sit in one of the optimizers' groups:
    the cockpit tracks exactly what training moves, so Alpha (which replays the
    optimizer's update) has its value and norms, tests and histograms describe the
    whole update. Parameters the optimizers hold outside the model are not named
    (the cockpit then says Alpha is missing, and why). Without optimizers: every
    trainable parameter.
    """
    optimizers = [getattr(o, "optimizer", o) for o in optimizers or ()]  # wrappers
    if not optimizers:
        return trainable_named_parameters(model)
    updated = {
        id(p)
        for optimizer in optimizers
        for group in optimizer.param_groups
        for p in group["params"]
    }
    return [(n, p) for n, p in trainable_named_parameters(model) if id(p) in updated]


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
