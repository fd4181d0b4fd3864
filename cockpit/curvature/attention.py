"""Attention whose backward pass can be differentiated: HVPs under fused attention.

``torch.nn.functional.scaled_dot_product_attention`` (the default attention of
current Hugging Face models, ``nn.MultiheadAttention`` and most hand-written GPTs)
runs a fused kernel (flash attention on the CPU; flash, memory-efficient or cuDNN on
a GPU) whose backward pass has no derivative, so Hessian-vector products through it
fail ("derivative for ..._backward is not implemented").

While a quantity that needs Hessian-vector products is part of a cockpit
(:func:`hold`), the function is wrapped: a call that records a graph and has no
attention dropout runs as :class:`_TwiceDifferentiable`, whose

* forward pass is the same fused kernel (same values, same memory),
* ordinary backward pass is that kernel's own backward (same gradients, bit for
  bit), and
* backward pass *with* ``create_graph=True`` (only on the steps where the cockpit
  asks for it, and in its own curvature passes) recomputes the attention with
  PyTorch's math kernel (``SDPBackend.MATH``) from the saved inputs and
  differentiates that, so its result carries a graph that can be differentiated
  again: the Hessian-vector products see the same function.

The user's forward pass is unchanged: no kernel switch, no extra memory on steps
without second derivatives. The cost of the math recomputation (``O(T^2)`` memory
per head for the attention matrix) is paid on curvature steps only.

Not wrapped (the call goes to PyTorch unchanged): calls without grad mode or without
an input that requires grad, calls inside ``torch.func`` transforms or while
compiling, tensor subclasses, and ``dropout_p > 0`` (the fused kernel's dropout mask
cannot be reproduced; PyTorch picks the math kernel for attention dropout on the CPU
anyway, whose graph has second derivatives). Code that bound the function before
the cockpit was made (``from torch.nn.functional import
scaled_dot_product_attention`` at import time) calls the original; its curvature is
then missing with the fix named.
"""

from __future__ import annotations

import functools
import threading
import weakref
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from cockpit.torch_state import in_transform

_ORIGINAL = F.scaled_dot_product_attention
_LOCK = threading.Lock()
_HOLDERS = 0


def _compiling() -> bool:
    compiler = getattr(torch, "compiler", None)
    return bool(compiler is not None and compiler.is_compiling())


def _math_attention(inputs, options: dict[str, Any]) -> Tensor:
    """PyTorch's math attention of ``inputs`` (a graph with second derivatives)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    query, key, value, mask = inputs
    with sdpa_kernel(SDPBackend.MATH):
        return _ORIGINAL(query, key, value, attn_mask=mask, **options)


class _TwiceDifferentiable(torch.autograd.Function):
    """Fused attention forward and backward; math attention under ``create_graph``."""

    @staticmethod
    def forward(ctx, query, key, value, mask, options):  # noqa: D102
        inputs = (query, key, value, mask)
        with torch.enable_grad():
            inner = [
                t.detach().requires_grad_(t.requires_grad) if t is not None else None
                for t in inputs
            ]
            output = _ORIGINAL(*inner[:3], attn_mask=inner[3], **options)
        ctx.options = options
        # the fused kernel's own graph, for the ordinary backward pass
        ctx.inner = (inner, output)
        ctx.save_for_backward(*inputs)
        return output.detach()

    @staticmethod
    def backward(ctx, grad_output):  # noqa: D102
        wanted = ctx.needs_input_grad[:4]
        if torch.is_grad_enabled():  # create_graph=True: a graph to differentiate
            inputs = ctx.saved_tensors
            with torch.enable_grad():
                output = _math_attention(inputs, ctx.options)
        else:
            inputs, output = ctx.inner
        sources = [t for t, w in zip(inputs, wanted) if w]
        grads = iter(
            torch.autograd.grad(
                output,
                sources,
                grad_output,
                retain_graph=True,  # freed with this node (the outer graph)
                create_graph=torch.is_grad_enabled(),
                allow_unused=True,
            )
        )
        return (*(next(grads) if w else None for w in wanted), None)


def _wrappable(tensors, dropout_p: float) -> bool:
    if dropout_p or not torch.is_grad_enabled() or in_transform() or _compiling():
        return False
    present = [t for t in tensors if t is not None]
    if any(type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter
           for t in present):  # fmt: skip
        return False
    if any(t.is_nested for t in present):
        return False
    return any(t.requires_grad for t in present)


@functools.wraps(_ORIGINAL)
def scaled_dot_product_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """``F.scaled_dot_product_attention`` whose backward pass can be differentiated."""
    if not _wrappable((query, key, value, attn_mask), dropout_p):
        return _ORIGINAL(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                         is_causal=is_causal, scale=scale,
                         enable_gqa=enable_gqa)  # fmt: skip
    options = {"is_causal": is_causal, "scale": scale, "enable_gqa": enable_gqa}
    return _TwiceDifferentiable.apply(query, key, value, attn_mask, options)


def _install() -> None:
    F.scaled_dot_product_attention = scaled_dot_product_attention


def _uninstall() -> None:
    if F.scaled_dot_product_attention is scaled_dot_product_attention:
        F.scaled_dot_product_attention = _ORIGINAL


def _release() -> None:
    global _HOLDERS
    with _LOCK:
        _HOLDERS -= 1
        if _HOLDERS == 0:
            _uninstall()


def hold(owner: object) -> None:
    """Keep the wrapper installed while ``owner`` lives (reference counted).

    Called by the quantities that need Hessian-vector products when a cockpit
    takes them; the original function is back once the last of them is freed.
    """
    global _HOLDERS
    with _LOCK:
        _HOLDERS += 1
        if _HOLDERS == 1:
            _install()
    weakref.finalize(owner, _release)


def active() -> bool:
    """Whether the wrapper is installed now."""
    return F.scaled_dot_product_attention is scaled_dot_product_attention
