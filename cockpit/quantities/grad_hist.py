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

import numpy as np
import torch
from torch import Tensor

from cockpit.needs import Need
from cockpit.param_view import ParamView
from cockpit.per_sample import LinearFactors
from cockpit.quantities.base import SingleStepQuantity, TrackContext
from cockpit.quantities.bin_adaptation import BinAdaptation, as_policy
from cockpit.quantities.compat import Alias102

Range = tuple[float, float]


# --- pure functions ----------------------------------------------------------------
def histogram_edges(lo: float, hi: float, bins: int) -> Tensor:
    """Return the ``bins + 1`` edges of equal-width bins on ``[lo, hi]`` (float64, CPU).

    ``edges[k] = lo + k * ((hi - lo) / bins)`` and ``edges[bins] = hi``, the same
    arithmetic as ``numpy.linspace(lo, hi, bins + 1)``.
    """
    edges = torch.arange(bins + 1, dtype=torch.float64) * ((hi - lo) / bins) + lo
    edges[-1] = hi
    return edges


def bin_index(
    values: Tensor,
    edges: Tensor,
    limits: Range,
    clamp: Range | None = None,
    correct_all: bool | None = None,
) -> Tensor:
    """Map values to bin indices: ``k`` iff ``edges[k] <= v < edges[k + 1]``.

    Values are first clamped to ``clamp`` (which must lie inside ``limits``); the
    last bin is closed on the right. The index is ``trunc((v - lo) * bins / (hi -
    lo))``; values whose scaled position lies within rounding distance of an integer
    (and NaN) are then re-checked against ``edges`` and moved by one bin where the
    edges say so. On the CPU only those few values are re-checked; elsewhere all
    values are (no device synchronisation); the result is the same. Exact zeros,
    when many values lie near edges, get the bin of ``0`` found once. Half-precision
    values (float16, bfloat16), whose scaled position can be off by more than one
    bin, are located by a binary search of the edges instead.

    Args:
        values: Any shape; floating point.
        edges: The ``bins + 1`` increasing edges, on the device and in the dtype of
            ``values``.
        limits: ``(lo, hi)``: the outer edges as Python floats.
        clamp: ``(low, high)`` to clamp the values to before binning; ``None``
            clamps to ``limits``.
        correct_all: Re-check every value against the edges (default: unless on
            the CPU).

    Returns:
        Integer indices (``int32``, or ``int64`` for more than ``2**31 - 2`` bins)
        of the same shape as ``values``, in ``[0, bins - 1]``; NaN values get the
        index ``bins`` (an overflow slot that callers drop).
    """
    bins = edges.numel() - 1
    lo, hi = limits
    low, high = limits if clamp is None else clamp
    v = values.clamp(low, high).contiguous()
    if torch.finfo(v.dtype).eps > torch.finfo(torch.float32).eps:
        return _index_by_search(v, edges)
    position = (v - lo).mul_(bins / (hi - lo))  # in [0, bins], or NaN
    index = position.to(_index_dtype(bins + 1))  # garbage for NaN, fixed below
    if correct_all is None:
        correct_all = v.device.type != "cpu"
    if correct_all:
        return _correct(v, index, edges)
    # |position - nearest integer| > delta rules out rounding across an edge: the
    # position and the edges are each off by a few ulps of max(|lo|, |hi|)
    eps = torch.finfo(v.dtype).eps
    delta = 16 * eps * bins * (1 + max(abs(lo), abs(hi)) / (hi - lo))
    centred = position.frac_().sub_(0.5).abs_()  # NaN stays NaN
    suspicious = torch.le(centred, 0.5 - delta).logical_not_().reshape(-1)
    many = int(torch.count_nonzero(suspicious)) * 8 > suspicious.numel()
    zeros = None
    if many and low <= 0.0 <= high:
        # Exact zeros (an embedding's rows no sample uses, inactive units) sit on
        # the edge at 0 of a symmetric range and would all be re-checked: they
        # share one bin, found once.
        zeros = torch.eq(v, 0).reshape(-1)
        if int(torch.count_nonzero(zeros)):
            suspicious.logical_and_(zeros.logical_not())
            many = int(torch.count_nonzero(suspicious)) * 8 > suspicious.numel()
        else:
            zeros = None
    if many:
        index = _correct(v, index, edges)  # many near edges: all at once
    else:
        where = suspicious.nonzero().squeeze(1)
        if where.numel():
            flat = index.view(-1)
            flat[where] = _correct(v.reshape(-1)[where], flat[where], edges)
    if zeros is not None:
        zero = torch.zeros(1, dtype=v.dtype, device=v.device)
        index.view(-1).masked_fill_(zeros, _index_by_search(zero, edges).squeeze(0))
    return index


def _index_dtype(slots: int) -> torch.dtype:
    """``int32`` (faster to convert and count) unless ``slots`` needs ``int64``."""
    return torch.int32 if slots < 2**31 - 1 else torch.int64


def _correct(v: Tensor, index: Tensor, edges: Tensor) -> Tensor:
    """Move ``index`` by at most one bin so that ``edges[k] <= v < edges[k + 1]``."""
    bins = edges.numel() - 1
    nan = torch.isnan(v)
    index = index.clamp(0, bins - 1).masked_fill_(nan, 0)
    flat = index.reshape(-1).long()
    below = v < edges.index_select(0, flat).view_as(v)
    index.sub_(below.to(index.dtype))
    flat = index.reshape(-1).long() + 1
    above = v >= edges.index_select(0, flat).view_as(v)
    index.add_((above & (index < bins - 1)).to(index.dtype))
    return index.masked_fill_(nan, bins)


#: A block whose values span at most this many bins is counted by comparisons.
FEW_BINS = 4


def _span(
    values: Tensor, edges: Tensor, limits: Range, clamp: Range | None
) -> tuple[int, int] | None:
    """Bins ``(k_lo, k_hi)`` of the smallest and largest value, ``None`` if too wide.

    Also ``None`` for empty input or NaN (the general path handles those).
    """
    if values.numel() == 0:
        return None
    bins = edges.numel() - 1
    extremes = torch.stack(torch.aminmax(values.reshape(-1)))
    k_lo, k_hi = bin_index(extremes, edges, limits, clamp, correct_all=True).tolist()
    if k_lo == bins or k_hi == bins or k_hi - k_lo > FEW_BINS:
        return None
    return k_lo, k_hi


def _counts_by_comparison(
    values: Tensor, edges: Tensor, k_lo: int, k_hi: int, dim: int | None
) -> list[Tensor]:
    """Counts of bins ``k_lo..k_hi`` (summed over ``dim``) when all values lie there.

    Bin ``k`` holds ``#(v >= e_k) - #(v >= e_{k+1})``; below ``e_{k_lo + 1}`` means
    ``k_lo`` (clamped values included) and at least ``e_{k_hi}`` means ``k_hi``, so
    the rule ``e_k <= v < e_{k+1}`` is applied exactly, without a bin index.
    """
    total = values.shape[dim] if dim is not None else values.numel()

    def at_least(k: int) -> Tensor:
        above = torch.ge(values, edges[k])
        return torch.count_nonzero(above, dim=dim)  # faster than a bool sum

    cumulative = [at_least(k) for k in range(k_lo + 1, k_hi + 1)]
    counts, previous = [], total
    for above in cumulative:
        counts.append(previous - above)
        previous = above
    counts.append(previous if cumulative else torch.as_tensor(total))
    return counts


#: Blocks of at most this many values are counted by searching the edges
#: (``torch.bucketize``: exact comparisons, a handful of kernels). The other paths
#: cost ~0.3 ms before the first value (extremes, bin positions, checks near edges),
#: which dominates a small parameter's block: measured on one thread, 43-77 us
#: against ~300 us for 64 to 2048 values, 0.18-0.30 ms against 0.36 ms at 8192; from
#: ~10k-25k values on, the general path's ~6-10 ns per value wins.
SEARCH_AT_MOST = 8192


def _index_by_search(v: Tensor, edges: Tensor) -> Tensor:
    """Bin indices of clamped values by a binary search in ``edges``.

    Exact comparisons; of equal edges the last one holds the value; NaN: ``bins``.
    """
    bins = edges.numel() - 1
    index = torch.bucketize(v, edges, right=True).sub_(1).clamp_(0, bins - 1)
    index.masked_fill_(torch.isnan(v), bins)  # NaN: the overflow slot, dropped
    return index.to(_index_dtype(bins + 1))


def _counts_by_search(values: Tensor, edges: Tensor, limits: Range) -> Tensor:
    """Counts by a binary search of every value in ``edges`` (see histogram_1d)."""
    bins = edges.numel() - 1
    index = _index_by_search(values.reshape(-1).clamp(*limits), edges)
    return torch.bincount(index, minlength=bins + 1)[:bins]


def histogram_1d(values: Tensor, edges: Tensor, limits: Range) -> Tensor:
    """Count ``values`` into the bins of ``edges``, clamping them to the outer edges.

    Values below ``lo`` count in the first bin, values above ``hi`` in the last one
    (``torch.histc`` semantics after clamping); NaN is not counted.

    Args:
        values: Any shape; floating point.
        edges: The ``bins + 1`` edges in the dtype and on the device of ``values``.
        limits: ``(lo, hi)``, the outer edges as Python floats.

    Returns:
        ``int64`` counts, shape ``[bins]``.
    """
    if values.numel() <= SEARCH_AT_MOST:
        return _counts_by_search(values, edges, limits)
    return _counts_by_position(values, edges, limits)


def _counts_by_position(values: Tensor, edges: Tensor, limits: Range) -> Tensor:
    """Counts by comparisons (few bins occupied) or by bin positions."""
    bins = edges.numel() - 1
    span = _span(values, edges, limits, None)
    if span is not None:
        k_lo, k_hi = span
        out = torch.zeros(bins, dtype=torch.int64, device=values.device)
        counts = _counts_by_comparison(values, edges, k_lo, k_hi, dim=None)
        out[k_lo : k_hi + 1] = torch.stack([torch.as_tensor(c) for c in counts])
        return out
    index = bin_index(values, edges, limits)
    return torch.bincount(index.reshape(-1), minlength=bins + 1)[:bins]


#: The outer-product path runs where its searches cost at most this fraction of
#: visiting every value once (per spanned edge: one binary search over a row).
OUTER_COST_FRACTION = 0.5


def _outer_values(delta: Tensor, inputs: Tensor, scale: float) -> Tensor:
    """``(delta * inputs) * scale``, rounded as :class:`LinearFactors` rounds them.

    ``LinearFactors.materialize`` forms each value as one product (a batched matrix
    product over a single position) and then multiplies by ``scale`` unless it is 1:
    two roundings, reproduced here elementwise.
    """
    values = delta * inputs
    return values.mul_(scale) if scale != 1.0 else values


def histogram_1d_outer(
    delta: Tensor,
    inputs: Tensor,
    scale: float,
    edges: Tensor,
    limits: Range,
    force: bool = False,
) -> Tensor | None:
    """Count the values ``v[i, a, b] = (delta[i, a] * inputs[i, b]) * scale``.

    The per-sample gradients of a ``Linear`` weight (one position per sample) are
    such products. The counts equal :func:`histogram_1d` of the materialised values
    exactly, without forming them: for fixed ``(i, a)`` the rounded value is a
    monotone function of ``inputs[i, b]`` (non-decreasing for ``delta[i, a] > 0``,
    non-increasing for ``< 0``, constant for ``0``; rounding and clamping are
    monotone). With each sample's inputs sorted once, the row ``(i, a)`` spans the
    bins from that of its smallest to that of its largest value, and for every edge
    ``e_k`` strictly inside that span ``#(v >= e_k)`` is found by a binary search
    over the sorted inputs that evaluates the rounded product itself (no division,
    no threshold approximated); bin ``k`` of the row then holds
    ``#(v >= e_k) - #(v >= e_{k+1})``. A row inside one bin costs nothing but its
    two extreme values.

    Args:
        delta: ``[N, out]``.
        inputs: ``[N, in]``, same dtype and device.
        scale: The factor applied after the product (``N`` for unscaled ``g_i``).
        edges: The ``bins + 1`` edges in the dtype of the values.
        limits: ``(lo, hi)``, the outer edges as Python floats.
        force: Search even when materialising would be cheaper (for tests).

    Returns:
        ``int64`` counts, shape ``[bins]``; ``None`` if a factor is not finite (a
        product could be NaN) or the searches would cost more than counting the
        materialised values (then count those instead).
    """
    bins = edges.numel() - 1
    n, out = delta.shape
    dim = inputs.shape[1]
    counts = torch.zeros(bins, dtype=torch.int64, device=delta.device)
    if n * out * dim == 0:
        return counts
    if not bool(torch.isfinite(delta).all() & torch.isfinite(inputs).all()):
        return None
    ordered = _sorted_rows(inputs)
    first = _outer_values(delta, ordered[:, :1], scale)
    last = _outer_values(delta, ordered[:, -1:], scale)
    extremes = torch.stack([torch.minimum(first, last), torch.maximum(first, last)])
    k_lo, k_hi = bin_index(extremes, edges, limits, correct_all=True).long()
    k_lo, k_hi = k_lo.reshape(-1), k_hi.reshape(-1)
    span = k_hi - k_lo  # edges strictly inside each row's range of values
    searches = int(span.sum())
    steps = max(1, (dim - 1).bit_length()) + 1
    if not force and searches * steps > OUTER_COST_FRACTION * n * out * dim:
        return None
    counts += torch.bincount(k_lo, minlength=bins) * dim
    if searches == 0:
        return counts
    rows = span.nonzero().squeeze(1)
    width = span.index_select(0, rows)
    row = torch.repeat_interleave(rows, width, output_size=searches)
    # edge of each search: k_lo + 1, ..., k_hi of its row
    first_query = torch.cumsum(width, 0) - width
    shift = torch.repeat_interleave(
        first_query - k_lo.index_select(0, rows) - 1, width, output_size=searches
    )
    edge = torch.arange(searches, device=delta.device) - shift
    counts += _searched_counts(delta, ordered, scale, edges, row, edge)
    return counts


def _sorted_rows(values: Tensor) -> Tensor:
    """Each row sorted ascending (finite values; the order of ties is irrelevant).

    On the CPU NumPy's sort (vectorised, many times faster than ``torch.sort`` on
    short rows); sorting is exact, so the result is the same either way.
    """
    if values.device.type == "cpu" and values.dtype in (torch.float32, torch.float64):
        return torch.from_numpy(np.sort(values.detach().numpy(), axis=1))
    return torch.sort(values, dim=1).values


def _searched_counts(
    delta: Tensor,
    ordered: Tensor,
    scale: float,
    edges: Tensor,
    row: Tensor,
    edge: Tensor,
) -> Tensor:
    """The contribution of ``#(v >= e_edge)`` of each searched ``(row, edge)`` pair.

    Along the sorted inputs, ``q(p) = (v_p < e) xor (delta < 0)`` is true on a
    prefix; the branch-free lower-bound search finds its length ``p`` in
    ``ceil(log2(in)) + 1`` vectorised rounds. ``#(v >= e)`` is ``in - p`` for a
    positive ``delta`` and ``p`` for a negative one; it is added to bin ``edge``
    and subtracted from bin ``edge - 1``.
    """
    bins = edges.numel() - 1
    out = delta.shape[1]
    dim = ordered.shape[1]
    itype = torch.int32 if ordered.numel() < 2**31 - 1 else torch.int64
    d = delta.reshape(-1).index_select(0, row)
    e = edges.index_select(0, edge)
    negative = d < 0
    offset = torch.div(row, out, rounding_mode="floor").mul_(dim).to(itype)
    flat = ordered.reshape(-1)

    def q(position: Tensor) -> Tensor:
        values = _outer_values(d, flat.index_select(0, offset + position), scale)
        return torch.lt(values, e).ne_(negative)

    position = torch.zeros_like(offset)
    length = dim
    while length > 1:
        half = length // 2
        position += q(position + half).to(itype).mul_(half)
        length -= half
    position += q(position).to(itype)
    above = torch.where(negative, position, dim - position).to(torch.float64)
    # counts[k] += above(k) - above(k + 1), summed exactly in float64 (< 2**53)
    per_edge = torch.bincount(edge, weights=above, minlength=bins + 1)
    per_edge = per_edge.to(torch.int64)
    return per_edge[:bins] - per_edge[1:]


def _inner_clamp(lo: float, hi: float, bins: int) -> Range:
    """The clamp range of the 2-D histogram: the centres of the two outer bins."""
    half = (hi - lo) / bins / 2
    return (lo + half, hi - half)


def histogram_2d(
    x: Tensor,
    y: Tensor,
    xedges: Tensor,
    yedges: Tensor,
    limits: tuple[Range, Range],
    clamps: tuple[Range, Range],
    y_index: Tensor | None = None,
    y_counts: Tensor | None = None,
) -> Tensor:
    """Count the pairs ``(x[i, d], y[d])`` into a 2-D histogram.

    Args:
        x: Values on the first axis, shape ``[N, D]``.
        y: Values on the second axis, shape ``[D]`` (shared by all ``N`` rows).
        xedges: Edges of the first axis (``xbins + 1``), dtype/device of ``x``.
        yedges: Edges of the second axis (``ybins + 1``), dtype/device of ``y``.
        limits: ``(lo, hi)`` of each axis as Python floats.
        clamps: Clamp range of each axis before binning.
        y_index: ``bin_index(y, yedges, limits[1], clamps[1])`` if already known
            (a caller counting many blocks against one ``y`` computes it once).
        y_counts: ``torch.bincount(y_index, minlength=ybins + 1)``, likewise.

    Returns:
        ``int64`` counts, shape ``[xbins, ybins]``; pairs with a NaN are not counted.
    """
    xbins, ybins = xedges.numel() - 1, yedges.numel() - 1
    total = xbins * ybins
    if y_index is None:
        y_index = bin_index(y, yedges, limits[1], clamps[1], correct_all=True)
    iy = y_index.long()  # NaN: ybins, an overflow column dropped at the end
    span = _span(x, xedges, limits[0], clamps[0])
    if span is not None:
        k_lo, k_hi = span
        out = torch.zeros(xbins, ybins + 1, dtype=torch.int64, device=x.device)
        if k_lo == k_hi:  # every pair of the block is in x-bin k_lo
            if y_counts is None:
                y_counts = torch.bincount(iy, minlength=ybins + 1)
            out[k_lo] = y_counts * x.shape[0]
            return out[:, :ybins]
        per_column = _counts_by_comparison(x, xedges, k_lo, k_hi, dim=0)
        for k, column_counts in zip(range(k_lo, k_hi + 1), per_column):
            column_counts = torch.as_tensor(column_counts, device=x.device)
            column_counts = column_counts.expand(iy.shape).to(torch.int64)
            out[k].index_add_(0, iy, column_counts)
        return out[:, :ybins]
    # a NaN x has index xbins, a NaN y is sent to `total`: both flat indices end
    # up at or above `total`, in slots that are dropped (no mask over the pairs)
    itype = _index_dtype(2 * total + 1)
    ix = bin_index(x, xedges, limits[0], clamps[0]).to(itype)
    iy = iy.masked_fill(iy == ybins, total).to(itype).unsqueeze(0)
    flat = ix.mul_(ybins).add_(iy)
    counts = torch.bincount(flat.reshape(-1), minlength=total + 1)[:total]
    return counts.reshape(xbins, ybins)


def histogram_2d_outer(
    delta: Tensor,
    inputs: Tensor,
    scale: float,
    y_index: Tensor,
    xedges: Tensor,
    ybins: int,
    limits: Range,
    clamp: Range,
    max_elements: int = 1 << 18,
) -> Tensor | None:
    """2-D counts of the pairs ``(v[i, a, b], y[a, b])`` of an outer product.

    ``v[i, a, b] = (delta[i, a] * inputs[i, b]) * scale`` (rounded twice).

    The per-sample gradients of a ``Linear`` weight (one position per sample)
    against the weight's values, counted exactly as :func:`histogram_2d` counts the
    materialised values, row ``(i, a)`` by row:

    * the row's values are a monotone function of ``inputs[i, b]`` (see
      :func:`histogram_1d_outer`), so its smallest and largest values, hence its
      x-bins, come from the two extreme inputs;
    * a row inside one x-bin ``k`` adds the y-histogram of weight row ``a`` to
      x-bin ``k`` (all rows at once: one matrix product);
    * a row in the two x-bins around an edge at exactly ``0`` has ``v >= 0`` iff
      ``inputs[i, b] >= 0`` (``delta > 0``) or ``<= 0`` (``delta < 0``), unless a
      product rounds to zero (then this step is skipped); the counts per weight
      ``(a, b)`` are two matrix products of 0/1 matrices, exact in float64;
    * only the remaining rows are formed (``[rows, in]`` blocks) and binned.

    Args:
        delta: ``[N, out]``.
        inputs: ``[N, in]``.
        scale: The factor applied after the product (``N`` for unscaled ``g_i``).
        y_index: The weight's y-bin indices, ``[out * in]`` (``ybins`` for NaN).
        xedges: The x-edges in the dtype of the values.
        ybins: Number of y-bins.
        limits: ``(lo, hi)`` of the x-axis.
        clamp: The x clamp range.
        max_elements: Size of the blocks of remaining rows.

    Returns:
        ``int64`` counts ``[xbins, ybins]``; ``None`` if a factor is not finite.
    """
    n, out = delta.shape
    dim = inputs.shape[1]
    xbins = xedges.numel() - 1
    device = delta.device
    if n * out * dim == 0:
        return torch.zeros(xbins, ybins, dtype=torch.int64, device=device)
    if not bool(torch.isfinite(delta).all() & torch.isfinite(inputs).all()):
        return None
    iy = y_index.reshape(out, dim)
    # y-histogram of every weight row, [out, ybins + 1] (last column: NaN weights)
    rows_y = torch.zeros(out, ybins + 1, dtype=torch.float64, device=device)
    rows_y.scatter_add_(1, iy, torch.ones_like(iy, dtype=torch.float64))
    x_lo, x_hi = torch.aminmax(inputs, dim=1, keepdim=True)
    first, last = _outer_values(delta, x_lo, scale), _outer_values(delta, x_hi, scale)
    extremes = torch.stack([torch.minimum(first, last), torch.maximum(first, last)])
    k_lo, k_hi = bin_index(extremes, xedges, limits, clamp, correct_all=True).long()
    grid = torch.zeros(xbins, ybins + 1, dtype=torch.float64, device=device)
    # rows inside one x-bin: grid[k] += sum over those rows (i, a) of rows_y[a]
    single = k_lo == k_hi
    per_bin = torch.zeros(xbins, out, dtype=torch.float64, device=device)
    per_bin.index_put_(
        (k_lo[single], single.nonzero()[:, 1]),
        torch.ones((), dtype=torch.float64, device=device),
        accumulate=True,
    )
    grid += per_bin @ rows_y
    rest = ~single
    zero = _zero_edge(xedges)
    if zero is not None:
        both = rest & (k_lo == zero - 1) & (k_hi == zero)
        if bool(both.any()) and not _may_round_to_zero(delta, inputs, scale, both):
            positive = (both & (delta > 0)).double()
            negative = (both & (delta < 0)).double()
            at_least = positive.T @ (inputs >= 0).double()
            at_least += negative.T @ (inputs <= 0).double()  # [out, in]
            below = both.double().sum(0, keepdim=True).T - at_least
            grid[zero].index_add_(0, y_index, at_least.reshape(-1))
            grid[zero - 1].index_add_(0, y_index, below.reshape(-1))
            rest &= ~both
    counts = grid.round().to(torch.int64)[:, :ybins]
    samples, outputs = rest.nonzero().unbind(1)
    step = max(1, max_elements // dim)
    total = xbins * ybins
    slots = _index_dtype(2 * total + 1)  # int32 unless huge (NaN rows: ix = xbins)
    iy = iy.masked_fill(iy == ybins, total).to(slots)  # NaN weights: dropped slots
    for start in range(0, samples.numel(), step):
        i, a = samples[start : start + step], outputs[start : start + step]
        # (delta * input) * scale as _outer_values rounds it, in the gathered rows
        if delta.dtype == inputs.dtype:  # in place; products round as below
            values = inputs.index_select(0, i).mul_(delta[i, a].unsqueeze(1))
            if scale != 1.0:
                values.mul_(scale)
        else:
            values = _outer_values(
                delta[i, a].unsqueeze(1), inputs.index_select(0, i), scale
            )
        ix = bin_index(values, xedges, limits, clamp).to(slots)
        flat = ix.mul_(ybins).add_(iy.index_select(0, a))
        block = torch.bincount(flat.reshape(-1), minlength=total + 1)[:total]
        counts += block.reshape(xbins, ybins)
    return counts


def _zero_edge(edges: Tensor) -> int | None:
    """Index ``k`` of an inner edge exactly at ``0``, if there is one."""
    zeros = (edges == 0).nonzero()
    if zeros.numel() != 1:
        return None
    k = int(zeros)
    return k if 0 < k < edges.numel() - 1 else None


def _may_round_to_zero(
    delta: Tensor, inputs: Tensor, scale: float, rows: Tensor
) -> bool:
    """Whether a product of non-zero factors in ``rows`` could round to zero.

    Rounding is monotone in the magnitude, so it suffices that the product of the
    smallest non-zero magnitudes does not (taken over all samples with such a row:
    a safe over-estimate).
    """
    d = delta.abs()[rows & (delta != 0)]
    x = inputs.abs()[rows.any(1)]
    x = x[x != 0]
    if d.numel() == 0 or x.numel() == 0:
        return False
    return float(_outer_values(d.min(), x.min(), scale)) == 0.0


def linear_factors(view: ParamView) -> LinearFactors | None:
    """The factors of a ``Linear`` weight's per-sample gradients, if the view has them.

    ``g_i = N * b_i`` with ``b_i`` from :class:`~cockpit.per_sample.LinearFactors`.
    ``None`` for any other representation: the histograms then count the
    materialised blocks.
    """
    factors = view.linear_factors()
    return factors if isinstance(factors, LinearFactors) else None


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
        self.cpu = histogram_edges(lo, hi, bins)
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
        edges = [self._edges(axis).cpu.tolist() for axis in axes]
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
        factors = linear_factors(view)
        if factors is not None and factors.positions == 1:
            counts = histogram_1d_outer(
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
            total += histogram_1d(values.detach(), edges, self.range)
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
            _inner_clamp(xlo, xhi, self.bins[0]),
            _inner_clamp(ylo, yhi, self.bins[1]),
        )
        xedges, yedges = self._edges(0).like(params), self._edges(1).like(params)
        total = torch.zeros(
            math.prod(self.bins), dtype=torch.int64, device=view.param.device
        )
        y_index = bin_index(params, yedges, self.range[1], clamps[1]).long()
        y_counts = torch.bincount(y_index, minlength=self.bins[1] + 1)
        factors = linear_factors(view)
        if factors is not None and factors.positions == 1:
            counts = histogram_2d_outer(
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
            counts = histogram_2d(
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
