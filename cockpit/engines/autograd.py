"""The autograd engine: exact per-sample gradients of any differentiable model.

Where BackPACK has no rule for a parameter (see :mod:`cockpit.engines.routing`), the
per-sample gradients ``g_i = d l_i / d theta`` come straight from PyTorch's autograd,
differentiating the per-sample losses ``info["individual_losses"]`` that the training
loop already passes. This runs when the step opens, before the user's
``loss.backward()`` frees the graph: one batched vector-Jacobian product per chunk of
samples (``torch.autograd.grad(..., is_grads_batched=True, retain_graph=True)``), so
the memory of the batched backward stays bounded by the chunk, and parameters are
processed in groups whose ``[N, *shape]`` results fit a budget.

Nothing here knows BackPACK: the results are handed to the quantities as
:class:`~cockpit.per_sample.DenseGradients` with ``scale=1`` through the same
:class:`~cockpit.param_view.ParamResults` path as BackPACK's.
"""

from __future__ import annotations

from typing import Iterator, Sequence

import torch
from torch import Tensor

from cockpit.engines.base import (
    AUTOGRAD,
    DEFAULT_MAX_ELEMENTS,
    PER_SAMPLE_BACKWARD,
    Engine,
    EngineStep,
    register_engine,
)
from cockpit.errors import quiet_warnings
from cockpit.param_view import ParamResults
from cockpit.per_sample import DenseGradients, sample_losses

#: Samples per batched backward pass (the memory of one chunk's backward grows with
#: it, about ``chunk * N * activations`` numbers in the worst case).
DEFAULT_CHUNK = 8
#: At most this many (sample, batch entry) pairs per batched backward pass: the
#: chunk shrinks to ``PAIRS // N`` samples (at least one) for large batches, so the
#: backward's memory stays that of about ``PAIRS`` samples' activations however
#: large ``N`` is. Measured on the ResNet-18 layout with BatchNorm (one thread):
#: at N=128, chunk 2 instead of 8 took 56.5 s instead of 59.5 s and 1018 MiB of
#: peak RSS instead of 1825 MiB (benchmarks/studies/batchnorm_cost.py has the method).
DEFAULT_PAIRS = 256

# vmap falls back to a (correct, slower) loop for operators without a batching rule
_VMAP_FALLBACK_WARNING = r".*There is a performance drop because we have not yet"


def parameter_groups(
    params: Sequence[Tensor], batch_size: int, max_elements: int
) -> list[list[int]]:
    """Split ``params`` (positions) into groups of at most ``max_elements`` results.

    A group holds at least one parameter, so a single parameter larger than the
    budget still gets a group of its own.
    """
    groups: list[list[int]] = []
    size = 0
    for position, param in enumerate(params):
        cost = batch_size * param.numel()
        if groups and size + cost <= max_elements:
            groups[-1].append(position)
            size += cost
        else:
            groups.append([position])
            size = cost
    return groups


def _chunk(losses: Tensor, params: Sequence[Tensor], start: int, stop: int):
    """``d losses[i] / d params`` for ``i`` in ``[start, stop)``, stacked."""
    n = losses.shape[0]
    rows = torch.arange(start, stop, device=losses.device)
    selector = torch.zeros(stop - start, n, dtype=losses.dtype, device=losses.device)
    selector[torch.arange(stop - start, device=losses.device), rows] = 1
    try:
        with quiet_warnings(_VMAP_FALLBACK_WARNING):
            return torch.autograd.grad(
                losses,
                params,
                grad_outputs=selector,
                retain_graph=True,
                allow_unused=True,
                is_grads_batched=True,
            )
    except RuntimeError as error:
        if "vmap" not in str(error) and "batch" not in str(error).lower():
            raise
    # an operator that vmap cannot batch at all: one backward per sample
    per_sample = [
        torch.autograd.grad(losses[i], params, retain_graph=True, allow_unused=True)
        for i in range(start, stop)
    ]
    return tuple(
        None if pieces[0] is None else torch.stack(pieces)
        for pieces in zip(*per_sample, strict=True)
    )


def chunk_size(n: int, chunk: int = DEFAULT_CHUNK, pairs: int = DEFAULT_PAIRS) -> int:
    """Samples per batched backward pass for a batch of ``n``.

    ``chunk``, or fewer for large batches: at most ``pairs // n``, at least one (see
    :data:`DEFAULT_PAIRS`).
    """
    return max(1, min(int(chunk), int(pairs) // max(1, n)))


def per_sample_gradients(
    individual_losses: Tensor,
    params: Sequence[Tensor],
    chunk: int = DEFAULT_CHUNK,
    max_elements: int = DEFAULT_MAX_ELEMENTS,
    pairs: int = DEFAULT_PAIRS,
) -> Iterator[tuple[int, Tensor]]:
    """Yield ``(position, g)`` with ``g[i] = d l_i / d params[position]``.

    The graph of ``individual_losses`` is kept (``retain_graph=True``) for the
    user's ``loss.backward()``. Results carry no autograd graph. A parameter the
    losses do not depend on gets zeros.

    Args:
        individual_losses: The per-sample losses ``l_i``, batch axis first, with
            their autograd graph.
        params: The parameters to differentiate.
        chunk: Samples per batched backward pass (at most).
        max_elements: Per-sample results held at once (see
            :data:`cockpit.engines.base.DEFAULT_MAX_ELEMENTS`).
        pairs: Bound on ``chunk * N`` (see :data:`DEFAULT_PAIRS`).

    Yields:
        One ``[N, *shape]`` tensor per parameter, group by group.
    """
    losses = sample_losses(individual_losses)
    n = losses.shape[0]
    chunk = chunk_size(n, chunk, pairs)
    for group in parameter_groups(params, n, max_elements):
        members = [params[i] for i in group]
        # the results are allocated once and filled chunk by chunk: keeping each
        # chunk's small result between the next chunks' large backward
        # temporaries fragmented the heap (peak RSS grew like N^2, measured by
        # benchmarks/any_model.py)
        out = [param.new_zeros((n, *param.shape)) for param in members]
        for start in range(0, n, chunk):
            stop = min(start + chunk, n)
            grads = _chunk(losses, members, start, stop)
            for k, grad in enumerate(grads):
                if grad is not None:
                    out[k][start:stop].copy_(grad.detach())
            del grads
        for k, position in enumerate(group):
            full, out[k] = out[k], None  # held by the consumer only
            yield position, full


@register_engine(order=300)
class AutogradEngine(Engine):
    """Exact per-sample gradients of any parameter: one batched backward per sample.

    Claims every parameter; it needs the per-sample losses with their graph.
    """

    name = AUTOGRAD
    needs_losses = True

    def before_backward(self, step: EngineStep, indices) -> dict[int, str]:
        """Differentiate each sample's loss through the whole batch."""
        params = [self.params[i] for i in indices]
        options = step.options
        for position, grads in per_sample_gradients(
            step.losses,
            params,
            options.get("chunk", DEFAULT_CHUNK),
            options.get("max_elements", DEFAULT_MAX_ELEMENTS),
            options.get("pairs", DEFAULT_PAIRS),
        ):
            index = indices[position]
            step.show(index, ParamResults(DenseGradients(grads, scale=1)))
        return {i: PER_SAMPLE_BACKWARD for i in indices}
