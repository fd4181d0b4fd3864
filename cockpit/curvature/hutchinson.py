"""Hutchinson's unbiased estimate of a Hessian's diagonal and block traces.

The estimator sees ``H`` only through ``hvp(v) = H v`` on flat vectors (all
parameters concatenated; :func:`cockpit.curvature.lanczos.make_hvp`) and returns a
:class:`TraceEstimate`: a diagonal estimate per parameter and, per probe, the
traces of the parameter blocks, whose mean over the probes is the estimate and
whose spread gives its standard error (:func:`trace_errors`; the parameters share
the probes, so the error of the summed trace is the spread of the per-probe sums,
:func:`sum_error`).

:func:`hutchinson` uses ``z * (H z)`` with Rademacher ``z`` (Hutchinson 1989). The
variance of a block's trace is ``2 sum_{d != e} H_de**2`` over the block's rows
``d`` and all columns ``e``: the off-diagonal mass of the rows.
:func:`hessian_diagonal` is the step's estimate of the mean loss's Hessian from
the per-sample losses (what a tracked step computes where BackPACK cannot form
the curvature).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from cockpit.curvature.lanczos import HVP, common_dtype, make_hvp
from cockpit.per_sample import sample_losses

#: Rademacher probes of the Hutchinson estimate (Hessian-vector products per step).
DEFAULT_PROBES = 16


@dataclass
class TraceEstimate:
    """A diagonal estimate with the per-probe block traces it is the mean of.

    Attributes:
        diagonals: One estimate of ``diag(H)`` per parameter (its shape).
        traces: ``[probes, P]`` float64 (CPU): per probe, each block's trace, so
            ``traces.mean(0)`` are the blocks' estimated traces and their spread
            the estimate's error.
        products: Hessian-vector products spent on the probes.
        method: How it was made (for the log and the coverage report).
    """

    diagonals: list[Tensor]
    traces: Tensor
    products: int
    method: str


def seeded_generator(device, seed: int) -> torch.Generator:
    """A ``torch.Generator`` on ``device`` seeded with ``seed``.

    The CPU's where the device has none of its own (e.g. ``meta``).
    """
    try:
        return torch.Generator(device=device or "cpu").manual_seed(seed)
    except RuntimeError:
        return torch.Generator().manual_seed(seed)


def rademacher(dim: int, generator, dtype, device) -> Tensor:
    """A flat vector of +-1 (drawn from ``generator``, on its device)."""
    signs = torch.randint(
        0, 2, (dim,), generator=generator, dtype=torch.int8, device=generator.device
    )
    return (signs * 2 - 1).to(device=device, dtype=dtype)


def _block_sums(flat: Tensor, sizes: Sequence[int]) -> Tensor:
    """Sum of ``flat`` over each parameter's slice (float64, CPU)."""
    return torch.stack(
        [piece.sum(dtype=torch.float64) for piece in torch.split(flat, list(sizes))]
    ).cpu()


def _split(flat: Tensor, shapes: Sequence[torch.Size]) -> list[Tensor]:
    pieces = torch.split(flat, [s.numel() for s in shapes])
    return [piece.reshape(shape) for piece, shape in zip(pieces, shapes, strict=True)]


def hutchinson(
    hvp: HVP,
    shapes: Sequence[torch.Size],
    probes: int,
    generator,
    dtype: torch.dtype,
    device,
) -> TraceEstimate:
    """Hutchinson's estimate from ``probes`` Rademacher vectors (at least 2).

    Args:
        hvp: ``v -> H v`` on flat vectors.
        shapes: The parameters' shapes, in the order of the flat vectors.
        probes: Number of products.
        generator: The probes' random source (on the parameters' device).
        dtype: Dtype of the vectors (the promoted parameters' dtype).
        device: Their device.

    Returns:
        The estimate.
    """
    probes = max(2, int(probes))
    sizes = [s.numel() for s in shapes]
    dim = sum(sizes)
    total = torch.zeros(dim, dtype=dtype, device=device)
    traces = []
    for _ in range(probes):
        z = rademacher(dim, generator, dtype, device)
        sample = z * hvp(z)
        total += sample
        traces.append(_block_sums(sample, sizes))
    return TraceEstimate(
        _split(total / probes, shapes),
        torch.stack(traces),
        probes,
        hutchinson_method(probes),
    )


def hutchinson_method(probes: int) -> str:
    """How a Hutchinson estimate is made (the coverage report's words)."""
    return f"Hutchinson, {probes} Hessian-vector products"


def hessian_diagonal(
    individual_losses: Tensor,
    params: Sequence[Tensor],
    probes: int = DEFAULT_PROBES,
    generator: torch.Generator | None = None,
) -> TraceEstimate:
    """Hutchinson's estimate of the Hessian diagonal of the mean per-sample loss.

    The gradient of ``mean_i l_i`` is formed with its graph (the graph of the
    losses is kept for the user's ``loss.backward()``) and ``probes`` Rademacher
    vectors are multiplied with its Hessian (:func:`hutchinson`), in the
    parameters' promoted dtype, float32 at least. A parameter the loss does not
    depend on has an exactly zero diagonal.

    Args:
        individual_losses: The per-sample losses with their autograd graph.
        params: The parameters.
        probes: Number of Hessian-vector products (at least 2).
        generator: Random source of the probes (seeded: reproducible runs).

    Raises:
        RuntimeError: PyTorch's, where an operation of the model has no double
            backward (:func:`no_double_backward` says so).
    """
    loss = sample_losses(individual_losses).mean()
    grads = torch.autograd.grad(
        loss, params, create_graph=True, retain_graph=True, allow_unused=True
    )
    grads = [
        torch.zeros_like(p) if g is None else g
        for p, g in zip(params, grads, strict=True)
    ]
    dtype, device = common_dtype(params), params[0].device
    hvp = make_hvp(params, grads, dtype, device)
    return hutchinson(hvp, [p.shape for p in params], probes, generator, dtype, device)


def no_double_backward(error: Exception) -> bool:
    """Whether ``error`` is PyTorch's missing derivative of a backward operator."""
    text = str(error)
    return (
        isinstance(error, RuntimeError)
        and "derivative for" in text
        and "backward" in text
        and "not implemented" in text
    )


def trace_errors(traces: Tensor) -> list[Tensor]:
    """Standard errors of the mean trace per parameter, from ``[probes, P]`` traces."""
    probes = traces.shape[0]
    return list(traces.std(dim=0) / probes**0.5)


def sum_error(traces: Tensor) -> Tensor:
    """Standard error of the estimate of the parameters' summed trace.

    All parameters' traces of one probe come from the same vector ``v_k``: the
    block of parameter ``p`` gets ``v_p^T H_pp v_p + sum_q v_p^T H_pq v_q``, whose
    cross terms it shares with block ``q``. Their errors are therefore
    correlated, and the sum's standard error is the spread of the per-probe sums
    (``std_k sum_p t_kp / sqrt(probes)``), not the root of the summed squares of
    :func:`trace_errors`.

    Args:
        traces: ``[probes, P]`` per-probe traces.

    Returns:
        A scalar tensor.
    """
    probes = traces.shape[0]
    return traces.sum(dim=1).std() / probes**0.5
