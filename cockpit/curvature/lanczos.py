"""Lanczos and power iteration on Hessian-vector products.

The Hessian ``H`` of a loss is touched only through products ``H v``
(:func:`make_hvp`: the gradients, formed with their graph, differentiated once
more). Both eigensolvers are plain functions of such an ``hvp`` callable
(:func:`lanczos_max_ev`, :func:`power_max_ev`); both return the eigenvalue of
largest magnitude (which can be negative) with the same stopping rule, so their
product counts can be compared directly. :class:`cockpit.quantities.HessMaxEV`
runs them; the step's Hutchinson estimate shares :func:`make_hvp`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch
from torch import Tensor

from cockpit.precision import compute_dtype

HVP = Callable[[Tensor], Tensor]

#: Sums a tensor of partial inner products over the pieces of the vectors that
#: several processes hold (each its rows of every parameter, FSDP2); ``None``: one
#: process holds the whole vectors. Every process must call it alike.
Total = Callable[[Tensor], Tensor]


def _dot(a: Tensor, b: Tensor, total: Total | None) -> Tensor:
    """``a . b`` of the whole vectors (a tensor: no synchronisation)."""
    dot = torch.dot(a, b)
    return dot if total is None else total(dot)


def _norm(v: Tensor, total: Total | None) -> Tensor:
    """``||v||`` of the whole vector (a tensor: no synchronisation)."""
    return v.norm() if total is None else total(torch.dot(v, v)).clamp(min=0).sqrt()


@dataclass
class EigenResult:
    """Outcome of an eigensolver run.

    Attributes:
        eigenvalue: The estimate of the eigenvalue of largest magnitude.
        eigenvector: The matching unit (Ritz) vector, flat and detached.
        num_hvps: How many Hessian-vector products were spent.
        converged: Whether the stopping rule was met within the iteration budget.
        residual: ``||H y - theta y||`` of the returned pair (``y`` the vector).
        ritz_vectors: The orthonormal Ritz vectors of up to ``num_vectors`` Ritz
            values of largest magnitude (no more than the Lanczos steps taken), one
            per row, the returned one first (shape ``(k, dim)``); what a warm start
            of the next step builds on.
        top: The largest (algebraic) Ritz value, where asked for (``top=True``);
            equal to ``eigenvalue`` when that is the largest.
        top_residual: Its residual ``||H y - top y||``.
    """

    eigenvalue: float
    eigenvector: Tensor
    num_hvps: int
    converged: bool
    residual: float
    ritz_vectors: Tensor | None = None
    top: float | None = None
    top_residual: float | None = None


def _tolerance(theta: float, rtol: float, atol: float) -> float:
    return rtol * abs(theta) + atol


def power_max_ev(
    hvp: HVP,
    v0: Tensor,
    rtol: float = 1e-3,
    atol: float = 1e-6,
    max_iter: int = 100,
    total: Total | None = None,
) -> EigenResult:
    """Power iteration for the eigenvalue of largest magnitude of a symmetric ``H``.

    Each round normalises ``v``, spends one product ``w = H v``, and takes the
    Rayleigh quotient ``theta = v . w``. Stopping rule: the residual
    ``||H v - theta v||`` is at most ``rtol * |theta| + atol`` (then an eigenvalue of
    ``H`` lies within that distance of ``theta``), or ``max_iter`` products are spent.

    Args:
        hvp: ``v -> H v`` for flat vectors.
        v0: Non-zero start vector (flat).
        rtol: Relative residual tolerance.
        atol: Absolute residual tolerance.
        max_iter: Budget of Hessian-vector products.
        total: Where several processes hold pieces of the vectors (``v0`` and
            what ``hvp`` takes and returns are this process's piece), how their
            partial inner products are summed (:data:`Total`).

    Returns:
        The estimate, its vector (``total``: this process's piece) and the number
        of products.
    """
    with torch.no_grad():
        v = v0 / _norm(v0, total)
        theta, residual, converged, count = 0.0, float("inf"), False, 0
        for _ in range(max_iter):
            w = hvp(v)
            count += 1
            theta_t = _dot(v, w, total)
            norm = _norm(w, total)
            # one copy to the host per product: the Rayleigh quotient and both norms
            away = _norm(w - theta_t * v, total)
            numbers = torch.stack([theta_t, away, norm]).tolist()
            theta, residual, length = numbers
            if residual <= _tolerance(theta, rtol, atol):
                converged = True
                break
            if length == 0.0:
                break
            v = w / norm
        v = v.detach()
        return EigenResult(theta, v, count, converged, residual, v.reshape(1, -1))


#: Lanczos vectors allocated at first; the basis doubles when it is full.
_FIRST_BASIS_ROWS = 8

#: A Gram-Schmidt pass that leaves less than this fraction of the vector's norm is
#: repeated (the criterion of Daniel, Gragg, Kaufman and Stewart, 1976).
_REPEAT_BELOW = 2**-0.5


class _Basis:
    """The orthonormal Lanczos vectors, as rows of blocks that are never copied.

    The first block has ``_FIRST_BASIS_ROWS`` rows; each further one as many as all
    before it (up to ``capacity`` in all), so the rows held follow the products
    spent, and growing costs no copy of the rows already there.
    """

    def __init__(self, first: Tensor, capacity: int, norm: Tensor | None = None):
        self._dim, self._capacity = first.numel(), capacity
        self._dtype, self._device = first.dtype, first.device
        self.blocks: list[Tensor] = []
        self._rows = 0  # rows written
        self._allocated = 0
        # (a tensor: no synchronisation)
        self.append(first, first.norm() if norm is None else norm)

    def append(self, vector: Tensor, norm: float | Tensor) -> None:
        """Add ``vector / norm`` as the next row."""
        if self._rows == self._allocated:
            rows = min(
                max(self._allocated, _FIRST_BASIS_ROWS), self._capacity - self._rows
            )
            # rows are written before they are read: no need to zero them
            self.blocks.append(
                torch.empty(rows, self._dim, dtype=self._dtype, device=self._device)
            )
            self._allocated += rows
        block = self.blocks[-1]
        torch.div(
            vector, norm, out=block[block.shape[0] - (self._allocated - self._rows)]
        )
        self._rows += 1

    def row(self, j: int) -> Tensor:
        """The ``j``-th vector (a view)."""
        for block in self.blocks:
            if j < block.shape[0]:
                return block[j]
            j -= block.shape[0]
        raise IndexError(j)

    def filled(self) -> list[Tensor]:
        """The written rows, block by block (views)."""
        out, left = [], self._rows
        for block in self.blocks:
            if left <= 0:
                break
            out.append(block[:left])
            left -= block.shape[0]
        return out

    def combine(self, coefficients: Tensor) -> Tensor:
        """``coefficients.T @ Q`` for ``[rows, k]`` coefficients: ``k`` flat rows."""
        out, start = None, 0
        for block in self.filled():
            part = coefficients[start : start + block.shape[0]].T @ block
            out = part if out is None else out.add_(part)
            start += block.shape[0]
        return out


def _orthogonalise(
    w: Tensor, blocks: Sequence[Tensor], *scalars: Tensor, total: Total | None = None
) -> tuple[Tensor, float, list[float]]:
    """``w`` without its components along the orthonormal rows of ``blocks``.

    One classical Gram-Schmidt pass (two matrix-vector products with each block),
    repeated once if it removed most of ``w``: only then can rounding have left
    components along the basis that are large relative to what remains. After
    Lanczos' three-term recurrence ``w`` is orthogonal to the basis up to rounding,
    so the second pass is rarely needed; each pass reads the whole basis twice,
    which on a small model costs about as much as the Hessian-vector product
    itself (``benchmarks.studies.kernels --lanczos``).

    The norms before and after the pass go to the host in one copy, with
    ``scalars`` (the iteration's other numbers): one synchronisation, a second
    only where the pass is repeated. With ``total`` (pieces of the vectors on
    several processes) the coefficients and norms are summed over the pieces.

    Returns:
        The orthogonalised vector, its norm, and ``scalars`` as Python numbers.
    """
    before = _norm(w, total)
    w = _gram_schmidt(w, blocks, total)
    after = _norm(w, total)
    before, after, *numbers = torch.stack([before, after, *scalars]).tolist()
    if after < _REPEAT_BELOW * before:
        w = _gram_schmidt(w, blocks, total)
        after = float(_norm(w, total))
    return w, after, numbers


def _gram_schmidt(
    w: Tensor, blocks: Sequence[Tensor], total: Total | None = None
) -> Tensor:
    """One classical Gram-Schmidt pass of ``w`` against the rows of ``blocks``."""
    coefficients = [block @ w for block in blocks]
    if total is not None and coefficients:  # one sum for every block's
        joined = total(torch.cat(coefficients))
        coefficients = list(joined.split([c.numel() for c in coefficients]))
    for block, c in zip(blocks, coefficients, strict=True):
        w = torch.addmv(w, block.T, c, alpha=-1)
    return w


def lanczos_max_ev(
    hvp: HVP,
    v0: Tensor,
    rtol: float = 1e-3,
    atol: float = 1e-6,
    max_iter: int = 50,
    num_vectors: int = 1,
    top: bool = False,
    total: Total | None = None,
    dim: int | None = None,
) -> EigenResult:
    """Lanczos iteration for the eigenvalue of largest magnitude of a symmetric ``H``.

    Builds an orthonormal basis ``Q_k`` of the Krylov space of ``v0`` (one product
    per step, full re-orthogonalisation against all previous vectors, repeated where
    it cancels, :func:`_orthogonalise`) and
    the tridiagonal ``T_k = Q_k^T H Q_k``, whose eigenpairs (``numpy.linalg.eigh`` in
    float64) give Ritz values ``theta_j`` with residuals
    ``r_j = ||H y_j - theta_j y_j|| = beta_k |s_j[-1]|``, free of extra products. The
    answer is the Ritz value ``theta`` of largest magnitude.

    Stopping rule: the largest-magnitude Ritz pair has residual at most
    ``rtol * |theta| + atol`` (an eigenvalue lies within that distance of ``theta``;
    the eigenvalue error is typically far smaller, about ``residual**2 / gap``) and
    the Ritz value ``theta'`` at the opposite end of the spectrum is settled below it,
    ``|theta'| + residual' <= |theta|``; or the Krylov space became invariant
    (``beta_k`` at rounding level: the Ritz values are exact eigenvalues); or
    ``max_iter`` products are spent (capped at the dimension). The basis holds one
    vector of the size of ``v0`` per product spent: 8 are allocated first and the
    buffer doubles when full (up to ``max_iter``), so a run that stops after 15
    products holds 16 vectors, not ``max_iter``.

    The rule looks at the residual, not at ``residual**2 / gap`` with the gap read
    off the other Ritz values: while a cluster of eigenvalues is still unresolved,
    one Ritz value sits amid it with a wide apparent gap, and that bound stops early
    and wrong (seen on a 39-parameter MLP: 1.464 returned for 1.570). No rule can see
    an eigenvalue the start vector hardly contains, which is why :class:`HessMaxEV`
    warm-starts from several vectors.

    Args:
        hvp: ``v -> H v`` for flat vectors.
        v0: Non-zero start vector (flat); its dtype and device are used throughout.
        rtol: Relative residual tolerance.
        atol: Absolute residual tolerance.
        max_iter: Budget of Hessian-vector products (basis size).
        num_vectors: How many Ritz vectors to return at most (largest magnitudes
            first); at least 1.
        top: Also converge the largest (algebraic) eigenvalue: where the answer is
            negative, go on until the largest Ritz value's residual is at most
            ``rtol * |theta| + atol`` too (``theta`` the answer: the same absolute
            accuracy, relative to the spectral radius), and return it as ``top``.
        total: Where several processes hold pieces of the vectors (``v0``, the
            basis and what ``hvp`` takes and returns are this process's piece:
            each holds ``1 / processes`` of the basis), how their partial inner
            products are summed (:data:`Total`); every process takes the same
            steps, from the same sums.
        dim: The whole vectors' size (``v0.numel()`` without ``total``).

    Returns:
        The estimate, its Ritz vector(s) (``total``: this process's pieces) and
        the number of products.

    Raises:
        ValueError: If ``num_vectors`` is below 1.
    """
    if num_vectors < 1:
        raise ValueError(f"num_vectors must be at least 1, got {num_vectors!r}.")
    with torch.no_grad():
        dim = v0.numel() if dim is None else int(dim)
        steps = max(1, min(max_iter, dim))
        basis = _Basis(v0, steps, None if total is None else _norm(v0, total))
        alphas: list[float] = []
        betas: list[float] = []
        count, converged = 0, False
        breakdown = 10 * torch.finfo(v0.dtype).eps
        for j in range(steps):
            q = basis.row(j)
            w = hvp(q)
            count += 1
            alpha_t = _dot(q, w, total)
            # w - alpha q, rounded as torch.add(w, q, alpha=-alpha) would: a new
            # tensor (hvp's may alias), alpha left on the device
            w = torch.addcmul(w, q, alpha_t, value=-1)
            if j > 0:
                w.sub_(basis.row(j - 1), alpha=betas[-1])
            w, beta, (alpha,) = _orthogonalise(w, basis.filled(), alpha_t, total=total)
            if not (math.isfinite(alpha) and math.isfinite(beta)):
                raise FloatingPointError(
                    f"Lanczos: Hessian-vector product {count} is not finite "
                    f"(alpha={alpha}, beta={beta}); the loss or its curvature "
                    "overflowed at this step."
                )
            alphas.append(alpha)
            # the small tridiagonal eigenproblem in NumPy: a few microseconds, where
            # building it from torch tensors costs more than solving it
            tridiagonal = np.diag(alphas)
            if betas:
                tridiagonal += np.diag(betas, 1) + np.diag(betas, -1)
            values, vectors = np.linalg.eigh(tridiagonal)
            residuals = beta * np.abs(vectors[-1])
            magnitudes = np.abs(values)
            best = int(magnitudes.argmax())
            other = 0 if best == len(alphas) - 1 else len(alphas) - 1
            theta = float(values[best])
            residual = float(residuals[best])
            tolerance = _tolerance(theta, rtol, atol)
            settled = other == best or float(
                magnitudes[other] + residuals[other]
            ) <= abs(theta)
            # the largest eigenvalue, where the answer is another one
            top_done = not top or best == len(alphas) - 1 or residuals[-1] <= tolerance
            if settled and residual <= tolerance and top_done:
                converged = True
                break
            invariant = beta <= breakdown * float(magnitudes.max())
            if invariant or j + 1 == steps:
                converged = invariant or j + 1 == dim
                break
            betas.append(beta)
            basis.append(w, beta)
        rest = [q for q in np.argsort(-magnitudes, kind="stable").tolist() if q != best]
        order = [best] + rest[: max(0, num_vectors - 1)]
        coefficients = torch.from_numpy(vectors[:, order]).to(v0.device, v0.dtype)
        ritz = basis.combine(coefficients)  # rows: the Ritz vectors
        result = EigenResult(theta, ritz[0].clone(), count, converged, residual, ritz)
        if top:
            result.top, result.top_residual = float(values[-1]), float(residuals[-1])
        return result


def graph_gradients(
    params: Sequence[Tensor], who: str, global_step: int
) -> list[Tensor]:
    """Return ``.grad`` of every parameter, checking that it carries a graph."""
    grads = []
    for i, p in enumerate(params):
        if p.grad is None:
            raise RuntimeError(
                f"{who} at step {global_step}: parameter #{i} (shape "
                f"{tuple(p.shape)}) has no .grad. Hand the cockpit only parameters "
                "that the loss depends on, and run loss.backward() inside the "
                "cockpit context."
            )
        grads.append(p.grad)
    if not any(g.grad_fn is not None for g in grads):
        raise RuntimeError(
            f"{who} at step {global_step} needs the gradients' graph for "
            "Hessian-vector products, but .grad carries none. Fix: call "
            f"loss.backward(create_graph=cockpit.create_graph({global_step})) inside "
            "the cockpit context."
        )
    return grads


def common_dtype(params: Sequence[Tensor]) -> torch.dtype:
    """The parameters' promoted dtype, float32 at least.

    Lanczos vectors in bfloat16 would lose their orthogonality after a few products.
    """
    dtype = params[0].dtype
    for p in params[1:]:
        dtype = torch.promote_types(dtype, p.dtype)
    return compute_dtype(dtype)


def make_hvp(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    dtype: torch.dtype,
    device: torch.device,
) -> HVP:
    """Return ``v -> H v`` on flat vectors, by differentiating ``grads`` again.

    Gradients without a graph are constant in the parameters: their rows (and, by
    symmetry, columns) of ``H`` are zero, so they are left out of the outputs.
    """
    sizes = [p.numel() for p in params]
    live = [k for k, g in enumerate(grads) if g.grad_fn is not None]
    outputs = [grads[k] for k in live]

    def hvp(vector: Tensor) -> Tensor:
        pieces = torch.split(vector, sizes)
        grad_outputs = [
            pieces[k].reshape(params[k].shape).to(grads[k].device, grads[k].dtype)
            for k in live
        ]
        with torch.enable_grad():
            products = torch.autograd.grad(
                outputs,
                params,
                grad_outputs=grad_outputs,
                retain_graph=True,
                allow_unused=True,
            )
        flat = [
            torch.zeros(n, dtype=dtype, device=device)
            if h is None
            else h.detach().reshape(-1).to(device=device, dtype=dtype)
            for h, n in zip(products, sizes, strict=True)
        ]
        return torch.cat(flat)

    return hvp
