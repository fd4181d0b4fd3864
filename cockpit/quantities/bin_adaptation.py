"""Policies that move the range of gradient histograms while training runs.

A histogram quantity (:class:`~cockpit.quantities.GradHist1d`,
:class:`~cockpit.quantities.GradHist2d`) asks its policy for a new range *after* it has
counted the current step, so a new range takes effect from the next histogram on. A
policy runs on its own schedule, which need not match the histogram's: the histogram
is then active (and reads what the policy needs) on the policy's steps as well.

The policies hold no per-step state. The histogram collects the per-parameter
reductions a policy asks for (:meth:`BinAdaptation.reduce`, called inside the backward
pass) and hands them back to :meth:`BinAdaptation.compute`, so one policy instance can
serve several histograms.

Every policy here maps a maximum absolute value ``m`` to the symmetric range::

    (-r, r)  with  r = (1 + padding) * max(min_size / 2, m)
"""

from __future__ import annotations

import abc
import math
import warnings
from typing import Callable, Sequence

import torch
from torch import Tensor

from cockpit.context import tracking
from cockpit.errors import CockpitWarning
from cockpit.needs import Need
from cockpit.param_view import ParamView
from cockpit.quantities.base import TrackContext

Range = tuple[float, float]


def _never(global_step: int) -> bool:
    """A schedule that never fires (used by :class:`NoAdaptation`)."""
    return False


class BinAdaptation(abc.ABC):
    """Base class of the bin-range policies.

    Args:
        track_schedule: Callable ``global_step -> bool``: the steps after which the
            range is recomputed.
        verbose: Emit a warning with the new range whenever it changes.

    Raises:
        TypeError: If ``track_schedule`` is not callable.
    """

    def __init__(self, track_schedule: Callable[[int], bool], verbose: bool = False):
        if not callable(track_schedule):
            raise TypeError(
                f"track_schedule must be a callable step -> bool, got "
                f"{track_schedule!r}. Use cockpit.utils.schedules.linear(10) to adapt "
                "the range every 10 steps."
            )
        self.track_schedule = track_schedule
        self.verbose = verbose

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def should_compute(self, global_step: int) -> bool:
        """Return whether the range is recomputed after ``global_step``."""
        return bool(self.track_schedule(global_step))

    #: What :meth:`reduce` reads on the policy's steps.
    needs: frozenset[Need] = frozenset()
    #: Whether the policy reads the parameters after the backward pass (on a
    #: ``fully_shard`` model the histogram then has them joined for it).
    reads_parameters: bool = False

    def reduce(self, view: ParamView) -> Tensor | None:
        """Reduce one parameter's results to a small tensor inside the backward pass.

        Called only on the policy's steps. ``None`` means nothing to collect.
        """
        return None

    def compute(
        self,
        global_step: int,
        ctx: TrackContext,
        reductions: Sequence[Tensor],
        current: Range,
    ) -> Range:
        """Return the range for the next histograms.

        Args:
            global_step: The step that was just tracked.
            ctx: Parameters and ``info`` of that step.
            reductions: What :meth:`reduce` returned, one entry per parameter that
                returned something.
            current: The range used so far, ``(lo, hi)``.

        Returns:
            The new ``(lo, hi)``.
        """
        new = self._compute(global_step, ctx, reductions, current)
        if self.verbose and new != current:
            warnings.warn(
                f"{type(self).__name__} at step {global_step}: histogram range "
                f"{current} -> {new}.",
                CockpitWarning,
                stacklevel=2,
            )
        return new

    @abc.abstractmethod
    def _compute(self, global_step, ctx, reductions, current) -> Range:
        """Implemented by each subclass."""


class NoAdaptation(BinAdaptation):
    """Keep the histogram range fixed (the default of every histogram).

    Args:
        verbose: Accepted for compatibility; there is nothing to report.
    """

    def __init__(self, verbose: bool = False):
        super().__init__(_never, verbose=verbose)

    def _compute(self, global_step, ctx, reductions, current) -> Range:
        return current


class _AbsMax(BinAdaptation):
    """Set the range to ``±(1 + padding) * max(min_size / 2, m)`` for a maximum ``m``.

    A subclass written for cockpit-for-pytorch 1.0.2 that defines
    ``_get_abs_max(global_step, params, batch_loss, range)`` gets ``m`` from it
    (:mod:`cockpit.context`'s getters read the step's ``info`` meanwhile).

    Args:
        track_schedule: When to recompute the range.
        verbose: Warn with the new range whenever it changes.
        padding: Relative margin added on both sides (``0.1`` widens by 10 %).
        min_size: The smallest width ``2 r`` the range can shrink to.

    Raises:
        ValueError: If ``padding`` is negative or ``min_size`` is not positive.
    """

    def __init__(
        self,
        track_schedule: Callable[[int], bool],
        verbose: bool = False,
        padding: float = 0.0,
        min_size: float = 1e-6,
    ):
        super().__init__(track_schedule, verbose=verbose)
        if not padding >= 0:
            raise ValueError(
                f"padding must be >= 0, got {padding!r}. Use e.g. padding=0.1 for a "
                "10 % margin."
            )
        if not min_size > 0:
            raise ValueError(
                f"min_size must be > 0, got {min_size!r}. Use e.g. min_size=1e-6."
            )
        self.padding = float(padding)
        self.min_size = float(min_size)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(padding={self.padding}, min_size={self.min_size})"
        )

    @abc.abstractmethod
    def _abs_max(self, ctx: TrackContext, reductions: Sequence[Tensor]) -> float:
        """Implemented by each subclass."""

    def _compute(self, global_step, ctx, reductions, current) -> Range:
        from_102 = getattr(self, "_get_abs_max", None)
        if from_102 is not None:  # a policy written for 1.0.2 computes it itself
            with tracking(ctx.info):
                loss = ctx.info.get("loss")
                m = float(from_102(global_step, list(ctx.params), loss, current))
        else:
            m = self._abs_max(ctx, reductions)
        if not math.isfinite(m):
            warnings.warn(
                f"{type(self).__name__} at step {global_step}: the maximum absolute "
                f"value is {m}; keeping the histogram range {current}. Check the "
                "training for NaN or infinite values.",
                CockpitWarning,
                stacklevel=3,
            )
            return current
        r = (1.0 + self.padding) * max(self.min_size / 2, m)
        return (-r, r)


def _max_of(values: Sequence[Tensor]) -> float:
    """Return the maximum of scalar tensors (NaN propagates).

    One number per device is copied to the host, however many tensors there are.
    """
    if not values:
        return 0.0
    by_device: dict[torch.device, list[Tensor]] = {}
    for value in values:
        by_device.setdefault(value.device, []).append(value.detach().to(torch.float64))
    maxima = [torch.stack(group).max() for group in by_device.values()]
    return float(torch.stack([m.cpu() for m in maxima]).max())


class GradAbsMax(_AbsMax):
    """Range from the largest absolute individual-gradient element.

    ``m = max_{i,d} |g_{i,d}|`` over all samples ``i`` and all coordinates ``d`` of
    all parameters, computed per parameter inside the backward pass (one scalar per
    parameter is kept). Needs per-sample gradients (BackPACK's ``BatchGrad``) on the
    policy's steps.

    Args:
        track_schedule: When to recompute the range.
        verbose: Warn with the new range whenever it changes.
        padding: Relative margin added on both sides.
        min_size: The smallest width the range can shrink to.
    """

    needs = frozenset({Need.INDIVIDUAL_GRADIENTS})

    def reduce(self, view: ParamView) -> Tensor:
        """Return ``max_{i,d} |g_{i,d}|`` of this parameter (a scalar)."""
        with torch.no_grad():
            return view.individual_gradients().detach().abs().max()

    def _abs_max(self, ctx: TrackContext, reductions: Sequence[Tensor]) -> float:
        return _max_of(reductions)


class ParamAbsMax(_AbsMax):
    """Range from the largest absolute parameter element, ``m = max_d |theta_d|``.

    Reads the parameters after the backward pass; needs no BackPACK extension.

    Args:
        track_schedule: When to recompute the range.
        verbose: Warn with the new range whenever it changes.
        padding: Relative margin added on both sides.
        min_size: The smallest width the range can shrink to.
    """

    reads_parameters = True

    def _abs_max(self, ctx: TrackContext, reductions: Sequence[Tensor]) -> float:
        return _max_of([p.detach().abs().max() for p in ctx.params if p.numel()])


def as_policy(adapt: BinAdaptation | None, what: str = "adapt") -> BinAdaptation:
    """Return ``adapt``, or :class:`NoAdaptation` for ``None``.

    Args:
        adapt: A policy or ``None``.
        what: The argument name, for the error message.

    Returns:
        A :class:`BinAdaptation` instance.

    Raises:
        TypeError: If ``adapt`` is neither ``None`` nor a policy instance.
    """
    if adapt is None:
        return NoAdaptation()
    if not isinstance(adapt, BinAdaptation):
        hint = (
            " (a class was passed: instantiate it)" if isinstance(adapt, type) else ""
        )
        raise TypeError(
            f"{what} must be None or a bin-adaptation policy, got {adapt!r}{hint}. "
            "Use e.g. cockpit.quantities.bin_adaptation.GradAbsMax(linear(10))."
        )
    return adapt
