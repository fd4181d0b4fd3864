"""Cockpit's own BackPACK rules: per-sample gradients and lean curvature diagonals.

Part of the BackPACK engine (:mod:`cockpit.engines.backpack.api` is its only user).

BackPACK's ``BatchGrad`` writes every layer's per-sample gradients ``b_i`` as one
``[N, *shape]`` tensor. For a ``torch.nn.Linear`` weight that tensor is a sum of outer
products, ``b_i = sum_l delta_il x_il^T`` (``x`` the layer input, ``delta`` the gradient
of the loss with respect to the layer output, ``l`` running over any extra axes between
batch and features), and most statistics quantities need are far cheaper from the two
factors than from the ``N * out * in`` materialised tensor:

================  =======================  ===================================
statistic         materialised tensor      factors (2-D inputs)
================  =======================  ===================================
``||b_i||^2``     ``N * out * in``         ``N * (out + in)``
``b_i . b_j``     ``N^2 * out * in``       ``N^2 * (out + in)``
``sum_i b_i**2``  ``N * out * in`` + copy  one ``[out, N] @ [N, in]`` product
``b_i . D``       ``N * out * in`` + copy  one ``[N, in] @ [in, out]`` product
================  =======================  ===================================

:class:`PerSampleGradients` is ``BatchGrad`` with the ``Linear`` rule replaced: the
weight's savefield holds a :class:`LinearFactors` object instead of a tensor, and the
per-sample tensor is built only if a quantity asks for it (e.g. a histogram of its
elements). ``Conv2d`` weights (zero padding, one group) get their per-sample gradients
from one batched product of the output gradient with the unfolded input, which on
CPUs is faster than BackPACK's convolution-based rule. Every other layer (other
convolutions, ...) uses BackPACK's own rule; normalisation layers (LayerNorm,
GroupNorm, RMSNorm, BatchNorm) get per-sample rules of cockpit's own.
The savefield is ``grad_batch`` as for ``BatchGrad``; the cockpit deletes it in its
extension hook, so users never see a factor object. Read the results through
:mod:`cockpit.engines.backpack.api`, which wraps both forms in the
:class:`~cockpit.per_sample.IndividualGradients` protocol.

The curvature diagonals (:func:`lean_diag_hessian`, :func:`lean_diag_ggn_exact`,
:func:`lean_diag_ggn_mc`) are BackPACK's extensions with one change: the diagonal of
a ``Conv2d`` weight, ``sum_{v,n} (S_vn U_n^T)**2`` (``S`` the backpropagated square
root of the loss Hessian with ``V`` columns, ``U_n`` the unfolded input of sample
``n``), is accumulated one column ``v`` at a time instead of from one
``[V, N, C_out, C_in*k*k]`` tensor, which on the 3c3d network is up to 570 MB for a
single layer.

All of these compute without recording an autograd graph: under
``loss.backward(create_graph=True)`` (which quantities such as ``HessMaxEV`` need),
BackPACK's results would otherwise carry graphs, and every intermediate tensor of
every layer's computation would stay alive until the end of the step.
"""

from __future__ import annotations

import torch
from backpack.extensions import (
    BatchGrad,
    BatchL2Grad,
    DiagGGNExact,
    DiagGGNMC,
    DiagHessian,
    SumGradSquared,
)
from backpack.extensions.backprop_extension import BackpropExtension
from backpack.extensions.firstorder.base import FirstOrderModuleExtension
from backpack.extensions.firstorder.batch_grad.conv2d import BatchGradConv2d
from backpack.extensions.secondorder.diag_ggn.conv2d import DiagGGNConv2d
from backpack.extensions.secondorder.diag_hessian.conv2d import DiagHConv2d
from backpack.utils import conv as conv_utils
from torch import Tensor
from torch.nn import (
    BatchNorm1d,
    BatchNorm2d,
    BatchNorm3d,
    Conv2d,
    Embedding,
    GroupNorm,
    LayerNorm,
    Linear,
    RMSNorm,
)
from torch.nn.functional import batch_norm, group_norm, layer_norm, rms_norm, unfold

from cockpit.per_sample import LinearFactors


class _NoGraph:
    """Wraps a BackPACK module extension so that it runs under ``torch.no_grad``."""

    def __init__(self, wrapped):
        self.wrapped = wrapped

    def __call__(self, extension, module, g_inp, g_out):
        with torch.no_grad():
            return self.wrapped(extension, module, g_inp, g_out)

    def __getattr__(self, name):
        return getattr(self.wrapped, name)


class SkipModules:
    """Wraps a BackPACK module extension so that it skips some modules.

    Attributes:
        skip: ``id`` of the modules to skip (their results come from elsewhere).
    """

    def __init__(self, wrapped, skip: set[int]):
        self.wrapped = wrapped
        self.skip = skip

    def __call__(self, extension, module, g_inp, g_out):
        """Run the wrapped rule unless ``module`` is skipped."""
        if id(module) in self.skip:
            return None
        return self.wrapped(extension, module, g_inp, g_out)

    def __getattr__(self, name):
        return getattr(self.wrapped, name)


#: What cockpit wraps BackPACK's rules in (each keeps the rule as ``wrapped``).
RULE_WRAPPERS = (_NoGraph, SkipModules)


def module_extension_table(extension: BackpropExtension) -> dict:
    """Return BackPACK's private module-type -> rule table of ``extension``.

    ``set_module_extension`` can add or replace a rule but not wrap every rule,
    which :func:`without_graph` needs; this is the one place that reads the table.
    """
    return extension._BackpropExtension__module_extensions


_SHARED_TABLES: dict[str, dict] = {}


def shared_rules(
    extension: BackpropExtension, name: str, customise
) -> BackpropExtension:
    """Give ``extension`` the rule table ``name``, built by ``customise`` only once.

    The first instance is customised (``customise(extension)``, then
    :func:`without_graph`) and its table kept; later instances copy that table.
    BackPACK's module extensions and cockpit's keep no state between calls, so
    instances may share them; each instance keeps its own table (``dict``), whose
    entries :func:`~cockpit.engines.backpack.api.leave_to_autograd` may replace.
    Returns the same object.
    """
    table = module_extension_table(extension)
    shared = _SHARED_TABLES.get(name)
    if shared is None:
        customise(extension)
        without_graph(extension)
        _SHARED_TABLES[name] = dict(table)
    else:
        table.clear()
        table.update(shared)
    return extension


def without_graph(extension: BackpropExtension) -> BackpropExtension:
    """Make every module extension of ``extension`` run under ``torch.no_grad``.

    Values are unchanged; they just carry no autograd graph (see the module
    docstring). Returns the same object.
    """
    table = module_extension_table(extension)
    for module_type, rule in list(table.items()):
        if not isinstance(rule, RULE_WRAPPERS):
            table[module_type] = _NoGraph(rule)
    return extension


class _FactoredLinear(FirstOrderModuleExtension):
    """``Linear``: keep the weight's per-sample gradients as factors."""

    def __init__(self):
        super().__init__(params=["bias", "weight"])

    def weight(self, ext, module: Linear, g_inp, g_out, bp_quantities) -> LinearFactors:
        """Return the factors ``(input, grad_output)`` of the weight's ``b_i``."""
        return LinearFactors(module.input0, g_out[0])

    def bias(self, ext, module: Linear, g_inp, g_out, bp_quantities) -> Tensor:
        """Return the bias's per-sample gradients ``sum_l delta_il``, ``[N, out]``."""
        grad_output = g_out[0].detach()
        if grad_output.dim() == 2:
            return grad_output
        return grad_output.sum(dim=tuple(range(1, grad_output.dim() - 1)))


class _UnfoldConv2d(FirstOrderModuleExtension):
    """``Conv2d``: ``b_i = delta_i @ unfold(x_i)^T`` as one batched product.

    Falls back to BackPACK's rule for grouped convolutions, string padding
    (``"same"``) and padding modes other than zeros.
    """

    def __init__(self):
        super().__init__(params=["bias", "weight"])
        self._fallback = BatchGradConv2d()

    @staticmethod
    def _supported(module: Conv2d) -> bool:
        return (
            module.groups == 1
            and module.padding_mode == "zeros"
            and not isinstance(module.padding, str)
        )

    def weight(self, ext, module: Conv2d, g_inp, g_out, bp_quantities) -> Tensor:
        """Return the weight's per-sample gradients, ``[N, *weight.shape]``."""
        if not self._supported(module):
            return self._fallback.weight(ext, module, g_inp, g_out, bp_quantities)
        columns = unfold(
            module.input0,
            module.kernel_size,
            dilation=module.dilation,
            padding=module.padding,
            stride=module.stride,
        )  # [N, C_in * k * k, P]
        delta = g_out[0].flatten(start_dim=2)  # [N, C_out, P]
        out = torch.bmm(delta, columns.transpose(1, 2))
        return out.reshape(delta.shape[0], *module.weight.shape)

    def bias(self, ext, module: Conv2d, g_inp, g_out, bp_quantities) -> Tensor:
        """Return the bias's per-sample gradients, ``[N, C_out]``."""
        return g_out[0].sum(dim=(2, 3))


def embedding_supported(module: Embedding) -> str | None:
    """Why cockpit's ``Embedding`` rules cannot handle ``module`` (``None``: they can).

    ``max_norm`` renormalises rows in the forward pass, ``scale_grad_by_freq``
    scales by counts over the whole mini-batch (samples mix) and sparse gradients
    are not dense per-sample tensors.
    """
    if module.max_norm is not None:
        return "max_norm is not supported"
    if module.scale_grad_by_freq:
        return "scale_grad_by_freq mixes samples"
    if module.sparse:
        return "sparse gradients are not supported"
    return None


def _embedding_factors(module: Embedding, g_out) -> tuple[Tensor, Tensor]:
    """Token ids ``[N, L]`` and output gradients ``[N, L, E]`` (padding masked)."""
    tokens = module.input0
    n = tokens.shape[0]
    delta = g_out[0].detach().reshape(n, -1, module.embedding_dim)
    tokens = tokens.reshape(n, -1)
    if module.padding_idx is not None:  # the padding row gets no gradient
        delta = delta * (tokens != module.padding_idx).unsqueeze(-1).to(delta.dtype)
    return tokens, delta


def embedding_per_sample(module: Embedding, g_out) -> Tensor:
    """Return ``b_i = sum_l e_{x_il} delta_il^T``, shape ``[N, V, E]``.

    BackPACK's rule builds a ``[V, N, L]`` one-hot tensor in the default dtype
    (float32, which fails for float64 models); here one ``scatter_add`` does it.
    """
    tokens, delta = _embedding_factors(module, g_out)
    n, _, width = delta.shape
    out = delta.new_zeros(n, module.num_embeddings, width)
    out.scatter_add_(1, tokens.unsqueeze(-1).expand(-1, -1, width), delta)
    return out


class _EmbeddingBatchGrad(FirstOrderModuleExtension):
    """``Embedding``: dense per-sample gradients by one ``scatter_add``."""

    supports = staticmethod(embedding_supported)

    def __init__(self):
        super().__init__(params=["weight"])

    def weight(self, ext, module, g_inp, g_out, bp_quantities) -> Tensor:
        """Return ``b_i``, ``[N, V, E]``."""
        return embedding_per_sample(module, g_out)


class _EmbeddingBatchL2(FirstOrderModuleExtension):
    """``Embedding``: ``||b_i||^2 = sum_{l,k} [x_il = x_ik] delta_il . delta_ik``."""

    supports = staticmethod(embedding_supported)

    def __init__(self):
        super().__init__(params=["weight"])

    def weight(self, ext, module, g_inp, g_out, bp_quantities) -> Tensor:
        """Return ``||b_i||^2``, ``[N]``, without building ``b_i``."""
        tokens, delta = _embedding_factors(module, g_out)
        same = (tokens.unsqueeze(2) == tokens.unsqueeze(1)).to(delta.dtype)
        return (same * torch.bmm(delta, delta.transpose(1, 2))).sum(dim=(1, 2))


class _EmbeddingSumGradSquared(FirstOrderModuleExtension):
    """``Embedding``: ``sum_i b_i**2`` from the per-sample gradients."""

    supports = staticmethod(embedding_supported)

    def __init__(self):
        super().__init__(params=["weight"])

    def weight(self, ext, module, g_inp, g_out, bp_quantities) -> Tensor:
        """Return ``sum_i b_i**2``, ``[V, E]``."""
        return embedding_per_sample(module, g_out).square_().sum(0)


# --- normalisation layers ------------------------------------------------------------
#: Normalisation layers with cockpit rules (BackPACK has none for the first three;
#: its BatchNorm rules refuse ``BatchL2Grad`` and ``SumGradSquared`` in train mode).
BATCH_NORMS = (BatchNorm1d, BatchNorm2d, BatchNorm3d)
NORM_LAYERS = (LayerNorm, GroupNorm, RMSNorm, *BATCH_NORMS)


def _normalised(module, x: Tensor) -> Tensor:
    """The layer's input, normalised, before the affine weight and bias."""
    if isinstance(module, GroupNorm):
        return group_norm(x, module.num_groups, None, None, module.eps)
    if isinstance(module, BATCH_NORMS):
        # as the layer's forward: the mini-batch's statistics in train mode (or
        # without running statistics), the running ones otherwise; nothing updated
        running = module.running_mean is not None and not module.training
        return batch_norm(
            x,
            module.running_mean if running else None,
            module.running_var if running else None,
            training=not running,
            eps=module.eps,
        )
    if isinstance(module, LayerNorm):
        return layer_norm(x, module.normalized_shape, None, None, module.eps)
    return rms_norm(x, module.normalized_shape, None, module.eps)


def norm_per_sample(module, g_out, name: str) -> Tensor:
    """Per-sample gradients ``b_i`` of a normalisation layer's ``weight`` or ``bias``.

    ``y = x_hat * w + b`` elementwise (``w``, ``b`` broadcast over the batch and
    the axes they do not cover), so ``b_i`` sums ``delta * x_hat`` (weight) or
    ``delta`` (bias) over those axes of sample ``i``; ``x_hat`` is recomputed from
    the stored input. Shape ``[N, *param.shape]``.
    """
    delta = g_out[0].detach()
    if name == "weight":
        delta = delta * _normalised(module, module.input0.detach())
    if isinstance(module, (GroupNorm, *BATCH_NORMS)):  # [N, C, *spatial] -> [N, C]
        return delta.sum(dim=tuple(range(2, delta.dim()))) if delta.dim() > 2 else delta
    kept = len(module.normalized_shape)  # trailing axes, after the batch and others
    axes = tuple(range(1, delta.dim() - kept))
    return delta.sum(dim=axes) if axes else delta


class _NormRule(FirstOrderModuleExtension):
    """Normalisation layers: per-sample results from the input and ``delta``.

    For a BatchNorm layer in train mode these are ``d l_i / d theta`` of its weight
    and bias where no later layer mixes the samples (``x_hat`` depends on the
    weight and bias of no layer before: ``delta_i`` is ``d l_i / d y_i`` then); the
    routing sends the parameters before any train-mode BatchNorm to autograd.

    Args:
        reduce: What to save: ``"batch"`` (``b_i``), ``"l2"`` (``||b_i||^2``) or
            ``"sgs"`` (``sum_i b_i**2``).
        params: The layer's parameter names (RMSNorm has no bias).
    """

    def __init__(self, reduce: str, params: list[str]):
        super().__init__(params=params)
        self._reduce = reduce

    def _result(self, per_sample: Tensor) -> Tensor:
        if self._reduce == "l2":
            return per_sample.flatten(start_dim=1).square().sum(1)
        if self._reduce == "sgs":
            return per_sample.square().sum(0)
        return per_sample

    def weight(self, ext, module, g_inp, g_out, bp_quantities) -> Tensor:
        """The weight's result."""
        return self._result(norm_per_sample(module, g_out, "weight"))

    def bias(self, ext, module, g_inp, g_out, bp_quantities) -> Tensor:
        """The bias's result."""
        return self._result(norm_per_sample(module, g_out, "bias"))


def _with_norm_rules(extension: BackpropExtension, reduce: str) -> None:
    for layer in NORM_LAYERS:
        params = ["weight"] if layer is RMSNorm else ["weight", "bias"]
        extension.set_module_extension(layer, _NormRule(reduce, params), overwrite=True)


def lean_batch_l2() -> BatchL2Grad:
    """Return BackPACK's ``BatchL2Grad`` with cockpit's Embedding and norm rules."""
    return shared_rules(BatchL2Grad(), "batch_l2", _lean_batch_l2_rules)


def _lean_batch_l2_rules(extension: BatchL2Grad) -> None:
    extension.set_module_extension(Embedding, _EmbeddingBatchL2(), overwrite=True)
    _with_norm_rules(extension, "l2")


def lean_sum_grad_squared() -> SumGradSquared:
    """Return BackPACK's ``SumGradSquared`` with cockpit's Embedding and norm rules."""
    return shared_rules(SumGradSquared(), "sum_grad_squared", _lean_sgs_rules)


def _lean_sgs_rules(extension: SumGradSquared) -> None:
    extension.set_module_extension(
        Embedding, _EmbeddingSumGradSquared(), overwrite=True
    )
    _with_norm_rules(extension, "sgs")


class PerSampleGradients(BatchGrad):
    """``BatchGrad`` whose ``Linear`` weights keep factors instead of a tensor.

    ``Conv2d`` layers use a faster rule (see the module docstring); the values are
    those of ``BatchGrad`` up to floating-point rounding.

    Results are written to the savefield ``grad_batch`` as ``BatchGrad``'s are: a
    ``[N, *shape]`` tensor (scaled as BackPACK's) for every parameter except weights
    of ``torch.nn.Linear`` layers, which hold a :class:`LinearFactors` object. Use it
    only through the cockpit, whose extension hook reads and deletes the results.
    """

    def __init__(self):
        super().__init__()
        shared_rules(self, "per_sample", PerSampleGradients._rules)

    @staticmethod
    def _rules(extension: BatchGrad) -> None:
        extension.set_module_extension(Linear, _FactoredLinear(), overwrite=True)
        extension.set_module_extension(Conv2d, _UnfoldConv2d(), overwrite=True)
        extension.set_module_extension(Embedding, _EmbeddingBatchGrad(), overwrite=True)
        _with_norm_rules(extension, "batch")

    @staticmethod
    def served_by(other: BackpropExtension) -> bool:
        """Whether ``other`` gives everything this extension gives.

        A plain ``BatchGrad()`` (no subsampling) writes the materialised tensors to the
        same savefield, which the cockpit reads just as well.
        """
        return type(other) is BatchGrad and other.get_subsampling() is None


# --- curvature diagonals ------------------------------------------------------------
def conv2d_weight_diagonal(module: Conv2d, sqrt_matrix: Tensor) -> Tensor:
    """Return ``sum_{v,n} (S_vn U_n^T)**2``, the weight diagonal of a ``Conv2d``.

    Args:
        module: The layer (``input0`` is read; one group).
        sqrt_matrix: ``S``, shape ``[V, N, C_out, H_out, W_out]``.

    Returns:
        A tensor of the weight's shape. Only one ``[N, C_out, C_in * k * k]`` block
        exists at a time.
    """
    columns = conv_utils.unfold_input(module, module.input0)  # [N, C_in*k*k, P]
    columns_t = columns.transpose(1, 2)
    v, n = sqrt_matrix.shape[:2]
    s = sqrt_matrix.reshape(v, n, module.out_channels, -1)
    diagonal = torch.zeros(
        module.out_channels,
        columns.shape[1],
        device=columns.device,
        dtype=columns.dtype,
    )
    for column in s:
        block = torch.bmm(column, columns_t)  # [N, C_out, C_in*k*k]
        diagonal += block.square_().sum(0)
    return diagonal.reshape(module.weight.shape)


def _lean(module: Conv2d) -> bool:
    return module.groups == 1


class _LeanDiagHConv2d(DiagHConv2d):
    """``Conv2d`` rule of :class:`LeanDiagHessian`."""

    def weight(self, ext, module, g_inp, g_out, backproped):
        """Sum the signed weight diagonals of every backpropagated square root."""
        if not _lean(module):
            return super().weight(ext, module, g_inp, g_out, backproped)
        diagonal = torch.zeros_like(module.weight)
        for matrix, sign in zip(backproped["matrices"], backproped["signs"]):
            diagonal.add_(conv2d_weight_diagonal(module, matrix), alpha=sign)
        return diagonal


class _LeanDiagGGNConv2d(DiagGGNConv2d):
    """``Conv2d`` rule of :class:`LeanDiagGGNExact` and :class:`LeanDiagGGNMC`."""

    def weight(self, ext, module, g_inp, g_out, backproped):
        """The weight diagonal of the backpropagated square root."""
        if not _lean(module):
            return super().weight(ext, module, g_inp, g_out, backproped)
        return conv2d_weight_diagonal(module, backproped)


def _lean_conv(rule: type):
    """A customisation that gives an extension the lean ``Conv2d`` rule ``rule``."""

    def customise(extension: BackpropExtension) -> None:
        extension.set_module_extension(Conv2d, rule(), overwrite=True)

    return customise


def lean_diag_hessian() -> DiagHessian:
    """Return BackPACK's ``DiagHessian`` with the memory-lean ``Conv2d`` weight rule.

    The object is a plain ``DiagHessian`` (type and settings unchanged), so it merges
    with one the user passes.
    """
    return shared_rules(DiagHessian(), "diag_hessian", _lean_conv(_LeanDiagHConv2d))


def lean_diag_ggn_exact() -> DiagGGNExact:
    """Return BackPACK's ``DiagGGNExact`` with the memory-lean ``Conv2d`` rule."""
    return shared_rules(DiagGGNExact(), "diag_ggn", _lean_conv(_LeanDiagGGNConv2d))


def lean_diag_ggn_mc(mc_samples: int = 1) -> DiagGGNMC:
    """Return BackPACK's ``DiagGGNMC`` with the memory-lean ``Conv2d`` rule.

    Args:
        mc_samples: Monte-Carlo samples of the loss Hessian.
    """
    extension = DiagGGNMC(mc_samples=mc_samples)
    return shared_rules(extension, "diag_ggn_mc", _lean_conv(_LeanDiagGGNConv2d))
