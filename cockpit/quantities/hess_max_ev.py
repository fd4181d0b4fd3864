"""HessMaxEV: the eigenvalue of largest magnitude of the mini-batch Hessian.

The Hessian ``H`` of the mean-reduced mini-batch loss ``L`` is never formed; it is
touched only through Hessian-vector products ``H v``, obtained by differentiating the
gradients in ``.grad`` a second time. For that, ``.grad`` must carry the graph of the
first backward pass, so on scheduled steps the user runs
``loss.backward(create_graph=cockpit.create_graph(step))``. The products run after
BackPACK's buffers are freed and with BackPACK disabled (``after_cleanup``); afterwards
the cockpit detaches ``.grad``, and this quantity keeps no tensor that references the
graph, so the double-backward graph is freed at the end of the step.

Two iterative eigensolvers are available as plain functions of an ``hvp`` callable
(:func:`lanczos_max_ev`, the default, and :func:`power_max_ev`); both return the
eigenvalue of largest magnitude (which can be negative) and use the same stopping
rule, so their product counts can be compared directly.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch import Tensor

from cockpit.curvature import attention
from cockpit.errors import CockpitWarning
from cockpit.needs import Need
from cockpit.precision import compute_dtype
from cockpit.quantities.base import NothingToShare, SingleStepQuantity, TrackContext

HVP = Callable[[Tensor], Tensor]

#: Suffix of the key under which :class:`HessMaxEV` records the largest (algebraic)
#: eigenvalue where it differs from the value (the eigenvalue of largest magnitude).
LARGEST_SUFFIX = "_largest"


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
        krylov: The Lanczos decomposition, where asked for (``keep_basis=True``).
    """

    eigenvalue: float
    eigenvector: Tensor
    num_hvps: int
    converged: bool
    residual: float
    ritz_vectors: Tensor | None = None
    top: float | None = None
    top_residual: float | None = None
    krylov: Krylov | None = None


@dataclass
class Krylov:
    """The Lanczos decomposition ``H Q = Q T + w e_k^T`` of a finished run.

    ``Q`` (``k`` orthonormal rows) spans the Krylov space, ``T = Q^T H Q`` is the
    tridiagonal with ``alphas`` on its diagonal and ``betas`` beside it, and the
    tail ``w`` (orthogonal to the rows) is what the last product left outside the
    space. The relation holds to rounding (full re-orthogonalisation), so a
    trace estimator can take ``Q^T H Q`` as exact and estimate only the rest
    (:mod:`cockpit.curvature.hutchinson`).

    Attributes:
        blocks: The rows of ``Q``, block by block (views of the Lanczos basis).
        alphas: The diagonal of ``T`` (``k`` values).
        betas: Its off-diagonal (``k - 1`` values).
        tail: ``w`` (flat), or ``None`` where the space became invariant.
    """

    blocks: list[Tensor]
    alphas: list[float]
    betas: list[float]
    tail: Tensor | None

    @property
    def size(self) -> int:
        """``k``, the number of rows."""
        return len(self.alphas)

    def rows(self):
        """The rows of ``Q`` one by one (views)."""
        for block in self.blocks:
            yield from block


def _tolerance(theta: float, rtol: float, atol: float) -> float:
    return rtol * abs(theta) + atol


def power_max_ev(
    hvp: HVP, v0: Tensor, rtol: float = 1e-3, atol: float = 1e-6, max_iter: int = 100
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

    Returns:
        The estimate, its vector and the number of products.
    """
    with torch.no_grad():
        v = v0 / v0.norm()
        theta, residual, converged, count = 0.0, float("inf"), False, 0
        for _ in range(max_iter):
            w = hvp(v)
            count += 1
            theta = float(torch.dot(v, w))
            residual = float((w - theta * v).norm())
            if residual <= _tolerance(theta, rtol, atol):
                converged = True
                break
            norm = w.norm()
            if float(norm) == 0.0:
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

    def __init__(self, first: Tensor, capacity: int):
        self._dim, self._capacity = first.numel(), capacity
        self._dtype, self._device = first.dtype, first.device
        self.blocks: list[Tensor] = []
        self._rows = 0  # rows written
        self._allocated = 0
        self.append(first, float(first.norm()))

    def append(self, vector: Tensor, norm: float) -> None:
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


def _orthogonalise(w: Tensor, blocks: Sequence[Tensor]) -> tuple[Tensor, float]:
    """``w`` without its components along the orthonormal rows of ``blocks``.

    One classical Gram-Schmidt pass (two matrix-vector products with each block),
    repeated once if it removed most of ``w``: only then can rounding have left
    components along the basis that are large relative to what remains. After
    Lanczos' three-term recurrence ``w`` is orthogonal to the basis up to rounding,
    so the second pass is rarely needed; each pass reads the whole basis twice,
    which on a small model costs about as much as the Hessian-vector product
    itself (``benchmarks.studies.kernels --lanczos``).

    Returns:
        The orthogonalised vector and its norm.
    """
    before = float(w.norm())
    for _ in range(2):
        coefficients = [block @ w for block in blocks]
        for block, c in zip(blocks, coefficients, strict=True):
            w = torch.addmv(w, block.T, c, alpha=-1)
        after = float(w.norm())
        if after >= _REPEAT_BELOW * before:
            break  # at most two passes
    return w, after


def lanczos_max_ev(
    hvp: HVP,
    v0: Tensor,
    rtol: float = 1e-3,
    atol: float = 1e-6,
    max_iter: int = 50,
    num_vectors: int = 1,
    top: bool = False,
    keep_basis: bool = False,
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
        keep_basis: Return the Lanczos decomposition as ``krylov`` (its basis
            stays allocated as long as the result is kept).

    Returns:
        The estimate, its Ritz vector(s) and the number of products.

    Raises:
        ValueError: If ``num_vectors`` is below 1.
    """
    if num_vectors < 1:
        raise ValueError(f"num_vectors must be at least 1, got {num_vectors!r}.")
    with torch.no_grad():
        dim = v0.numel()
        steps = max(1, min(max_iter, dim))
        basis = _Basis(v0, steps)
        alphas: list[float] = []
        betas: list[float] = []
        count, converged = 0, False
        breakdown = 10 * torch.finfo(v0.dtype).eps
        for j in range(steps):
            q = basis.row(j)
            w = hvp(q)
            count += 1
            alpha = float(torch.dot(q, w))
            w = torch.add(w, q, alpha=-alpha)  # a new tensor: hvp's may alias
            if j > 0:
                w.sub_(basis.row(j - 1), alpha=betas[-1])
            w, beta = _orthogonalise(w, basis.filled())
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
        if keep_basis:
            invariant = beta <= breakdown * float(magnitudes.max())
            result.krylov = Krylov(
                basis.filled(), list(alphas), list(betas), None if invariant else w
            )
        return result


class HessMaxEV(NothingToShare, SingleStepQuantity):
    """Eigenvalue of largest magnitude of the mini-batch loss Hessian, a float.

    ``H = nabla^2_theta L`` over all parameters handed to the cockpit. As in
    cockpit-for-pytorch 1.0.2 the value is the eigenvalue of largest *magnitude*
    (for the usual, mostly positive Hessian spectra: the largest eigenvalue).

    Method. By default Lanczos (:func:`lanczos_max_ev`) with at most ``max_iter``
    Hessian-vector products (default 50), which typically needs far fewer products
    than power iteration. ``use_power=True`` selects power iteration
    (:func:`power_max_ev`, default budget 100 products), the default method of
    1.0.2; in 1.0.2 ``use_power=False`` meant SciPy's Lanczos for the largest
    *algebraic* eigenvalue, here both methods return the largest-magnitude one.

    Tolerance and stopping rule (both methods): stop once the returned Ritz pair
    ``(theta, y)`` has residual ``||H y - theta y|| <= rtol * |theta| + atol``
    (``rtol=1e-3``, ``atol=1e-6``); Lanczos additionally requires the Ritz value
    ``theta'`` at the opposite end of the spectrum to satisfy
    ``|theta'| + residual' <= |theta|``, so that the answer's sign is settled. A
    residual ``r`` guarantees an eigenvalue within ``r`` of ``theta``; the error of
    a Ritz value is typically about ``r**2 / gap``, far below ``r``. If the budget
    runs out first, a warning is emitted and the last estimate is returned. (1.0.2
    stopped power iteration when two consecutive estimates agreed to rtol 1e-3 /
    atol 1e-6, which can stop early when convergence is slow.)

    Start vector: on the first step a random direction; afterwards (warm start) the
    normalised sum of the previous tracked step's ``WARM_START_VECTORS`` (3) leading
    Ritz vectors (kept as that one vector between steps) plus 10 % of a random
    direction; power iteration has one vector and starts from it. Several vectors,
    not just the previous eigenvector: the leading eigenvalues of a mini-batch
    Hessian often lie close together and swap places from one batch to the next,
    and Lanczos started next to the old eigenvector converges to *its* eigenvalue
    long before the new leading one, which the start barely contains, shows up
    (measured on an MLP during training: 1.7 % too small). The random direction
    comes from a private generator seeded with ``seed + global_step``
    (reproducible, the global RNG is untouched). Vectors live on the first
    parameter's device in the promoted dtype of the parameters; the tridiagonal
    problem is solved in float64.

    Args:
        track_schedule: When to track; on those steps ``create_graph`` is True.
        verbose: Warn with the number of products after every computation.
        use_power: Use power iteration instead of Lanczos.
        rtol: Relative residual tolerance.
        atol: Absolute residual tolerance.
        max_iter: Budget of products (default: 50 for Lanczos, 100 for power).
        warm_start: Start from the previous step's leading Ritz vectors.
        seed: Seed of the random start direction.
        key: History key (default ``"HessMaxEV"``).

    Raises:
        ValueError: For non-positive tolerances or budget.
    """

    needs = frozenset({Need.HESSIAN_VECTOR_PRODUCTS, Need.PARAMETERS})

    #: Weight of the random direction added to a warm start.
    WARM_START_NOISE = 0.1
    #: How many leading Ritz vectors of the previous step a warm start is built from.
    WARM_START_VECTORS = 3

    def __init__(
        self,
        track_schedule: Callable[[int], bool],
        verbose: bool = False,
        use_power: bool = False,
        rtol: float = 1e-3,
        atol: float = 1e-6,
        max_iter: int | None = None,
        warm_start: bool = True,
        seed: int = 0,
        key: str | None = None,
    ):
        super().__init__(track_schedule, verbose=verbose, key=key)
        if not (rtol >= 0 and atol >= 0 and rtol + atol > 0):
            raise ValueError(
                f"rtol and atol must be >= 0 and not both 0, got rtol={rtol!r}, "
                f"atol={atol!r}. The defaults are rtol=1e-3, atol=1e-6."
            )
        if max_iter is not None and (
            isinstance(max_iter, bool) or not isinstance(max_iter, int) or max_iter < 1
        ):
            raise ValueError(
                f"max_iter must be a positive int or None, got {max_iter!r}."
            )
        self.use_power = bool(use_power)
        self.rtol, self.atol = float(rtol), float(atol)
        self.max_iter = max_iter if max_iter is not None else (100 if use_power else 50)
        self.warm_start = bool(warm_start)
        self.seed = int(seed)
        self._previous: Tensor | None = None
        #: Hessian-vector products spent at the last computation.
        self.last_num_hvps = 0
        self._solved: dict[int, EigenResult | Exception] = {}
        self._largest: dict[int, float] = {}
        #: Where a trace estimate shared this quantity's Lanczos run: the part of
        #: Hutchinson's variance its rest still had (it sets the next step's
        #: number of probes, :func:`cockpit.step.features.estimators.deflated_probes`).
        self.residual_share: float | None = None

    def bind(self, history) -> None:
        """Fused attention, differentiable twice (``cockpit.curvature.attention``)."""
        super().bind(history)
        if not getattr(self, "_holds_attention", False):
            self._holds_attention = True
            attention.hold(self)

    def _compute(self, global_step: int, ctx: TrackContext) -> float:
        result = self._solved.pop(global_step, None)
        if isinstance(result, Exception):  # the step's shared solve failed
            raise result
        if result is None:
            params = list(ctx.params)
            shared = ctx.comm
            if shared is not None and shared.graph_gradients is not None:
                grads = list(shared.graph_gradients)  # this shard's, with their graph
            else:
                grads = _graph_gradients(params, self.key, global_step)
            dtype = _common_dtype(params)
            device = params[0].device
            hvp = _make_hvp(params, grads, dtype, device)
            if shared is not None:  # the joined batch's Hessian: shards by their share
                local_hvp = hvp

                def hvp(vector: Tensor) -> Tensor:
                    return shared.mean(local_hvp(vector), "a Hessian-vector product")

            dim = sum(p.numel() for p in params)
            result = self._solve(global_step, hvp, dim, dtype, device)
            del hvp, grads
        if result.top is not None and result.top != result.eigenvalue:
            self._largest[global_step] = result.top
        return float(result.eigenvalue)

    def solve(
        self, global_step: int, hvp: HVP, dim: int, dtype: torch.dtype, device
    ) -> EigenResult:
        """Run this step's eigensolver now, for a caller that shares its products.

        The step's trace estimate (:mod:`cockpit.curvature.hutchinson`) reuses the
        Lanczos basis (``keep_basis``); the tracked value is this result. A
        failure is kept and raised when the value is tracked.

        Args:
            global_step: The step.
            hvp: ``v -> H v`` on flat vectors (all parameters).
            dim: Their length.
            dtype: The vectors' dtype (:func:`_common_dtype` of the parameters).
            device: Their device.

        Returns:
            The result, with its Lanczos decomposition (``krylov``) unless power
            iteration is used.
        """
        try:
            result = self._solve(global_step, hvp, dim, dtype, device, keep_basis=True)
        except Exception as error:
            self._solved[global_step] = error
            raise
        self._solved[global_step] = result
        return result

    def _solve(
        self,
        global_step: int,
        hvp: HVP,
        dim: int,
        dtype: torch.dtype,
        device,
        keep_basis: bool = False,
    ) -> EigenResult:
        v0 = self._start_vector(global_step, dim).to(device=device, dtype=dtype)
        options = {"rtol": self.rtol, "atol": self.atol, "max_iter": self.max_iter}
        if self.use_power:
            result = power_max_ev(hvp, v0, **options)
        else:
            result = lanczos_max_ev(
                hvp,
                v0,
                num_vectors=self.WARM_START_VECTORS,
                top=True,
                keep_basis=keep_basis,
                **options,
            )
        self.last_num_hvps = result.num_hvps
        if self.warm_start:
            self._previous = _unit_sum(result.ritz_vectors.detach())
        if not result.converged:
            warnings.warn(
                f"{self.key} at step {global_step}: no convergence within "
                f"{result.num_hvps} Hessian-vector products (residual "
                f"{result.residual:.3g}); returning the last estimate. Raise max_iter "
                "or loosen rtol/atol.",
                CockpitWarning,
                stacklevel=3,
            )
        elif self.verbose:
            warnings.warn(
                f"{self.key} at step {global_step}: {result.eigenvalue:.6g} after "
                f"{result.num_hvps} Hessian-vector products.",
                CockpitWarning,
                stacklevel=3,
            )
        return result

    def companions(self, global_step: int) -> dict[str, float]:
        """``{"<key>_largest": value}`` where the largest eigenvalue is another one.

        ``HessMaxEV`` is the eigenvalue of largest magnitude (1.0.2's meaning);
        where that is negative, the largest (algebraic) eigenvalue, what is read
        as sharpness, is recorded beside it (Lanczos converges both ends of the
        spectrum; its error is within ``rtol * |HessMaxEV| + atol``).
        """
        value = self._largest.pop(global_step, None)
        return {} if value is None else {f"{self.key}{LARGEST_SUFFIX}": value}

    def abort_step(self, global_step: int) -> None:
        """Forget the step's shared solve and companions."""
        self._solved.pop(global_step, None)
        self._largest.pop(global_step, None)
        super().abort_step(global_step)

    def _start_vector(self, global_step: int, dim: int) -> Tensor:
        generator = torch.Generator().manual_seed(self.seed + global_step)
        # drawn in float32 (3-6 times faster than float64 on the CPU), on the CPU
        # (the same start on every device); summed in float64
        noise = torch.randn(dim, generator=generator).double()
        noise /= noise.norm()
        previous = self._previous
        if previous is None or previous.numel() != dim:
            return noise
        previous = previous.detach().to(device="cpu", dtype=torch.float64)
        norm = previous.norm()
        if not torch.isfinite(norm) or float(norm) == 0.0:
            return noise
        return previous.reshape(-1) / norm + self.WARM_START_NOISE * noise

    def state_dict(self) -> dict[str, Any]:
        """Return the warm-start vector (flat, or ``None``) and the trace's share."""
        return {"previous": self._previous, "residual_share": self.residual_share}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the warm-start vector and the trace's share."""
        self._previous = state.get("previous")
        self.residual_share = state.get("residual_share")


def _unit_sum(rows: Tensor) -> Tensor:
    """The unit vector along the sum of the unit rows of ``rows`` (flat).

    Zero or non-finite rows are left out; if none is left, the first row as is.
    """
    norms = rows.norm(dim=1, keepdim=True)
    keep = (torch.isfinite(norms) & (norms > 0)).squeeze(1)
    if not bool(keep.any()):
        return rows[0].clone()
    total = (rows[keep] / norms[keep]).sum(0)
    norm = total.norm()
    return total / norm if bool(torch.isfinite(norm)) and float(norm) > 0 else rows[0]


def _graph_gradients(
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


def _common_dtype(params: Sequence[Tensor]) -> torch.dtype:
    """The parameters' promoted dtype, float32 at least.

    Lanczos vectors in bfloat16 would lose their orthogonality after a few products.
    """
    dtype = params[0].dtype
    for p in params[1:]:
        dtype = torch.promote_types(dtype, p.dtype)
    return compute_dtype(dtype)


def _make_hvp(
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
