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
    """Reduce one parameter to ``(sum_i ||g_i,p||^2, ||g_p||^2 or None, N)``.

    ``||g_p||^2`` comes from the per-sample gradients' mean when they exist (another
    quantity asked for ``BatchGrad``); with ``BatchL2Grad`` alone it is ``None`` and
    :func:`total_squared_norms` reads ``.grad`` instead.
    """
    batch_l2 = view.batch_l2().detach()
    grad_sq = None
    if view.has_individual_gradients:
        grad_sq = (view.mean_gradient().detach() ** 2).sum()
    return batch_l2.sum(), grad_sq, batch_l2.shape[0]


def share_squared_norms(acc: PerParameter, n_global: int, bucket) -> None:
    """Data-parallel: sum ``sum_i ||g_i,p||^2`` over processes, in place.

    ``||g_p||^2`` is then read from the joined batch's gradient.
    """
    for index, entry in acc.entries.items():

        def then(total, index=index):
            acc.entries[index] = (total, None, n_global)

        bucket.sum(entry[0], then)


def total_squared_norms(
    acc: PerParameter, grads
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Sum the entries of :func:`squared_norm_entry` over all parameters.

    Args:
        acc: The entries of every parameter.
        grads: The mini-batch gradient of every parameter (``ctx.gradients()``).

    Returns:
        ``sum_i ||g_i||^2`` and ``||g||^2`` over the whole model, and ``N``.

    Raises:
        RuntimeError: If parameters saw different batch sizes.
    """
    per_sample, mean, sizes = [], [], set()
    for index, (sum_sq, grad_sq, n) in enumerate(acc.ordered(len(grads))):
        per_sample.append(sum_sq)
        mean.append(grad_sq if grad_sq is not None else (grads[index] ** 2).sum())
        sizes.add(n)
    if len(sizes) != 1:
        raise RuntimeError(
            f"Parameters saw different batch sizes {sorted(sizes)} in one backward "
            "pass. Fix: compute the loss of a single mini-batch per step."
        )
    return torch.stack(per_sample).sum(), torch.stack(mean).sum(), sizes.pop()


class GramQuantity(SingleStepQuantity):
    """Base for statistics of ``||g_i||^2``, ``g_i . g`` and ``||g||^2``.

    These are the diagonal and the row means of the per-sample Gram matrix; each
    parameter adds its ``||g_i,p||^2`` and ``g_i,p . g_p`` (``[N]`` each) to running
    sums inside the backward pass, so a module's per-sample results are reduced
    and freed in its hook, and no ``[N, N]`` matrix is formed. Subclasses
    implement ``_from_projections(norms, dots, grad_squared_norm)``.
    """

    @dataclass
    class Accumulator:
        """The running sums of ``||g_i,p||^2`` and ``g_i,p . g_p`` over parameters.

        Data-parallel runs keep each parameter's per-sample gradients instead
        (``kept``): the projections ``g_i . g`` need the joined batch's ``g``.
        ``joined`` then holds the bucket slots of ``||g_i||^2`` and ``g_i . g``
        over the joined batch.
        """

        norms: torch.Tensor | None = None
        dots: torch.Tensor | None = None
        kept: dict[int, object] = field(default_factory=dict)
        joined: tuple | None = None

    needs = frozenset({Need.BATCH_L2, Need.PROJECTIONS, Need.GRADIENT})

    def accumulate(self, global_step: int, view: ParamView) -> None:
        """Add the parameter's ``||g_i,p||^2`` and ``g_i,p . g_p`` to the sums."""
        if self.shared is not None:
            self.acc.kept[view.index] = view.keep_individual()
            return
        norms, dots = view.batch_l2().detach(), view.mean_dots().detach()
        acc = self.acc
        acc.norms = norms if acc.norms is None else acc.norms + norms
        acc.dots = dots if acc.dots is None else acc.dots + dots

    def share(self, global_step: int, ctx: TrackContext, bucket) -> None:
        """Project the kept per-sample gradients onto the joined ``g``; gather.

        Every Gram quantity of the step kept the same per-sample gradients, so
        the first computes and sends the projections, the others reuse them.
        """
        acc = self.acc
        joined = ctx.comm.common.get("gram projections")
        if joined is None:
            grads = ctx.gradients()
            norms, dots = 0, 0
            for index in sorted(acc.kept):
                individual = acc.kept[index]
                norms = norms + individual.batch_l2().detach()
                dots = dots + ctx.comm.projection(index, individual, grads[index])
            joined = (bucket.gather(norms), bucket.gather(dots))
            ctx.comm.common["gram projections"] = joined
        acc.kept.clear()  # the per-sample gradients are freed here
        acc.joined = joined

    def _compute(self, global_step: int, ctx: TrackContext) -> float | Missing:
        """The statistic from ``||g_i||^2``, ``g_i . g`` and ``||g||^2``, if defined.

        Missing (see :mod:`cockpit.quantities.defined`) with fewer than 2 samples
        or a zero or non-finite ``||g||``; the subclass decides on cancellation.
        """
        if self.acc.joined is not None:
            norms, dots = (slot.value for slot in self.acc.joined)
            grad_squared_norm = sum((g**2).sum() for g in ctx.gradients())
        else:
            norms, dots = self.acc.norms, self.acc.dots  # ||g_i||^2, g_i . g
            grad_squared_norm = dots.sum() / dots.shape[0]  # ||g||^2
        dtype = norms.dtype
        undefined = defined.first(
            defined.samples(dots.shape[0]),
            defined.finite_sums(norms, dots),
            defined.divisor(grad_squared_norm),
        )
        if undefined is not None:
            return undefined
        value = self._from_projections(
            defined.wide(norms),
            defined.wide(dots),
            defined.wide(grad_squared_norm),
            dtype,
        )
        return value if isinstance(value, Missing) else defined.finite(value, dtype)

    @abc.abstractmethod
    def _from_projections(
        self,
        norms: torch.Tensor,
        dots: torch.Tensor,
        grad_squared_norm: torch.Tensor,
        dtype: torch.dtype,
    ) -> torch.Tensor | Missing:
        """The statistic from ``||g_i||^2``, ``g_i . g`` and ``||g||^2``.

        All three are float64 on the CPU, finite, with at least 2 samples and
        ``||g|| > 0``; they were summed in ``dtype``, whose rounding decides
        what cancels (:mod:`cockpit.quantities.defined`).
        """


def snr_entry(view: ParamView, epsilon: float, unbiased: bool) -> tuple:
    """Reduce one parameter to ``(sum_d g_d^2 / (var_d + epsilon), D_p, N, flag)``.

    ``g`` and ``sum_i g_i^2`` are formed elementwise from the per-sample gradients
    (shared with every other quantity through the view) and summed right away;
    ``flag`` says whether the sum is defined (:func:`defined.snr_undefined`).
    """
    n = view.batch_size
    mean = view.mean_gradient().detach()
    sum_grad_squared = view.sum_grad_squared().detach()
    snr = F.snr_sum(mean, sum_grad_squared, n, epsilon, unbiased=unbiased)
    flag = defined.snr_undefined(mean, sum_grad_squared, n, epsilon, unbiased)
    return snr, view.param.numel(), n, flag


def snr_parts(view: ParamView, shared) -> tuple:
    """Data-parallel: keep ``sum_i g_i^2`` elementwise (summed over processes later)."""
    return (view.sum_grad_squared(shared.n_local).detach(),)


def share_snr(
    acc: PerParameter, ctx: TrackContext, bucket, epsilon: float, unbiased: bool
) -> None:
    """Data-parallel: sum ``sum_i g_i^2`` over processes, then reduce as in a hook."""
    grads = ctx.gradients()
    n = ctx.comm.n_global
    for index, (sum_grad_squared,) in list(acc.entries.items()):

        def then(total, index=index):
            snr = F.snr_sum(grads[index], total, n, epsilon, unbiased=unbiased)
            flag = defined.snr_undefined(grads[index], total, n, epsilon, unbiased)
            acc.entries[index] = (snr, total.numel(), n, flag)

        bucket.sum(sum_grad_squared, then)


def total_snr(acc: PerParameter, num_params: int) -> tuple[float | Missing, int, int]:
    """Sum the entries of :func:`snr_entry`; return the sum, ``D`` and ``N``.

    Returns:
        The sum as a float, or :class:`Missing` where it is not defined (fewer
        than 2 samples, a coordinate lost to rounding, an overflow), ``D`` and
        ``N``.
    """
    entries = acc.ordered(num_params)
    sizes = {n for _, _, n, _ in entries}
    if len(sizes) != 1:
        raise RuntimeError(
            f"Parameters saw different batch sizes {sorted(sizes)} in one backward "
            "pass. Fix: compute the loss of a single mini-batch per step."
        )
    n, dim = sizes.pop(), sum(d for _, d, _, _ in entries)
    snr = torch.stack([s for s, _, _, _ in entries]).sum()
    flag = int(torch.stack([f.to(snr.device) for _, _, _, f in entries]).max())
    undefined = defined.first(defined.samples(n), defined.snr_reason(flag, snr.dtype))
    return undefined or defined.finite(snr, snr.dtype), dim, n
