"""TICDiag and TICTrace: Takeuchi Information Criterion approximations.

Thomas et al., "On the interplay between noise and curvature and its effect on
optimization and generalization" (AISTATS 2020). With the uncentred second moment of
the individual gradients ``M_d = (1/N) sum_i g_{i,d}**2`` and a diagonal curvature
``h_d`` of the mini-batch loss (Hessian, GGN, or a Monte-Carlo GGN)::

    TICDiag  = sum_d M_d / (h_d + epsilon)
    TICTrace = sum_d M_d / (sum_d h_d + epsilon)

Both are reduced per parameter inside the backward pass to the scalars they need
(``sum_d s_d / (h_d + epsilon)`` for TICDiag, ``sum_d s_d`` and ``sum_d h_d`` for
TICTrace, where ``s_d = M_d / N`` is BackPACK's ``SumGradSquared`` convention), so no
whole-model diagonal is ever kept. ``N`` comes from ``info["batch_size"]``.

The second moment comes from BackPACK's ``SumGradSquared`` (no per-sample gradients are
materialised) unless another quantity needs ``BatchGrad`` anyway; the curvature
diagonal is requested as a need, so it is computed once per step for every quantity
that reads it (e.g. one ``DiagHessian`` run feeds HessTrace, TICDiag and TICTrace).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Callable

import torch

from cockpit.needs import Need, curvature_need
from cockpit.param_view import ParamView
from cockpit.quantities.base import Missing, SingleStepQuantity, TrackContext


class _TIC(SingleStepQuantity):
    """Shared plumbing of the TIC quantities.

    Args:
        track_schedule: When to track.
        verbose: Extra diagnostics.
        curvature: ``"diag_h"`` (exact Hessian diagonal, default),
            ``"diag_ggn_exact"`` or ``"diag_ggn_mc"``.
        epsilon: Added to the curvature in the denominator (``1e-7``).
        key: History key (default: the class name).

    Raises:
        ValueError: For an unknown ``curvature`` (the message lists the valid ones)
            or a negative ``epsilon``.
    """

    info_keys = ("batch_size",)
    #: Whether the value needs the diagonals elementwise (data-parallel runs
    #: then send whole diagonals; otherwise two sums per parameter).
    elementwise = True

    @dataclass
    class Accumulator:
        """Per-parameter reductions and the batch size the gradients showed."""

        parts: dict[int, torch.Tensor] = field(default_factory=dict)
        seen_batch_size: int | None = None

    def __init__(
        self,
        track_schedule: Callable[[int], bool],
        verbose: bool = False,
        curvature: str = "diag_h",
        epsilon: float = 1e-7,
        key: str | None = None,
    ):
        super().__init__(track_schedule, verbose=verbose, key=key)
        self.needs = frozenset({Need.SUM_GRAD_SQUARED, curvature_need(curvature)})
        self.curvature = curvature
        if not epsilon >= 0:
            raise ValueError(
                f"epsilon must be >= 0, got {epsilon!r}. The default is 1e-7."
            )
        self.epsilon = float(epsilon)

    def accumulate(self, global_step: int, view: ParamView) -> None:
        """Reduce this parameter's second moment and curvature to scalars."""
        with torch.no_grad():
            scaled = view.scaled_sum_grad_squared().detach()
            diag = view.curvature(self.curvature).detach()
            if self.shared is not None:  # reduced once summed over processes
                n = self.shared.n_local
                squares, curvature = scaled * n**2, diag * n
                if not self.elementwise:  # linear in both: sums suffice
                    squares, curvature = squares.sum(), curvature.sum()
                self.acc.parts[view.index] = (squares, curvature)
            else:
                self.acc.parts[view.index] = self._reduce(scaled, diag)
        if view.has_individual_gradients:
            self.acc.seen_batch_size = view.batch_size

    def share(self, global_step: int, ctx: TrackContext, bucket) -> None:
        """Sum ``sum_i g_i^2`` and ``n_r h_r`` over processes, then reduce."""
        acc, n = self.acc, ctx.comm.n_global
        for index, (squares, curvature) in list(acc.parts.items()):
            joined_squares = bucket.sum(squares)  # its value is set before any then

            def then(total, index=index, joined_squares=joined_squares):
                acc.parts[index] = self._reduce(joined_squares.value / n**2, total / n)

            bucket.sum(curvature, then)
        acc.seen_batch_size = n if acc.seen_batch_size is not None else None

    @abc.abstractmethod
    def _reduce(self, scaled, diag):
        """Implemented by each subclass."""

    def _batch_size(self, ctx: TrackContext) -> int:
        n = ctx.info.require("batch_size", self.key)
        seen = self.acc.seen_batch_size
        if seen is not None and int(n) != seen:
            raise ValueError(
                f"{self.key}: info['batch_size'] is {n} but the per-sample gradients "
                f"at step {ctx.global_step} hold {seen} samples. Fix: pass the "
                f"mini-batch size, e.g. info={{'batch_size': x.shape[0], ...}}."
            )
        return int(n)

    def _parts(self, ctx: TrackContext) -> torch.Tensor:
        return torch.stack([self.acc.parts[i] for i in range(len(ctx.params))])


class TICDiag(_TIC):
    """``sum_d M_d / (h_d + epsilon)``: the TIC with a diagonal curvature, a float.

    ``M_d = (1/N) sum_i g_{i,d}**2`` over all coordinates ``d`` of all parameters;
    ``h_d`` the chosen curvature diagonal. With the exact Hessian (``"diag_h"``)
    ``h_d`` can be negative; where ``h_d + epsilon <= 0`` the value is undefined and
    recorded as missing (with the count of such entries); the GGN choices are
    never negative.

    Args:
        track_schedule: When to track.
        verbose: Extra diagnostics.
        curvature: ``"diag_h"`` (default), ``"diag_ggn_exact"`` or ``"diag_ggn_mc"``.
        epsilon: Damping added to every ``h_d`` (default ``1e-7``).
        key: History key (default ``"TICDiag"``).

    Raises:
        ValueError: For an unknown ``curvature`` or a negative ``epsilon``.
    """

    def _reduce(self, scaled, diag):
        denominator = diag + self.epsilon
        nonpositive = (denominator <= 0).sum().to(scaled.dtype)
        return torch.stack([(scaled / denominator).sum(), nonpositive])

    def _compute(self, global_step: int, ctx: TrackContext) -> float | Missing:
        n = self._batch_size(ctx)
        value, nonpositive = self._parts(ctx).sum(0).tolist()
        if nonpositive > 0:
            return Missing(
                f"{int(nonpositive)} entries of the curvature diagonal "
                f"({self.curvature}) plus epsilon are <= 0, where TICDiag is "
                "undefined. Fix: use curvature='diag_ggn_exact' (never negative) or "
                "a larger epsilon"
            )
        return float(n * value)


class TICTrace(_TIC):
    """``sum_d M_d / (sum_d h_d + epsilon)``: the TIC with a trace curvature, a float.

    Sums run over all coordinates of all parameters; ``M_d`` and ``h_d`` as in
    :class:`TICDiag`.

    Args:
        track_schedule: When to track.
        verbose: Extra diagnostics.
        curvature: ``"diag_h"`` (default), ``"diag_ggn_exact"`` or ``"diag_ggn_mc"``.
        epsilon: Damping added to the trace (default ``1e-7``).
        key: History key (default ``"TICTrace"``).

    Raises:
        ValueError: For an unknown ``curvature`` or a negative ``epsilon``.
    """

    elementwise = False

    def _reduce(self, scaled, diag):
        return torch.stack([scaled.sum(), diag.sum()])

    def _compute(self, global_step: int, ctx: TrackContext) -> float:
        n = self._batch_size(ctx)
        moment, trace = self._parts(ctx).sum(0)
        if not trace + self.epsilon > 0:
            return Missing(
                f"the trace of the curvature ({self.curvature}) plus epsilon is "
                f"{float(trace + self.epsilon):.3g} <= 0, where TICTrace is undefined. "
                "Fix: use curvature='diag_ggn_exact' (never negative)"
            )
        return float(n * moment / (trace + self.epsilon))
