"""GradHist1d and GradHist2d: histograms of individual gradient elements.

Both histograms are counted per parameter inside the backward pass, from that
parameter's per-sample gradients ``g_i`` (shape ``[N, *shape]``), and summed over the
parameters; only the integer counts are kept, so the per-sample gradients of a module
can be freed as soon as BackPACK is done with it. The counts are exact integers and do
not depend on the order of the values (deterministic, also on GPUs). Three ways to
count, all giving the counts of the binning rule below:

* values spread over many bins: a flat integer bin index per value and
  ``torch.bincount`` (:func:`bin_index`);
* a block whose values span at most :data:`FEW_BINS` bins: ``#(v >= e_k)`` by
  comparisons;
* a ``Linear`` weight (per-sample gradients kept as two factors,
  ``g_i[a, b] = (delta_ia * x_ib) * N``): without forming the values, from each
  sample's sorted inputs (:func:`histogram_1d_outer`, :func:`histogram_2d_outer`),
  since every row ``a`` of ``g_i`` is a monotone function of ``x_i``.

Binning rule (shared by both histograms). For ``bins`` equal-width bins on
``[lo, hi]`` the published edges are ``e_k = lo + k * ((hi - lo) / bins)`` for
``k < bins`` and ``e_bins = hi`` (the floating-point formula of ``numpy.linspace``),
and a value ``v`` goes to bin ``k`` iff ``e_k <= v < e_{k+1}``; the last bin also holds
``v == hi``. The index is ``floor((v - lo) / w)`` (``w`` the bin width) followed by a
one-step correction against the edges, so values within rounding error of an edge land
on the side the published edges say, exactly as in ``numpy.histogram``. Comparisons
run in the dtype of the values (edges rounded to it). NaN values are not counted.
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from cockpit.needs import Need
from cockpit.param_view import ParamView
from cockpit.quantities import histogram_kernels as kernels
from cockpit.quantities.base import SingleStepQuantity, TrackContext
from cockpit.quantities.bin_adaptation import BinAdaptation, as_policy
from cockpit.quantities.compat import Alias102
from cockpit.quantities.histogram_kernels import Range


# --- argument checks -----------------------------------------------------------------
def _check_bins(bins: Any, what: str) -> int:
    if isinstance(bins, bool) or not isinstance(bins, int) or bins < 1:
        raise ValueError(
            f"{what} must be a positive int, got {bins!r}. E.g. {what}=100."
        )
    return bins


def _check_range(value: Any, what: str) -> Range:
    try:
        lo, hi = (float(v) for v in value)
    except (TypeError, ValueError):
        raise ValueError(
            f"{what} must be a pair (lo, hi) of numbers, got {value!r}. "
            f"E.g. {what}=(-2, 2)."
        ) from None
    if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
        raise ValueError(
            f"{what} must be finite with lo < hi, got {value!r}. E.g. {what}=(-2, 2)."
        )
    return (lo, hi)


def _pair(value: Any, what: str) -> tuple[Any, Any]:
    if isinstance(value, (tuple, list)) and len(value) == 2:
        return value[0], value[1]
    raise ValueError(
        f"{what} must be a pair (for the gradient axis, for the parameter axis), "
        f"got {value!r}."
    )


class _EdgeCache:
    """Bin edges of one axis on every device/dtype they are needed in, for one step."""

    def __init__(self, lo: float, hi: float, bins: int):
        self.cpu = kernels.histogram_edges(lo, hi, bins)
        self._on: dict[tuple, Tensor] = {}

    def like(self, tensor: Tensor) -> Tensor:
        key = (tensor.device, tensor.dtype)
        if key not in self._on:
            self._on[key] = self.cpu.to(device=tensor.device, dtype=tensor.dtype)
        return self._on[key]


@dataclass
class _Counts:
    """What a histogram collects during one backward pass.

    Attributes:
        counts: The counts summed over parameters (flattened bins).
        per_param: Counts of each parameter (GradHist2d with ``keep_individual``).
        reduced: Per range axis, the policy's per-parameter reductions.
        edges: Per range axis, the step's bin edges.
    """

    counts: Tensor | None = None
    per_param: dict[int, Tensor] = field(default_factory=dict)
    reduced: dict[int, list[Tensor]] = field(default_factory=dict)
    edges: dict[int, _EdgeCache] = field(default_factory=dict)


# --- quantities ----------------------------------------------------------------------
class _Histogram(SingleStepQuantity):
    """Shared plumbing: counts per parameter, range adaptation on its own schedule."""

    @abc.abstractmethod
    def _policies(self) -> Sequence[BinAdaptation]:
        """Implemented by each subclass."""

    def is_active(self, global_step: int) -> bool:
        """Active on the histogram's steps and on the steps of its range policies."""
        return self.should_compute(global_step) or any(
            policy.should_compute(global_step) for policy in self._policies()
        )

    needs = frozenset({Need.INDIVIDUAL_GRADIENTS})
    Accumulator = _Counts

    def needs_at(self, global_step: int) -> frozenset[Need]:
        """Per-sample gradients when counting, plus what the due policies read.

        The range policies run on schedules of their own, so this is the one
        quantity whose needs differ between the steps it is active at.
        """
        needs = set(self.needs) if self.should_compute(global_step) else set()
        for policy in self._policies():
            if policy.should_compute(global_step):
                needs |= policy.needs
        return frozenset(needs)

    @property
    def shard_local(self) -> bool:
        """Counts of per-sample gradients, summed: shard-local (FSDP2).

        Unless a range policy reads the parameters (``ParamAbsMax``, a 1.0.2
        policy).
        """
        return not any(
            getattr(p, "reads_parameters", False) or hasattr(p, "_get_abs_max")
            for p in self._policies()
        )

    def accumulate(self, global_step: int, view: ParamView) -> None:
        """Count this parameter's values and collect the policies' reductions."""
        with torch.no_grad():
            if self.should_compute(global_step):
                counts = self._count(global_step, view)
                total = self.acc.counts
                self.acc.counts = counts if total is None else total + counts
                self._keep(view.index, counts)
            for axis, policy in enumerate(self._policies()):
                if policy.should_compute(global_step):
                    reduced = policy.reduce(view)
                    if reduced is not None:
                        self.acc.reduced.setdefault(axis, []).append(reduced)

    def share(self, global_step: int, ctx: TrackContext, bucket) -> None:
        """Sum the counts over processes; the range policies take the maximum.

        The ranges are the same on every process: they start equal and every
        process adapts them from the same (reduced) values.
        """
        acc = self.acc
        if acc.counts is not None:
            bucket.sum(acc.counts, lambda v: setattr(acc, "counts", v))
        for index, counts in list(acc.per_param.items()):
            bucket.sum(counts, lambda v, i=index: acc.per_param.__setitem__(i, v))
        for axis, reduced in list(acc.reduced.items()):
            if reduced:
                largest = torch.stack([r.detach().reshape(()) for r in reduced]).max()
                bucket.max(largest, lambda v, a=axis: acc.reduced.__setitem__(a, [v]))

    def _keep(self, index: int, counts: Tensor) -> None:  # noqa: B027
        """Keep one parameter's counts as well (GradHist2d's ``keep_individual``)."""

    @abc.abstractmethod
    def _count(self, global_step: int, view: ParamView) -> Tensor:
        """Implemented by each subclass."""

    def _edges(self, axis: int) -> _EdgeCache:
        if axis not in self.acc.edges:
            lo, hi = self._ranges()[axis]
            self.acc.edges[axis] = _EdgeCache(lo, hi, self._bin_counts()[axis])
        return self.acc.edges[axis]

    @abc.abstractmethod
    def _ranges(self) -> list[Range]:
        """Implemented by each subclass."""

    @abc.abstractmethod
    def _bin_counts(self) -> list[int]:
        """Implemented by each subclass."""

    def track_step(self, global_step: int, ctx: TrackContext) -> list[tuple[int, Any]]:
        """Store the histogram (if scheduled), then let the policies move the range."""
        acc = self.acc
        results = super().track_step(global_step, ctx)
        ranges = self._ranges()
        for axis, policy in enumerate(self._policies()):
            if policy.should_compute(global_step):
                reduced = acc.reduced.get(axis, [])
                ranges[axis] = policy.compute(global_step, ctx, reduced, ranges[axis])
        self._set_ranges(ranges)
        return results

    @abc.abstractmethod
    def _set_ranges(self, ranges: list[Range]) -> None:
        """Implemented by each subclass."""

    def _empty_counts(self) -> Tensor:
        return torch.zeros(math.prod(self._bin_counts()), dtype=torch.int64)

    def _result(self, counts: Tensor | None) -> dict[str, Any]:
        counts = self._empty_counts() if counts is None else counts
        axes = range(len(self._bin_counts()))
        edges = [self._edges(axis).cpu for axis in axes]  # host tensors
        return {
            "hist": counts.reshape(self._bin_counts()),  # recorded as lists
            "edges": edges[0] if len(edges) == 1 else edges,
        }

    def state_dict(self) -> dict[str, Any]:
        """Return the current (possibly adapted) range."""
        return {"range": self._ranges()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a range saved by :meth:`state_dict`."""
        if "range" in state:
            self._set_ranges([tuple(r) for r in state["range"]])


class GradHist1d(_Histogram):
    """Histogram of all individual gradient elements ``g_{i,d}``.

    The multiset holds ``N * D`` values: every sample ``i`` of the mini-batch and
    every coordinate ``d`` of every parameter. Values outside ``range`` are clamped
    into it, so outliers pile up in the two outer bins (``torch.histc`` semantics: a
    value equal to the upper limit counts in the last bin). See the module docstring
    for the exact binning rule.

    Output at a tracked step: ``{"hist": [bins] ints, "edges": [bins + 1] floats}``.

    Args:
        track_schedule: When to track.
        verbose: Extra diagnostics (the policy warns on range changes).
        bins: Number of equal-width bins.
        range: ``(lo, hi)`` of the bins.
        adapt: A policy from :mod:`cockpit.quantities.bin_adaptation` that moves the
            range after the histogram of its scheduled steps (``None``: fixed range).
        key: History key (default ``"GradHist1d"``).

    Raises:
        ValueError: For a non-positive ``bins`` or an empty or non-finite ``range``.
        TypeError: If ``adapt`` is not a policy.
    """

    shard_local = _Histogram.shard_local

    def __init__(
        self,
        track_schedule: Callable[[int], bool],
        verbose: bool = False,
        bins: int = 100,
        range: Range = (-2, 2),
        adapt: BinAdaptation | None = None,
        key: str | None = None,
    ):
        super().__init__(track_schedule, verbose=verbose, key=key)
        self.bins = _check_bins(bins, "bins")
        self.range = _check_range(range, "range")
        self.adapt = as_policy(adapt)

    # 1.0.2's attribute names, read by quantities copied from its GradHist1d
    _bins = Alias102("bins")
    _range = Alias102("range")
    _adapt = Alias102("adapt")

    def _policies(self) -> Sequence[BinAdaptation]:
        return (self.adapt,)

    def _ranges(self) -> list[Range]:
        return [self.range]

    def _set_ranges(self, ranges: list[Range]) -> None:
        self.range = _check_range(ranges[0], "range")

    def _bin_counts(self) -> list[int]:
        return [self.bins]

    def _count(self, global_step: int, view: ParamView) -> Tensor:
        edges = self._edges(0).like(view.param)
        factors = kernels.linear_factors(view)
        if factors is not None and factors.positions == 1:
            counts = kernels.histogram_1d_outer(
                factors.grad_output[:, 0].detach(),
                factors.inputs[:, 0].detach(),
                float(factors.batch_size),
                edges,
                self.range,
            )
            if counts is not None:
                return counts
        total = torch.zeros(self.bins, dtype=torch.int64, device=view.param.device)
        for values in view.individual_gradient_chunks():
            total += kernels.histogram_1d(values.detach(), edges, self.range)
        return total

    def _compute(self, global_step: int, ctx: TrackContext) -> dict[str, Any]:
        return self._result(self.acc.counts)


class GradHist2d(_Histogram):
    """Joint histogram of individual gradient elements and parameter values.

    The pairs are ``(g_{i,d}, theta_d)`` for every sample ``i`` and every coordinate
    ``d`` of every parameter (each parameter value repeated ``N`` times). The first
    axis (``x``) holds gradients, the second (``y``) parameters. On each axis with
    ``bins`` bins of width ``w`` on ``[lo, hi]``, values are clamped to
    ``[lo + w/2, hi - w/2]`` (outliers land in the outer bins) and binned by
    ``floor((v - lo) / w)`` (made exact against the published edges, see the module
    docstring).

    Output: ``{"hist": [xbins][ybins] ints, "edges": [xedges, yedges]}``; with
    ``keep_individual`` also ``"param_groups"`` (the number of parameter tensors) and
    ``"param_<k>"``: ``{"hist", "edges"}`` of tensor ``k`` alone.

    Args:
        track_schedule: When to track.
        verbose: Extra diagnostics (the policies warn on range changes).
        bins: ``(xbins, ybins)``, or one int for both axes.
        range: ``((xlo, xhi), (ylo, yhi))``.
        adapt: ``(x_policy, y_policy)``; ``None`` entries keep that axis fixed.
        keep_individual: Also store the histogram of every parameter tensor.
        key: History key (default ``"GradHist2d"``).

    Raises:
        ValueError: For malformed ``bins``, ``range`` or ``adapt``.
        TypeError: If an ``adapt`` entry is not a policy.
    """

    shard_local = _Histogram.shard_local

    def __init__(
        self,
        track_schedule: Callable[[int], bool],
        verbose: bool = False,
        bins: tuple[int, int] | int = (40, 50),
        range: tuple[Range, Range] = ((-1, 1), (-2, 2)),
        adapt: tuple[BinAdaptation | None, BinAdaptation | None] = (None, None),
        keep_individual: bool = False,
        key: str | None = None,
    ):
        super().__init__(track_schedule, verbose=verbose, key=key)
        if isinstance(bins, int) and not isinstance(bins, bool):
            bins = (bins, bins)
        xbins, ybins = _pair(bins, "bins")
        self.bins = (_check_bins(xbins, "bins[0]"), _check_bins(ybins, "bins[1]"))
        xrange, yrange = _pair(range, "range")
        self.range = (
            _check_range(xrange, "range[0]"),
            _check_range(yrange, "range[1]"),
        )
        if adapt is None:
            adapt = (None, None)
        xadapt, yadapt = _pair(adapt, "adapt")
        self.adapt = (as_policy(xadapt, "adapt[0]"), as_policy(yadapt, "adapt[1]"))
        self.keep_individual = bool(keep_individual)

    # 1.0.2's attribute names, read by quantities copied from its GradHist2d
    _bins = Alias102("bins")
    _range = Alias102("range")
    _adapt = Alias102("adapt")
    _keep_individual = Alias102("keep_individual")

    def _keep(self, index: int, counts: Tensor) -> None:
        """With ``keep_individual``, keep this parameter's own counts too."""
        if self.keep_individual:
            self.acc.per_param[index] = counts

    def _policies(self) -> Sequence[BinAdaptation]:
        return self.adapt

    def _ranges(self) -> list[Range]:
        return list(self.range)

    def _set_ranges(self, ranges: list[Range]) -> None:
        self.range = (
            _check_range(ranges[0], "range[0]"),
            _check_range(ranges[1], "range[1]"),
        )

    def _bin_counts(self) -> list[int]:
        return list(self.bins)

    def _count(self, global_step: int, view: ParamView) -> Tensor:
        params = view.param.detach().flatten()
        (xlo, xhi), (ylo, yhi) = self.range
        clamps = (
            kernels.inner_clamp(xlo, xhi, self.bins[0]),
            kernels.inner_clamp(ylo, yhi, self.bins[1]),
        )
        xedges, yedges = self._edges(0).like(params), self._edges(1).like(params)
        total = torch.zeros(
            math.prod(self.bins), dtype=torch.int64, device=view.param.device
        )
        y_index = kernels.bin_index(params, yedges, self.range[1], clamps[1]).long()
        y_counts = torch.bincount(y_index, minlength=self.bins[1] + 1)
        factors = kernels.linear_factors(view)
        if factors is not None and factors.positions == 1:
            counts = kernels.histogram_2d_outer(
                factors.grad_output[:, 0].detach(),
                factors.inputs[:, 0].detach(),
                float(factors.batch_size),
                y_index,
                xedges,
                self.bins[1],
                self.range[0],
                clamps[0],
            )
            if counts is not None:
                return counts.reshape(-1)
        blocks = view.individual_gradient_chunks()
        for block in blocks:
            grads = block.detach().flatten(start_dim=1)
            counts = kernels.histogram_2d(
                grads,
                params,
                xedges,
                yedges,
                self.range,
                clamps,
                y_index=y_index,
                y_counts=y_counts,
            )
            total += counts.reshape(-1)
        return total

    def _compute(self, global_step: int, ctx: TrackContext) -> dict[str, Any]:
        result = self._result(self.acc.counts)
        if self.keep_individual:
            per_param = self.acc.per_param
            result["param_groups"] = len(ctx.params)
            for k in range(len(ctx.params)):
                single = self._result(per_param.get(k))
                result[f"param_{k}"] = single
        return result
