"""Unbiased estimates of a Hessian's diagonal and block traces from its products.

Both estimators see ``H`` only through ``hvp(v) = H v`` on flat vectors (all
parameters concatenated) and return a :class:`TraceEstimate`: a diagonal estimate
per parameter and, per probe, the traces of the parameter blocks, whose mean over
the probes is the estimate and whose spread gives its standard error (the
parameters share the probes, so the error of the summed trace is the spread of the
per-probe sums, :func:`cockpit.engines.autograd.sum_error`).

* :func:`hutchinson`: ``z * (H z)`` with Rademacher ``z`` (Hutchinson 1989). The
  variance of a block's trace is ``2 sum_{d != e} H_de**2`` over the block's rows
  ``d`` and all columns ``e``: the off-diagonal mass of the rows.
* :func:`deflated`: the Krylov space ``Q`` that Lanczos built anyway (HessMaxEV's)
  is taken exactly, only the rest is probed (the idea of Hutch++, Meyer, Musco,
  Musco and Woodruff 2021, with the sketch replaced by the Lanczos basis, whose
  products are already paid for). With ``P = Q Q^T``, ``P' = I - P`` and the
  Lanczos relation ``H Q = Q T + w e_k^T`` (``w`` orthogonal to ``Q``)::

      H = P H P + P H P' + P' H P + P' H P'
        = Q T Q^T + q_k w^T + w q_k^T + P' H P',

  so ``diag(H) = rowsum(Q o (Q T)) + 2 q_k o w + diag(P' H P')``: the first two
  terms cost no product, the last is estimated with probes
  ``z o (P' H P' z)``. The variance is that of Hutchinson on ``P' H P'``: the
  spectrum's extreme eigenvalues, which the Krylov space captures first, no longer
  contribute. The estimate is unbiased given ``Q`` (the probes are drawn
  independently of it), hence unbiased.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import Tensor

HVP = Callable[[Tensor], Tensor]


@dataclass
class TraceEstimate:
    """A diagonal estimate with the per-probe block traces it is the mean of.

    Attributes:
        diagonals: One estimate of ``diag(H)`` per parameter (its shape).
        traces: ``[probes, P]`` float64 (CPU): per probe, each block's trace (the
            exactly known part included), so ``traces.mean(0)`` are the blocks'
            estimated traces and their spread the estimate's error.
        products: Hessian-vector products spent on the probes.
        method: How it was made (for the log and the coverage report).
        krylov_variance: For a deflated estimate, the variance Hutchinson's probes
            would have had on the part taken exactly (:func:`krylov_variance`).
    """

    diagonals: list[Tensor]
    traces: Tensor
    products: int
    method: str
    krylov_variance: float | None = None


def rademacher(dim: int, generator, dtype, device) -> Tensor:
    """A flat vector of +-1 (drawn on the CPU from ``generator``: reproducible)."""
    signs = torch.randint(0, 2, (dim,), generator=generator, dtype=torch.int8)
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
        generator: The probes' random source (CPU).
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


def deflated(
    hvp: HVP,
    krylov,
    shapes: Sequence[torch.Size],
    probes: int,
    generator,
) -> TraceEstimate:
    """The Krylov space taken exactly, the rest probed (see the module).

    Args:
        hvp: ``v -> H v`` on flat vectors (the ``H`` of ``krylov``).
        krylov: The Lanczos decomposition
            (:class:`cockpit.quantities.hess_max_ev.Krylov`); its rows' dtype and
            device are used throughout.
        shapes: The parameters' shapes, in the order of the flat vectors.
        probes: Number of products on the rest (at least 2).
        generator: The probes' random source (CPU).

    Returns:
        The estimate; its ``krylov_variance`` is the variance Hutchinson's probes
        would have had on the Krylov part (:func:`krylov_variance`).
    """
    probes = max(2, int(probes))
    sizes = [s.numel() for s in shapes]
    rows = list(krylov.rows())
    alphas, betas = krylov.alphas, krylov.betas
    # rowsum(Q o (Q T)) = sum_l alpha_l q_l**2 + 2 sum_l beta_l q_l o q_{l+1}
    known = torch.zeros_like(rows[0])
    for index, row in enumerate(rows):
        known.addcmul_(row, row, value=alphas[index])
        if index < len(betas):
            known.addcmul_(row, rows[index + 1], value=2 * betas[index])
    if krylov.tail is not None:
        known.addcmul_(rows[-1], krylov.tail, value=2.0)
    blocks = krylov.blocks

    def project_out(v: Tensor) -> Tensor:
        for block in blocks:
            v = torch.addmv(v, block.T, block @ v, alpha=-1)
        return v

    exact = _block_sums(known, sizes)
    total = torch.zeros_like(known)
    traces = []
    for _ in range(probes):
        z = rademacher(known.numel(), generator, known.dtype, known.device)
        sample = z * project_out(hvp(project_out(z)))
        total += sample
        traces.append(exact + _block_sums(sample, sizes))
    return TraceEstimate(
        _split(known + total / probes, shapes),
        torch.stack(traces),
        probes,
        deflated_method(krylov.size, probes),
        krylov_variance(krylov, known),
    )


def residual_share(estimate: TraceEstimate) -> float:
    """How much of Hutchinson's variance a deflated estimate's rest still has.

    ``s**2 / (s**2 + V)`` with ``s**2`` the sample variance of the per-probe sums
    (the rest's) and ``V`` the Krylov part's (:func:`krylov_variance`; the two
    parts of Hutchinson's ``z^T H z`` are uncorrelated up to a term in the
    diagonals). A deflated estimate with ``share * K`` probes is about as precise
    as Hutchinson's with ``K``.
    """
    spread = float(estimate.traces.sum(dim=1).var())
    total = spread + (estimate.krylov_variance or 0.0)
    return 1.0 if not total > 0 else spread / total


def krylov_variance(krylov, known: Tensor) -> float:
    """Variance of Hutchinson's ``z^T L z`` for the Krylov part ``L`` of ``H``.

    ``L = Q T Q^T + q_k w^T + w q_k^T`` (``H`` minus ``P' H P'``); for Rademacher
    ``z`` the variance is ``2 (||L||_F**2 - sum_d L_dd**2)`` with
    ``||L||_F**2 = ||T||_F**2 + 2 ||w||**2`` and ``diag(L)`` = ``known``.
    """
    frobenius = sum(a * a for a in krylov.alphas) + 2 * sum(b * b for b in krylov.betas)
    if krylov.tail is not None:
        frobenius += 2 * float(krylov.tail.double().norm()) ** 2
    return max(0.0, 2 * (frobenius - float(known.double().norm()) ** 2))


def hutchinson_method(probes: int) -> str:
    """How a Hutchinson estimate is made (the coverage report's words)."""
    return f"Hutchinson, {probes} Hessian-vector products"


def deflated_method(basis: int, probes: int) -> str:
    """How a deflated estimate is made (the coverage report's words)."""
    return (
        f"Krylov-deflated Hutchinson: HessMaxEV's {basis} Lanczos vectors exact, "
        f"{probes} Hessian-vector products on the rest"
    )
