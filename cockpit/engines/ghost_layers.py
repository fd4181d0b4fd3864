"""The ghost engine's layer rules: per-sample terms from a layer's input and output.

Each rule (a :class:`Layer`) says, for one kind of module, how sample ``i``'s
gradient of each of its parameters follows from the module's input ``x`` and the
gradient ``delta`` that reached its output (see :mod:`cockpit.engines.ghost`). A
rule registers itself with :func:`register_layer` (by exact module type, or with a
``match`` predicate for classes of other libraries, e.g. Hugging Face's
``Conv1D``), as opacus' grad samplers do; :func:`layer_of` finds the rule of a
module (looking through FSDP2's ``FSDP<Class>`` types).
"""

from __future__ import annotations

import sys
from typing import Callable

import torch
from torch import Tensor
from torch.nn import Module

from cockpit.per_sample import OuterTerm


def exact_type(module: Module) -> type:
    """``module``'s type; for FSDP2's ``FSDP<Class>`` (``fully_shard``), the class.

    ``fully_shard`` swaps a module's class for ``(FSDPModule, Class)``, whose
    forward is the class's own (FSDP's unshard and reshard run in hooks around it).
    """
    cls = type(module)
    bases = cls.__bases__
    if len(bases) == 2 and bases[0].__name__ == "FSDPModule":
        return bases[1]
    return cls


#: Exact module types served, with their rules (:func:`register_layer`).
LAYERS: dict[type, Layer] = {}
#: ``(match, rule)`` for modules found by a test, asked in order after :data:`LAYERS`.
MATCHERS: list[tuple[Callable[[Module], bool], Layer]] = []


def register_layer(*types: type, match: Callable[[Module], bool] | None = None):
    """Class decorator: serve these module types with this :class:`Layer` rule.

    Like opacus' ``register_grad_sampler``: each rule registers itself, a new
    layer type is a new rule, not a branch in the engine.

    Args:
        types: Module classes served (their exact type, not subclasses).
        match: For modules no type names (e.g. another library's), a test on the
            module; asked after the types, in the order rules registered.
    """

    def add(cls):
        layer = cls()
        for kind in types:
            LAYERS[kind] = layer
        if match is not None:
            MATCHERS.append((match, layer))
        return cls

    return add


class Layer:
    """How one layer type's per-sample gradients follow from input and ``delta``.

    Subclasses name the parameters they serve and the input argument, check the
    module's settings (:meth:`problem`) and build each parameter's term
    (:meth:`term`): an :class:`~cockpit.per_sample.OuterTerm` for a weight, or a
    dense ``[N, *shape]`` tensor, both in units of the mean loss (``g_i / N``).
    """

    params: tuple[str, ...] = ()
    input_name = "input"
    #: Whether each call is checked against the rule's formula (:meth:`fits`).
    checked = False

    def problem(self, module: Module) -> str | None:
        """Why the formulas do not cover this module's settings (``None``: they do)."""
        return None

    def fits(self, module: Module, x: Tensor, output: Tensor) -> bool:
        """Whether this call's output is what the formula assumes (``checked``)."""
        return True

    def term(self, module: Module, attribute: str, x: Tensor, delta: Tensor):
        """The parameter's per-sample term of one call (see the class)."""
        raise NotImplementedError


def _sequences(tensor: Tensor, width: int | None = None) -> Tensor:
    """``[N, *, width]`` as ``[N, T, width]`` (``width``: the last axis by default)."""
    n = tensor.shape[0]
    return tensor.reshape(n, -1, tensor.shape[-1] if width is None else width)


@register_layer(torch.nn.Linear)
class LinearLayer(Layer):
    """``nn.Linear``: ``y = x W^T + b``, weight ``[out, in]``."""

    params = ("weight", "bias")

    def term(self, module, attribute, x, delta):
        """Weight: rows ``delta``, columns ``x``; bias: ``sum_t delta``."""
        if attribute == "bias":
            return _sequences(delta).sum(1)
        return OuterTerm(_sequences(delta), _sequences(x))


def _is_conv1d(module: Module) -> bool:
    """Hugging Face's ``Conv1D`` (looked up only where transformers is imported)."""
    pytorch_utils = sys.modules.get("transformers.pytorch_utils")
    conv1d = getattr(pytorch_utils, "Conv1D", None)
    return conv1d is not None and exact_type(module) is conv1d


@register_layer(match=_is_conv1d)
class Conv1DLayer(Layer):
    """Hugging Face's ``Conv1D``: ``y = x W + b``, weight ``[in, out]``."""

    params = ("weight", "bias")
    input_name = "x"

    def term(self, module, attribute, x, delta):
        """Weight: rows ``x``, columns ``delta``; bias: ``sum_t delta``."""
        if attribute == "bias":
            return _sequences(delta).sum(1)
        return OuterTerm(_sequences(x), _sequences(delta))


@register_layer(torch.nn.Embedding)
class EmbeddingLayer(Layer):
    """``nn.Embedding``: rows of the table picked by the indices."""

    params = ("weight",)

    def problem(self, module):
        """Settings whose gradient is not the one-hot sum (or changes the table)."""
        if module.max_norm is not None:
            return "max_norm renormalises the table in the forward pass"
        if module.scale_grad_by_freq:
            return "scale_grad_by_freq scales by counts over the whole batch"
        if module.sparse:
            return "sparse gradients"
        return None

    def term(self, module, attribute, x, delta):
        """One-hot rows (the indices), columns ``delta``; the padding row gets none."""
        n = delta.shape[0]
        indices = x.reshape(n, -1)
        cols = _sequences(delta)
        if module.padding_idx is not None:
            cols = cols * (indices != module.padding_idx).unsqueeze(-1).to(cols.dtype)
        return OuterTerm(indices, cols, num_rows=module.num_embeddings)


@register_layer(torch.nn.LayerNorm, *filter(None, [getattr(torch.nn, "RMSNorm", None)]))
class NormLayer(Layer):
    """``nn.LayerNorm`` and ``nn.RMSNorm``: ``y = x_hat * w (+ b)`` elementwise."""

    params = ("weight", "bias")

    def problem(self, module):
        """Only with elementwise affine parameters (else there is nothing to serve)."""
        if not getattr(module, "elementwise_affine", True):
            return "no elementwise affine parameters"
        return None

    @staticmethod
    def normalised(module: Module, x: Tensor) -> Tensor:
        """``x_hat``, recomputed as the layer computes it."""
        shape = tuple(module.normalized_shape)
        if isinstance(module, torch.nn.LayerNorm):
            return torch.nn.functional.layer_norm(x, shape, None, None, module.eps)
        return torch.nn.functional.rms_norm(x, shape, None, module.eps)

    def term(self, module, attribute, x, delta):
        """``sum_t delta * x_hat`` (weight) or ``sum_t delta`` (bias), per sample."""
        if attribute == "weight":
            delta = delta * self.normalised(module, x.detach())
        kept = len(tuple(module.normalized_shape))
        axes = tuple(range(1, delta.dim() - kept))
        return delta.sum(dim=axes) if axes else delta


def _is_scale_norm(module: Module) -> bool:
    """A childless ``*RMSNorm`` / ``*LayerNorm`` with the one parameter ``weight``."""
    if not exact_type(module).__name__.endswith(("RMSNorm", "LayerNorm")):
        return False
    if module._modules:
        return False
    own = list(module._parameters.items())
    return [n for n, _ in own] == ["weight"] and own[0][1] is not None


@register_layer(match=_is_scale_norm)
class ScaleLayer(Layer):
    """Another library's normalisation layer: ``y = w * f(x)`` elementwise.

    Hugging Face's ``LlamaRMSNorm`` and ``T5LayerNorm``, for example: a module
    whose class name ends in ``RMSNorm`` or ``LayerNorm``, with the one parameter
    ``weight`` and no children. ``f(x)`` is the module's own ``forward`` with the
    weight set to ones (no hooks run); the engine serves it only after checking,
    for each module and input shape, that its output equals ``w * f(x)`` to
    rounding (:meth:`GhostEngine.record`), so ``(1 + w) * f(x)`` and the like go
    to the other engines.
    """

    params = ("weight",)
    checked = True

    @staticmethod
    def base(module: Module, x: Tensor) -> Tensor:
        """``f(x)``: the module's forward with its weight set to ones."""
        weight = module._parameters["weight"]
        module._parameters["weight"] = torch.ones_like(weight.detach())
        try:
            with torch.no_grad():
                return module.forward(x)
        finally:
            module._parameters["weight"] = weight

    def fits(self, module: Module, x: Tensor, output: Tensor) -> bool:
        """Whether ``output == weight * f(x)`` to rounding."""
        with torch.no_grad():
            want = module.weight * self.base(module, x)
            if want.shape != output.shape or want.dtype != output.dtype:
                return False
            eps = torch.finfo(output.dtype).eps
            return bool(torch.allclose(output, want, rtol=8 * eps, atol=0.0))

    def term(self, module, attribute, x, delta):
        """``sum_t delta * f(x)``, per sample."""
        delta = delta * self.base(module, x)
        axes = tuple(range(1, delta.dim() - module.weight.dim()))
        return delta.sum(dim=axes) if axes else delta


def layer_of(module: Module) -> Layer | None:
    """The rule of ``module`` (its exact type's, else the first that matches)."""
    layer = LAYERS.get(exact_type(module))
    if layer is not None:
        return layer
    for match, rule in MATCHERS:
        if match(module):
            return rule
    return None
