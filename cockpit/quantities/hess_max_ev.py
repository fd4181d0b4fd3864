"""HessMaxEV: the eigenvalue of largest magnitude of the mini-batch Hessian.

The Hessian ``H`` of the mean-reduced mini-batch loss ``L`` is never formed; it is
touched only through Hessian-vector products ``H v``, obtained by differentiating the
gradients in ``.grad`` a second time. For that, ``.grad`` must carry the graph of the
first backward pass, so on scheduled steps the user runs
``loss.backward(create_graph=cockpit.create_graph(step))``. The products run after
BackPACK's buffers are freed and with BackPACK disabled (``after_cleanup``); afterwards
the cockpit detaches ``.grad``, and this quantity keeps no tensor that references the
graph, so the double-backward graph is freed at the end of the step.

The two eigensolvers (Lanczos, the default, and power iteration) live in
:mod:`cockpit.curvature.lanczos`, as plain functions of an ``hvp`` callable.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import torch
from torch import Tensor

from cockpit.curvature import attention
from cockpit.curvature.hutchinson import seeded_generator
from cockpit.curvature.lanczos import (  # noqa: F401  (re-exported)
    HVP,
    EigenResult,
    _norm,
    _orthogonalise,
    common_dtype,
    graph_gradients,
    lanczos_max_ev,
    make_hvp,
    power_max_ev,
)
from cockpit.errors import CockpitWarning
from cockpit.needs import Need
from cockpit.quantities.base import NothingToShare, SingleStepQuantity, TrackContext

#: Suffix of the key under which :class:`HessMaxEV` records the largest (algebraic)
#: eigenvalue where it differs from the value (the eigenvalue of largest magnitude).
LARGEST_SUFFIX = "_largest"


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

    #: (computed before the backward pass, on the unsharded parameters)
    shard_local = True
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
        self._layout: list | None = None  # the rows ``_previous`` holds (FSDP2)
        #: Hessian-vector products spent at the last computation.
        self.last_num_hvps = 0
        self._largest: dict[int, float] = {}

    def bind(self, history) -> None:
        """Fused attention, differentiable twice (``cockpit.curvature.attention``)."""
        super().bind(history)
        if not getattr(self, "_holds_attention", False):
            self._holds_attention = True
            attention.hold(self)

    def _compute(self, global_step: int, ctx: TrackContext) -> float:
        params = list(ctx.params)
        shared = ctx.comm
        if shared is not None and shared.graph_gradients is not None:
            grads = list(shared.graph_gradients)  # this shard's, with their graph
        else:
            grads = graph_gradients(params, self.key, global_step)
        dtype = common_dtype(params)
        device = params[0].device
        hvp = make_hvp(params, grads, dtype, device)
        if shared is not None:  # the joined batch's Hessian: shards by their share
            local_hvp = hvp

            def hvp(vector: Tensor) -> Tensor:
                return shared.mean(local_hvp(vector), "a Hessian-vector product")

        dim = sum(p.numel() for p in params)
        pieces = getattr(shared, "pieces", None)
        if pieces is not None:  # FSDP2: each process holds its rows of the vectors
            joined_hvp = hvp

            def hvp(piece: Tensor) -> Tensor:
                whole = pieces.join(piece, "a Lanczos vector")
                return pieces.take(joined_hvp(whole))

        result = self._solve(global_step, hvp, dim, dtype, device, pieces)
        del hvp, grads
        if result.top is not None and result.top != result.eigenvalue:
            self._largest[global_step] = result.top
        return float(result.eigenvalue)

    def _solve(
        self,
        global_step: int,
        hvp: HVP,
        dim: int,
        dtype: torch.dtype,
        device,
        pieces=None,
    ) -> EigenResult:
        total = None if pieces is None else pieces.total
        v0 = self._start_vector(global_step, dim, device, pieces)
        v0 = v0.to(device=device, dtype=dtype)
        options = {"rtol": self.rtol, "atol": self.atol, "max_iter": self.max_iter}
        if self.use_power:
            result = power_max_ev(hvp, v0, total=total, **options)
        else:
            result = lanczos_max_ev(
                hvp,
                v0,
                num_vectors=self.WARM_START_VECTORS,
                top=True,
                total=total,
                dim=dim,
                **options,
            )
        self.last_num_hvps = result.num_hvps
        if self.warm_start:
            self._previous = _unit_sum(result.ritz_vectors.detach(), total)
            # which rows of the whole vector it holds (FSDP2), else None
            self._layout = None if pieces is None else [list(r) for r in pieces.ranges]
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
        """Forget the step's companions."""
        self._largest.pop(global_step, None)
        super().abort_step(global_step)

    def _start_vector(
        self, global_step: int, dim: int, device=None, pieces=None
    ) -> Tensor:
        """The start vector (``pieces``: this process's piece of it)."""
        generator = seeded_generator(device, self.seed + global_step)
        # drawn in float32 (3-6 times faster than float64 on the CPU), on the
        # parameters' device; summed in float64
        noise = torch.randn(dim, generator=generator, device=generator.device)
        noise = noise.double()
        noise /= noise.norm()
        previous = self._previous
        if pieces is not None:
            return self._start_piece(noise, previous, dim, pieces)
        if previous is None or previous.numel() != dim:
            return noise
        previous = previous.detach().to(device=noise.device, dtype=torch.float64)
        norm = previous.norm()  # chosen on the device: no synchronisation
        usable = torch.isfinite(norm) & (norm != 0)
        warm = previous.reshape(-1) / norm + self.WARM_START_NOISE * noise
        return torch.where(usable, warm, noise)

    def _start_piece(self, noise: Tensor, previous, dim: int, pieces) -> Tensor:
        """This process's piece of the start vector (FSDP2).

        The same draw on every process; the warm start only where every process
        holds its own piece of it (a state saved by one process holds the whole
        vector: its piece is taken). Every process makes the same collective
        (one all-reduce), whatever it holds, and all decide alike.
        """
        noise = pieces.take(noise)
        layout = [list(r) for r in pieces.ranges]
        if previous is not None and self._layout is None and previous.numel() == dim:
            previous = pieces.take(previous.detach().reshape(-1).to(noise))
        elif self._layout != layout:  # another process's piece, or none
            previous = None
        fits = previous is not None and previous.numel() == noise.numel()
        mine = previous.detach().reshape(-1).to(noise) if fits else noise * 0
        sums = pieces.total(
            torch.stack([torch.dot(mine, mine), noise.new_tensor(float(fits))])
        )
        norm = sums[0].clamp(min=0).sqrt()  # chosen on the device
        usable = torch.isfinite(norm) & (norm != 0) & (sums[1] == pieces.processes)
        warm = mine / norm + self.WARM_START_NOISE * noise
        return torch.where(usable, warm, noise)

    def state_dict(self) -> dict[str, Any]:
        """Return the warm-start vector (flat, or ``None``).

        On FSDP2 parameters each process's own piece, with the rows it holds
        (``"layout"``): save each process's state for each process.
        """
        return {"previous": self._previous, "layout": self._layout}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the warm-start vector."""
        self._previous = state.get("previous")
        layout = state.get("layout")
        self._layout = None if layout is None else [list(r) for r in layout]


def _unit_sum(rows: Tensor, total=None) -> Tensor:
    """The unit vector along the sum of the unit rows of ``rows`` (flat).

    Zero or non-finite rows are left out; if none is left, the first row as is.
    Chosen on the device (no synchronisation). ``total``: the rows are this
    process's pieces (:data:`~cockpit.curvature.lanczos.Total`).
    """
    if total is None:
        norms = rows.norm(dim=1, keepdim=True)
    else:
        norms = total((rows * rows).sum(1, keepdim=True)).clamp(min=0).sqrt()
    keep = torch.isfinite(norms) & (norms > 0)
    summed = torch.where(keep, rows / norms, 0.0).sum(0)
    norm = _norm(summed, total)
    usable = keep.any() & torch.isfinite(norm) & (norm > 0)
    return torch.where(usable, summed / norm, rows[0])
