"""Per-parameter reductions of per-sample gradients shared by several quantities.

Everything here runs inside the backward pass (on a :class:`ParamView`) or finishes
the per-parameter sums afterwards. Per-parameter results are scalars or ``[N, N]``
matrices. In a data-parallel run the ``share_*`` functions replace the local sums by
those over all processes (see :meth:`cockpit.quantities.base.Quantity.share`).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field

import torch

from cockpit.needs import Need
from cockpit.param_view import ParamView
from cockpit.quantities import defined
from cockpit.quantities import functional as F
from cockpit.quantities.base import Missing, SingleStepQuantity, TrackContext


@dataclass
class PerParameter:
    """A step's partial results: one entry per parameter index."""

    entries: dict[int, tuple] = field(default_factory=dict)

    def ordered(self, num_params: int) -> list:
        """Return the entries in parameter order (all must be present)."""
        return [self.entries[index] for index in range(num_params)]


def squared_norm_entry(view: ParamView) -> tuple:
    """Reduce one parameter to ``(sum_i ||g_i,p||^2, ||g_p||^2 or None, N, spread)``.

    ``spread`` is ``sum_i ||g_i,p - g_p||^2`` in the two-pass form (the mean
    subtracted first, :meth:`ParamView.centered`) where the per-sample gradients
    are at hand as a tensor; otherwise ``None``, and :func:`total_spread` takes
    the difference of the two sums in float64. ``||g_p||^2`` comes from the
    per-sample gradients' mean when they exist; with ``BatchL2Grad`` alone it is
    ``None`` and :func:`total_spread` reads ``.grad`` instead.
    """
    batch_l2 = view.batch_l2().detach()
    grad_sq = spread = None
    if view.has_individual_gradients:
        grad_sq = (view.mean_gradient().detach() ** 2).sum()
        if view.centers_cheaply:
            spread = view.centered().spread().detach()
    return batch_l2.sum(), grad_sq, batch_l2.shape[0], spread


def share_squared_norms(acc: PerParameter, ctx: TrackContext, bucket, rows) -> None:
    """Data-parallel: sum ``sum_i ||g_i,p||^2`` over processes, in place.

    ``||g_p||^2`` is then read from the joined batch's gradient; on a
    ``fully_shard`` model (``rows``: the quantity's ``rows_of(ctx)``) summed over
    the processes' rows of it.
    """
    n_global = ctx.comm.n_global
    for index, entry in acc.entries.items():
        if rows is None:

            def then(total, index=index):
                acc.entries[index] = (total, None, n_global, None)

            bucket.sum(entry[0], then)
            continue
        grad = rows.grads[index]
        square = bucket.sum((grad**2).sum())  # (its value is set before any then)

        def then(total, index=index, square=square):
            acc.entries[index] = (total, square.value, n_global, None)

        bucket.sum(entry[0], then)


def parameter_spreads(acc: PerParameter, grads) -> tuple[torch.Tensor, torch.Tensor]:
    """``sum_i ||g_i,p - g_p||^2`` and ``||g_p||^2`` of every parameter, float64.

    The centred spread where the hook formed it; else the difference
    ``sum_i ||g_i,p||^2 - N ||g_p||^2`` of the two float64 sums, clamped at 0:
    within ``ULPS eps (sum_i ||g_i,p||^2 + N ||g_p||^2)`` of the exact value
    (``eps`` of the dtype the sums were formed in; see
    :data:`cockpit.quantities.defined.ULPS`).

    Raises:
        RuntimeError: If parameters saw different batch sizes.
    """
    entries = acc.ordered(len(grads))
    n = batch_size_of(entries)
    spreads, squares = [], []
    for index, (sum_sq, grad_sq, _, spread) in enumerate(entries):
        grad_sq = grad_sq if grad_sq is not None else (grads[index] ** 2).sum()
        squares.append(defined.wide(grad_sq))
        if spread is None:
            spread = (defined.wide(sum_sq) - n * squares[-1]).clamp(min=0)
        spreads.append(defined.wide(spread))
    if not spreads:
        empty = torch.zeros(0, dtype=torch.float64)
        return empty, empty
    return torch.stack(spreads), torch.stack(squares)


def batch_size_of(entries) -> int:
    """The one batch size ``N`` of the entries (the third field of each).

    Raises:
        RuntimeError: If parameters saw different batch sizes.
    """
    sizes = {entry[2] for entry in entries}
    if len(sizes) > 1:
        raise RuntimeError(
            f"Parameters saw different batch sizes {sorted(sizes)} in one backward "
            "pass. Fix: compute the loss of a single mini-batch per step."
        )
    return sizes.pop() if sizes else 0


def checked_spreads(acc: PerParameter, grads) -> tuple:
    """:func:`parameter_spreads`, with ``N``, the sums' dtype and their checks.

    The checks (:data:`defined.Condition`) say where a sum is not finite; they are
    decided with the value on the host (:func:`defined.decided`).

    Raises:
        RuntimeError: If parameters saw different batch sizes.
    """
    entries = acc.ordered(len(grads))
    n = batch_size_of(entries)
    dtype = entries[0][0].dtype
    conditions = defined.nonfinite(*(entry[0] for entry in entries))
    spreads, squares = parameter_spreads(acc, grads)
    finite = torch.isfinite(spreads).all() & torch.isfinite(squares).all()
    conditions.append((~finite, dtype))
    return spreads, squares, n, dtype, conditions


def total_spread(acc: PerParameter, grads) -> tuple:
    """``sum_i ||g_i - g||^2``, ``||g||^2`` (float64), ``N``, the sums' dtype, checks.

    Summed over the parameters (:func:`checked_spreads`).
    """
    spreads, squares, n, dtype, conditions = checked_spreads(acc, grads)
    return spreads.sum(), squares.sum(), n, dtype, conditions


class GramQuantity(SingleStepQuantity):
    """Base for statistics of the centred ``||g_i - g||^2``, ``(g_i - g) . g``.

    These come from the diagonal and the row means of the per-sample Gram
    matrix; each parameter adds its share (``[N]`` each) to running sums inside
    the backward pass, so a module's per-sample results are reduced and freed in
    its hook, and no ``[N, N]`` matrix is formed. Where the per-sample gradients
    exist as a tensor the shares are centred in the two-pass form (the mean
    subtracted first: nothing cancels); where they are factors (a ``Linear``
    layer's, the ghost engine's) ``||g_i||^2``, ``g_i . g`` and ``||g||^2`` are
    summed and their differences taken in float64 after the step, which leaves
    an absolute error of about ``ULPS eps ||g_i|| (||g_i|| + ||g||)`` per sample
    (``eps`` of the dtype they were formed in). Subclasses implement
    ``_from_centered(norms, dots, grad_squared_norm)``.
    """

    @dataclass
    class Accumulator:
        """The running sums over parameters.

        ``raw`` holds ``(||g_i,p||^2, g_i,p . g_p, ||g_p||^2)`` summed over the
        parameters seen through factors, ``centred`` ``(||g_i,p - g_p||^2,
        (g_i,p - g_p) . g_p, ||g_p||^2)`` over the others. Data-parallel runs keep
        each parameter's per-sample gradients instead (``kept``): the
        projections ``g_i . g`` need the joined batch's ``g``. ``joined`` then
        holds the bucket slots of ``||g_i||^2`` and ``g_i . g`` over the joined
        batch.
        """

        raw: list | None = None
        centred: list | None = None
        kept: dict[int, object] = field(default_factory=dict)
        joined: tuple | None = None

    needs = frozenset({Need.BATCH_L2, Need.PROJECTIONS, Need.GRADIENT})
    shard_local = True

    def accumulate(self, global_step: int, view: ParamView) -> None:
        """Add the parameter's shares of the centred statistics to the sums."""
        if self.shared is not None:
            self.acc.kept[view.index] = view.keep_individual()
            return
        mean = view.mean_gradient().detach()
        square = (mean**2).sum()
        if view.centers_cheaply:
            centred = view.centered()
            parts = [centred.norms.detach(), centred.dots.detach(), square]
            self.acc.centred = _add(self.acc.centred, parts)
        else:
            parts = [view.batch_l2().detach(), view.mean_dots().detach(), square]
            self.acc.raw = _add(self.acc.raw, parts)

    def share(self, global_step: int, ctx: TrackContext, bucket) -> None:
        """Project the kept per-sample gradients onto the joined ``g``; gather.

        Every Gram quantity of the step kept the same per-sample gradients, so
        the first computes and sends the projections, the others reuse them.
        """
        acc = self.acc
        joined = ctx.comm.common.get("gram projections")
        if joined is None:
            rows = self.rows_of(ctx)
            grads = ctx.gradients() if rows is None else rows.grads
            norms, dots = 0, 0
            # (FSDP2: every parameter's gradient is joined on every process, for
            # the product, whether its hooks saw it or not)
            indices = sorted(acc.kept) if rows is None else range(len(grads))
            for index in indices:
                individual = acc.kept.get(index)
                if individual is not None:
                    norms = norms + individual.batch_l2().detach()
                if rows is None:
                    dots = dots + ctx.comm.projection(index, individual, grads[index])
                else:  # FSDP2: onto this parameter's full gradient, for the product
                    projected = rows.project(index, individual, grads[index])
                    dots = dots if projected is None else dots + projected
            squared = None  # ||g||^2: the processes' rows' squares (FSDP2)
            if rows is not None:
                squared = bucket.sum(sum((g**2).sum() for g in grads))
            joined = (bucket.gather(norms), bucket.gather(dots), squared)
            ctx.comm.common["gram projections"] = joined
        acc.kept.clear()  # the per-sample gradients are freed here
        acc.joined = joined

    def _compute(self, global_step: int, ctx: TrackContext) -> float | Missing:
        """The statistic from the centred shares, if defined.

        Missing (see :mod:`cockpit.quantities.defined`) with fewer than 2
        samples, non-finite sums, or a zero ``||g||``.
        """
        acc = self.acc
        raw, centred = acc.raw, acc.centred
        if acc.joined is not None:
            norms, dots, squared = acc.joined
            squared = (
                sum((g**2).sum() for g in ctx.gradients())
                if squared is None
                else squared.value
            )
            raw = [norms.value, dots.value, squared]
        present = raw if raw is not None else centred
        dtype = present[0].dtype
        undefined = defined.samples(present[0].shape[0])
        if undefined is not None:
            return undefined
        conditions = defined.nonfinite(*(raw or []), *(centred or []))
        norms = dots = squared = 0
        if centred is not None:
            norms, dots, squared = (defined.wide(part) for part in centred)
        if raw is not None:  # ||g_i - g||^2 = ||g_i||^2 - 2 g_i . g + ||g||^2
            raw_norms, raw_dots, raw_squared = (defined.wide(part) for part in raw)
            norms = norms + raw_norms - 2 * raw_dots + raw_squared
            dots = dots + raw_dots - raw_squared
            squared = squared + raw_squared
        value = self._from_centered(norms, dots, squared)
        return defined.decided(value, dtype, *conditions, *defined.divisor(squared))

    @abc.abstractmethod
    def _from_centered(
        self, norms: torch.Tensor, dots: torch.Tensor, grad_squared_norm: torch.Tensor
    ) -> torch.Tensor:
        """The statistic from ``||g_i - g||^2``, ``(g_i - g) . g`` and ``||g||^2``.

        All three are float64 tensors on the parameters' device, with at least 2
        samples; where a sum is not finite or ``||g|| = 0`` the result is not
        recorded (the checks are decided with it on the host).
        """


def _add(total: list | None, parts: list) -> list:
    """``total + parts`` elementwise (``parts`` if ``total`` is None)."""
    if total is None:
        return parts
    return [a + b for a, b in zip(total, parts, strict=True)]


def snr_entry(view: ParamView, epsilon: float, unbiased: bool) -> tuple:
    """Reduce one parameter to ``(sum_d g_d^2 / (var_d + epsilon), D_p, N, flag)``.

    The variances come from the per-sample gradients with the mean subtracted
    first (:meth:`ParamView.centered`, two-pass), so a coordinate on which the
    samples agree has variance 0, not the rounding error of ``sum_i g_i,d^2 -
    N g_d^2``; the sum is formed right away. ``flag`` says whether it is finite
    (:func:`defined.snr_finite`).
    """
    n = view.batch_size
    mean = view.mean_gradient().detach()
    spread = view.centered(elementwise=True).elementwise_spread().detach()
    snr = F.snr_sum_centered(mean, spread, n, epsilon, unbiased=unbiased)
    return snr, view.param.numel(), n, defined.snr_finite(mean, spread)


def snr_parts(view: ParamView, shared) -> tuple:
    """Data-parallel: keep ``sum_i g_i^2`` elementwise (summed over processes later)."""
    return (view.sum_grad_squared(shared.n_local).detach(),)


#: The name of MeanGSNR's and EarlyStopping's sum (``sums_in_backward``).
SUM = "sum_grad_squared"


def keep_snr_parts(
    acc: PerParameter, view: ParamView, shared, units, channel: str
) -> None:
    """Data-parallel: keep :func:`snr_parts`, or send it with its unit (FSDP2).

    With ``units`` (the step's :class:`cockpit.distributed.unit_sums.UnitSums`,
    ``Quantity.unit_sums``) the sum goes there as ``channel`` and is
    reduce-scattered when its unit's backward pass ends.
    """
    (sum_grad_squared,) = snr_parts(view, shared)
    if units is not None:
        units.put(channel, view.index, sum_grad_squared)
    else:
        acc.entries[view.index] = (sum_grad_squared,)


def share_snr(
    acc: PerParameter,
    ctx: TrackContext,
    bucket,
    epsilon: float,
    unbiased: bool,
    rows,
    units=None,
    channel: str | None = None,
) -> None:
    """Data-parallel: sum ``sum_i g_i^2`` over processes, then reduce as in a hook.

    The joined batch's mean is known only then, so the variances are the
    difference ``sum_i g_i,d^2 - N g_d^2`` (clamped at 0), each within
    ``ULPS eps sum_i g_i,d^2`` of the centred value. On a ``fully_shard`` model
    each process receives its rows of the sums (reduce-scattered unit by unit
    during the backward pass with ``units``, as ``channel``,
    :class:`cockpit.distributed.unit_sums.UnitSums`; else in the bucket,
    :meth:`Bucket.rows`), reduces them with its rows of the joined gradient, and
    the reductions are summed in a next round of the bucket.
    """
    grads = ctx.gradients() if rows is None else rows.grads
    n = ctx.comm.n_global

    def reduced(index, dim, total):
        mean = grads[index]  # (FSDP2: this process's rows of both)
        spread = (total - n * mean**2).clamp(min=0)
        snr = F.snr_sum_centered(mean, spread, n, epsilon, unbiased=unbiased)
        flag = defined.snr_finite(mean, total)
        if rows is None:
            acc.entries[index] = (snr, dim, n, flag)
            return
        pair = torch.stack([defined.wide(snr), (~flag).to(torch.float64)])

        def joined(v):
            acc.entries[index] = (v[0].to(snr.dtype), dim, n, v[1] == 0)

        bucket.sum(pair, joined)  # (a next round of the bucket)

    if units is not None:  # sent in the backward pass
        sizes = [p.numel() for p in ctx.params]
        units.deliver(channel, bucket, lambda i, total: reduced(i, sizes[i], total))
        return
    for index, (sum_grad_squared,) in list(acc.entries.items()):
        dim = sum_grad_squared.numel()

        def then(total, index=index, dim=dim):
            reduced(index, dim, total)

        if rows is None:
            bucket.sum(sum_grad_squared, then)
        else:  # FSDP2: each process receives its rows of the sum
            del acc.entries[index]  # (``then`` puts it back: freed once sent)
            bucket.rows(sum_grad_squared, index, then)


def total_snr(acc: PerParameter, num_params: int) -> tuple:
    """Sum the entries of :func:`snr_entry`: the sum, ``D``, ``N``, dtype, checks.

    Returns:
        The sum (a float64 tensor), or :class:`Missing` with fewer than 2
        samples; ``D``; ``N``; the dtype of the entries; the deferred checks
        (:data:`defined.Condition`: an overflow) for :func:`defined.decided`.
    """
    entries = acc.ordered(num_params)
    n, dim = batch_size_of(entries), sum(d for _, d, _, _ in entries)
    dtype = entries[0][0].dtype
    undefined = defined.samples(n)
    if undefined is not None:
        return undefined, dim, n, dtype, []
    snr = torch.stack([defined.wide(s) for s, _, _, _ in entries]).sum()
    finite = torch.stack([f.to(snr.device) for _, _, _, f in entries]).all()
    return snr, dim, n, dtype, [(~finite, dtype)]
