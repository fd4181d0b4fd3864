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

Where BackPACK has no exact curvature for the model (residuals, attention, raw
parameters, tied weights), the curvature comes from :mod:`cockpit.curvature.source`:
the GGN of the cross-entropy (for the GGN choices, and for ``"diag_h"`` in place of
the Hessian whenever the loss is a cross-entropy), else Hutchinson's estimate of the
Hessian (``curvature="hutchinson"``, or a loss that is not a cross-entropy).
``TICTrace`` is then estimated: the second moments stay exact (per-sample gradients
of either engine), the trace ``T`` is the estimate the step makes anyway (the same
as HessTrace's), and the standard error is propagated by the delta method
(:func:`tic_trace_estimate`). ``TICDiag`` takes only an exact diagonal: the exact
GGN where rows times classes are few (see its docstring).
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from cockpit.curvature import attention
from cockpit.curvature import source as curvature_source
from cockpit.curvature.source import EXACT_MAX_PRODUCTS, HESSIAN_ONLY
from cockpit.needs import Need, curvature_need
from cockpit.param_view import ParamView
from cockpit.quantities.base import Missing, SingleStepQuantity, TrackContext
from cockpit.quantities.compat import Alias102
from cockpit.utils.host import Deferred


class _TIC(SingleStepQuantity):
    """Shared plumbing of the TIC quantities.

    Args:
        track_schedule: When to track.
        verbose: Extra diagnostics.
        curvature: ``"diag_h"`` (exact Hessian diagonal, default), ``"hutchinson"``
            (the Hessian, never the GGN in its place), ``"diag_ggn_exact"`` or
            ``"diag_ggn_mc"``.
        epsilon: Added to the curvature in the denominator (``1e-7``).
        key: History key (default: the class name).

    Raises:
        ValueError: For an unknown ``curvature`` (the message lists the valid ones)
            or a negative ``epsilon``.
    """

    shard_local = True  # (sums of the per-sample results; no parameter read)

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
        #: ``curvature="hutchinson"``: the Hessian, never the GGN in its place.
        self.hessian_only = curvature == HESSIAN_ONLY
        curvature = "diag_h" if self.hessian_only else curvature
        self.needs = frozenset({Need.SUM_GRAD_SQUARED, curvature_need(curvature)})
        self.curvature = curvature
        if not epsilon >= 0:
            raise ValueError(
                f"epsilon must be >= 0, got {epsilon!r}. The default is 1e-7."
            )
        self.epsilon = float(epsilon)

    # 1.0.2's attribute names, read by quantities copied from its TIC quantities
    _curvature = Alias102("curvature")
    _epsilon = Alias102("epsilon")

    @property
    def sums_in_backward(self) -> tuple[str, ...]:
        """FSDP2: the elementwise sums sent unit by unit (TICDiag's two)."""
        return ("squares", "curvature") if self.elementwise else ()

    def accumulate(self, global_step: int, view: ParamView) -> None:
        """Reduce this parameter's second moment and curvature to scalars."""
        with torch.no_grad():
            scaled = view.scaled_sum_grad_squared().detach()
            diag = view.curvature(self.curvature).detach()
            self._keep(view.index, self._part(scaled, diag))
        if view.has_individual_gradients:
            self.acc.seen_batch_size = view.batch_size

    def _keep(self, index: int, part) -> None:
        """Keep a parameter's part, or (FSDP2) send its two sums with its unit."""
        units = self.unit_sums
        if units is not None:
            for name, tensor in zip(("squares", "curvature"), part, strict=True):
                units.put(self.channel(name), index, tensor)
        else:
            self.acc.parts[index] = part

    def _part(self, scaled, diag):
        """One parameter's part: reduced, or (data-parallel) the sums to join."""
        if self.shared is None:
            return self._reduce(scaled, diag)
        n = self.shared.n_local  # reduced once summed over processes
        squares, curvature = scaled * n**2, diag * n
        if not self.elementwise:  # linear in both: sums suffice
            squares, curvature = squares.sum(), curvature.sum()
        return squares, curvature

    def share(self, global_step: int, ctx: TrackContext, bucket) -> None:
        """Sum ``sum_i g_i^2`` and ``n_r h_r`` over processes, then reduce."""
        acc, n = self.acc, ctx.comm.n_global
        if self.rows_of(ctx) is not None and self.elementwise:
            self._share_rows(acc, n, bucket)
            return
        for index, (squares, curvature) in list(acc.parts.items()):
            joined_squares = bucket.sum(squares)  # its value is set before any then

            def then(total, index=index, joined_squares=joined_squares):
                acc.parts[index] = self._reduce(joined_squares.value / n**2, total / n)

            bucket.sum(curvature, then)
        acc.seen_batch_size = n if acc.seen_batch_size is not None else None

    def _share_rows(self, acc, n: int, bucket) -> None:
        """FSDP2: each process reduces its rows of the joined elementwise sums.

        Both sums arrive as this process's rows (reduce-scattered unit by unit
        in the backward pass, ``sums_in_backward``, or in the bucket); the
        reductions, sums over elements, are summed in a next round.
        """
        units = self.unit_sums
        if units is not None:
            self._deliver(units, acc, n, bucket)
            return
        for index, (squares, curvature) in list(acc.parts.items()):
            del acc.parts[index]  # (``then`` puts it back: freed once sent)
            joined_squares = bucket.rows(squares, index)

            def then(total, index=index, joined_squares=joined_squares):
                part = self._reduce(joined_squares.value / n**2, total / n)
                bucket.sum(part, lambda v, i=index: acc.parts.__setitem__(i, v))

            bucket.rows(curvature, index, then)
        acc.seen_batch_size = n if acc.seen_batch_size is not None else None

    def _deliver(self, units, acc, n: int, bucket) -> None:
        """Each parameter's rows of both sums, sent in the backward pass, reduced."""
        got: dict[int, dict] = {}

        def take(name):
            def then(index, rows):
                both = got.setdefault(index, {})
                both[name] = rows
                if len(both) == 2:
                    del got[index]
                    part = self._reduce(both["squares"] / n**2, both["curvature"] / n)
                    bucket.sum(part, lambda v, i=index: acc.parts.__setitem__(i, v))

            return then

        for name in ("squares", "curvature"):
            units.deliver(self.channel(name), bucket, take(name))
        acc.seen_batch_size = n if acc.seen_batch_size is not None else None

    def state_dict(self) -> dict:
        """The curvature source chosen for the run (and the GGN's last spread)."""
        return curvature_source.state_of(self)

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` saved."""
        curvature_source.restore(self, state)

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

    Where BackPACK has no exact curvature diagonal for the model, TICDiag takes
    only an exact one: it divides elementwise by ``h_d``, and an estimate of a
    single diagonal entry (Hutchinson's is off by the off-diagonal mass of its row,
    a Monte-Carlo GGN's by the spread of its draws) is often near zero or of either
    sign, so ``M_d / h_d`` would be dominated by such entries, biased and without a
    usable error. Where the loss is a cross-entropy with few rows times classes
    (:data:`cockpit.curvature.source.EXACT_MAX_PRODUCTS`: a classifier on a small
    batch), the GGN diagonal is formed exactly (one backward pass per row and
    class), in place of the Hessian for ``"diag_h"``, and TICDiag has a value
    (its ``<key>_estimate`` says ``"curvature": "ggn"``, standard error 0);
    otherwise it is recorded missing, pointing to :class:`TICTrace`, which divides
    by the trace and is estimated there.
    """

    shard_local = True  # (sums of the per-sample results; no parameter read)

    #: Why no estimate serves where BackPACK computes no diagonal (the reason
    #: recorded with the missing value, and what to use instead).
    not_estimable = (
        "TICDiag divides elementwise by the curvature diagonal, so only an exact one "
        "serves (an estimate of a single entry, Hutchinson's or a Monte-Carlo GGN's, "
        "is often near zero or of either sign); the exact GGN diagonal is formed "
        "only for a cross-entropy loss with at most "
        f"{EXACT_MAX_PRODUCTS} rows times classes (one backward pass each)",
        "or track TICTrace, which is estimated on such models (GGN or Hessian "
        "trace, with its standard error)",
    )
    #: The GGN stands in only where exact (see :mod:`cockpit.curvature.source`).
    estimable = frozenset({Need.DIAG_H, Need.DIAG_GGN_EXACT, Need.DIAG_GGN_MC})
    exact_curvature_only = True

    @dataclass
    class Accumulator:
        """Per-parameter reductions, the batch size seen, and halves not reduced.

        ``pending[index]`` is ``[scaled second moment, curvature]`` of a parameter
        whose two halves are shown apart (the GGN's diagonal before the backward
        pass, the moments by the engines), reduced once both are there.
        """

        parts: dict[int, torch.Tensor] = field(default_factory=dict)
        seen_batch_size: int | None = None
        pending: dict[int, list] = field(default_factory=dict)

    def accumulate(self, global_step: int, view: ParamView) -> None:
        """Reduce the second moment and curvature (shown together or apart)."""
        both = view.has_second_moment and view.has_curvature(self.curvature)
        if both:
            super().accumulate(global_step, view)
            return
        entry = self.acc.pending.setdefault(view.index, [None, None])
        with torch.no_grad():
            if view.has_second_moment:
                entry[0] = view.scaled_sum_grad_squared().detach()
            if view.has_curvature(self.curvature):
                entry[1] = view.curvature(self.curvature).detach()
        if view.has_individual_gradients:
            self.acc.seen_batch_size = view.batch_size
        if entry[0] is not None and entry[1] is not None:
            scaled, diag = self.acc.pending.pop(view.index)
            self._keep(view.index, self._part(scaled, diag.to(scaled.dtype)))

    def estimate_error(self, global_step: int, errors=None):
        """An exact GGN diagonal (the only one taken): standard error 0."""
        return None if errors is None else ([0.0], 0.0)

    def _reduce(self, scaled, diag):
        denominator = diag + self.epsilon
        nonpositive = (denominator <= 0).sum().to(scaled.dtype)
        return torch.stack([(scaled / denominator).sum(), nonpositive])

    def _compute(self, global_step: int, ctx: TrackContext) -> Deferred:
        n = self._batch_size(ctx)

        def finish(parts):  # decided on the host, with the step's values
            value, nonpositive = parts
            if nonpositive > 0:
                return Missing(
                    f"{int(nonpositive)} entries of the curvature diagonal "
                    f"({self.curvature}) plus epsilon are <= 0, where TICDiag is "
                    "undefined. Fix: use curvature='diag_ggn_exact' (never "
                    "negative) or a larger epsilon"
                )
            return float(n * value)

        return Deferred(self._parts(ctx).sum(0), finish)


class TICTrace(_TIC):
    """``sum_d M_d / (sum_d h_d + epsilon)``: the TIC with a trace curvature, a float.

    Sums run over all coordinates of all parameters; ``M_d`` and ``h_d`` as in
    :class:`TICDiag`.

    Where BackPACK has no exact curvature for the model, it is estimated:
    ``sum_d M_d`` stays exact, ``T = sum_d h_d`` is the step's estimate of the
    curvature trace (shared with HessTrace; the GGN of the cross-entropy, also in
    place of the Hessian for ``"diag_h"``, else Hutchinson's estimate of the
    Hessian, :mod:`cockpit.curvature.source`), and ``<key>_estimate`` holds the
    standard error (delta method, :func:`tic_trace_estimate`) and the curvature
    used. A step whose estimated ``T + epsilon`` is not clearly positive (below
    ``MIN_RELATIVE`` standard errors) is recorded missing; the GGN is positive
    semi-definite, so its estimate with a small relative error always passes.

    Args:
        track_schedule: When to track.
        verbose: Extra diagnostics.
        curvature: ``"diag_h"`` (default), ``"hutchinson"`` (the Hessian, never the
            GGN in its place), ``"diag_ggn_exact"`` or ``"diag_ggn_mc"``.
        epsilon: Damping added to the trace (default ``1e-7``).
        key: History key (default ``"TICTrace"``).

    Raises:
        ValueError: For an unknown ``curvature`` or a negative ``epsilon``.
    """

    shard_local = True  # (sums of the per-sample results; no parameter read)

    elementwise = False

    @dataclass
    class Accumulator:
        """Per-parameter sums, the batch size seen and an estimate's probe traces.

        ``parts[index]`` is ``[sum_d s_d * n**2, sum_d h_d * n]`` (``n`` this
        process's samples in a data-parallel run, else 1), filled from one or two
        views: an estimated step shows the curvature and the second moments apart.
        """

        parts: dict[int, list] = field(default_factory=dict)
        seen_batch_size: int | None = None
        probe_traces: torch.Tensor | None = None

    def __init__(
        self,
        track_schedule: Callable[[int], bool],
        verbose: bool = False,
        curvature: str = "diag_h",
        epsilon: float = 1e-7,
        key: str | None = None,
    ):
        super().__init__(track_schedule, verbose, curvature, epsilon, key)
        #: Every curvature is estimable (the GGN of the cross-entropy, or the
        #: Hessian by Hutchinson; :mod:`cockpit.curvature.source`).
        self.estimable = frozenset({Need.DIAG_H, Need.DIAG_GGN_EXACT, Need.DIAG_GGN_MC})
        self._errors: dict[int, float] = {}

    def bind(self, history) -> None:
        """Fused attention, differentiable twice (``cockpit.curvature.attention``)."""
        super().bind(history)
        if self.estimable and not getattr(self, "_holds_attention", False):
            self._holds_attention = True
            attention.hold(self)

    def accumulate(self, global_step: int, view: ParamView) -> None:
        """Sum this parameter's second moment and curvature (each where shown)."""
        n = self.shared.n_local if self.shared is not None else 1
        entry = self.acc.parts.setdefault(view.index, [None, None])
        with torch.no_grad():
            if view.has_second_moment:
                entry[0] = view.scaled_sum_grad_squared().detach().sum() * n**2
            if view.has_curvature(self.curvature):
                entry[1] = view.curvature(self.curvature).detach().sum() * n
        if view.has_individual_gradients:
            self.acc.seen_batch_size = view.batch_size

    def share(self, global_step: int, ctx: TrackContext, bucket) -> None:
        """Sum ``sum_i g_i^2`` and ``n_r h_r`` over processes."""
        acc, n = self.acc, ctx.comm.n_global
        for index, entry in list(acc.parts.items()):
            bucket.sum(
                self._pair(entry),
                lambda v, i=index: acc.parts.__setitem__(i, [v[0] / n**2, v[1] / n]),
            )
        acc.seen_batch_size = n if acc.seen_batch_size is not None else None

    @staticmethod
    def _pair(entry) -> torch.Tensor:
        """``[moment, trace]`` of one parameter (a part not shown counts 0)."""
        known = next(t for t in entry if t is not None)
        return torch.stack([known.new_zeros(()) if t is None else t for t in entry])

    def probe_traces(self, traces: torch.Tensor) -> None:
        """Take the per-probe traces ``[probes, P]`` of this step's estimate."""
        self.acc.probe_traces = traces.detach().to("cpu", torch.float64)

    def estimate_error(self, global_step: int, errors=None):
        """The standard error of TICTrace's own estimate (``None``: exact)."""
        error = self._errors.pop(global_step, None)
        return None if error is None else ([error], error)

    def _reduce(self, scaled, diag):  # pragma: no cover - accumulate is overridden
        return torch.stack([scaled.sum(), diag.sum()])

    def _compute(
        self, global_step: int, ctx: TrackContext
    ) -> Deferred | float | Missing:
        n = self._batch_size(ctx)
        traces = self.acc.probe_traces
        if traces is None:  # exact: decided on the host, with the step's values
            return Deferred(
                self._parts(ctx).sum(0), lambda parts: self._exact(n, *parts)
            )
        # estimated (the probes' traces are on the host already): its standard
        # error must be known when the value is recorded
        moment, trace = self._parts(ctx).sum(0).tolist()
        value, error, trace_error = tic_trace_estimate(
            n * moment, trace, traces, self.epsilon
        )
        if value is None:
            return Missing(
                f"the {self._read()} trace plus "
                f"epsilon is {trace + self.epsilon:.3g} with standard error "
                f"{trace_error:.3g}, not clearly positive (TICTrace is estimated "
                f"only where it exceeds {MIN_RELATIVE:g} standard errors). Fix: "
                "more probes (Cockpit.HUTCHINSON_PROBES, default 16; the error "
                "shrinks as 1/sqrt(probes)), or an exact curvature on a model "
                "BackPACK covers (nn.Sequential)"
            )
        self._errors[global_step] = error
        return value

    def _exact(self, n: int, moment: float, trace: float) -> float | Missing:
        if not trace + self.epsilon > 0:
            return Missing(
                f"the trace of the curvature ({self.curvature}) plus epsilon is "
                f"{trace + self.epsilon:.3g} <= 0, where TICTrace is undefined. "
                "Fix: use curvature='diag_ggn_exact' (never negative)"
            )
        return float(n * moment / (trace + self.epsilon))

    def _read(self) -> str:
        """The curvature this quantity's estimate reads (for messages)."""
        if curvature_source.chosen(self) == curvature_source.GGN:
            return "Monte-Carlo estimate of the GGN"
        return "Hutchinson estimate of the Hessian"

    def abort_step(self, global_step: int) -> None:
        """Forget the step (and its standard error)."""
        self._errors.pop(global_step, None)
        super().abort_step(global_step)

    def _parts(self, ctx: TrackContext) -> torch.Tensor:
        return torch.stack(
            [self._pair(self.acc.parts[i]) for i in range(len(ctx.params))]
        )


#: An estimated trace ``T + epsilon`` must exceed this many standard errors for
#: TICTrace to be estimated: then the standard error of ``1 / T`` is at most a third
#: of its value, its bias (about ``r**2`` relative, ``r`` the relative error of
#: ``T``) at most a third of one standard error, and the first-order (delta method)
#: error is a fair description of the spread.
MIN_RELATIVE = 3.0


def tic_trace_estimate(
    moment: float, trace: float, traces: torch.Tensor, epsilon: float
) -> tuple[float | None, float, float]:
    """TICTrace from an exact second moment and an estimated trace, with its error.

    ``TICTrace = A / (T + epsilon)`` with ``A = sum_d M_d`` exact and ``T`` the mean
    of the ``K`` per-probe traces ``t_k = sum_p t_kp`` (all parameters share the
    probes, so the sum's error is the spread of the per-probe sums,
    :func:`cockpit.curvature.hutchinson.sum_error`). The delta method gives
    ``SE = A * SE(T) / (T + epsilon)**2``: ``1/x`` linearised at the estimate, fair
    while ``SE(T)`` is small against ``T + epsilon`` (see :data:`MIN_RELATIVE`).

    Args:
        moment: ``A = sum_d M_d`` (exact).
        trace: The estimated trace ``T`` (the mean of the per-probe sums).
        traces: ``[K, P]`` per-probe, per-parameter traces (``K = 1``: an exact
            trace, standard error 0).
        epsilon: The damping.

    Returns:
        ``(value, stderr, stderr_of_trace)``; ``value`` is ``None`` where
        ``T + epsilon <= MIN_RELATIVE * SE(T)`` (not clearly positive).
    """
    probes = traces.shape[0]
    trace_error = float(traces.sum(dim=1).std() / probes**0.5) if probes > 1 else 0.0
    denominator = trace + epsilon
    if not denominator > MIN_RELATIVE * trace_error:
        return None, math.nan, trace_error
    return moment / denominator, moment * trace_error / denominator**2, trace_error
