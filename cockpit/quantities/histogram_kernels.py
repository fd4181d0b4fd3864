"""Histogram kernels: exact counts of per-sample gradient elements, on any device.

The counting behind :class:`~cockpit.quantities.grad_hist.GradHist1d` and
:class:`~cockpit.quantities.grad_hist.GradHist2d` (the binning rule is stated in
:mod:`cockpit.quantities.grad_hist`): flat bin indices and ``torch.bincount``
(:func:`bin_index`, :func:`histogram_1d`, :func:`histogram_2d`), comparisons for
blocks that span few bins, and counts of a ``Linear`` weight's per-sample gradients
from its two factors without forming them (:func:`histogram_1d_outer`,
:func:`histogram_2d_outer`). Pure functions of tensors; no quantity here.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from cockpit.param_view import ParamView
from cockpit.per_sample import LinearFactors

Range = tuple[float, float]


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


def inner_clamp(lo: float, hi: float, bins: int) -> Range:
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
