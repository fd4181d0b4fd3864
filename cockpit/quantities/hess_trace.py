"""HessTrace: the trace of a curvature matrix, per parameter tensor."""

from __future__ import annotations

import torch

from cockpit.curvature import attention
from cockpit.curvature import source as curvature_source
from cockpit.curvature.source import HESSIAN_ONLY
from cockpit.needs import Need, curvature_need
from cockpit.param_view import ParamView
from cockpit.quantities.base import SingleStepQuantity, TrackContext
from cockpit.quantities.batch_statistics import PerParameter
from cockpit.quantities.compat import Alias102


class HessTrace(SingleStepQuantity):
    """``sum_d C_dd`` over the coordinates of each parameter tensor.

    ``C`` is the Hessian of the mini-batch loss (``curvature="diag_h"``), its
    generalised Gauss-Newton (``"diag_ggn_exact"``) or a one-sample Monte-Carlo
    estimate of the GGN (``"diag_ggn_mc"``, random). The diagonal of each parameter is
    summed as soon as BackPACK produced it and freed right away.

    Where BackPACK cannot form the diagonal (a model it cannot backpropagate
    through), the trace is estimated (:mod:`cockpit.curvature.source`), with its
    standard errors under ``<key>_estimate``: the GGN choices by the GGN of the
    cross-entropy (exact where rows times classes are few, else Monte-Carlo);
    ``"diag_h"`` by the same GGN, for the whole run, whenever the loss is a
    cross-entropy (Hutchinson's estimate of the Hessian trace is too noisy to read;
    the record's ``"curvature"`` says ``"ggn"`` and a warning says so), else by
    Hutchinson. ``curvature="hutchinson"`` keeps the Hessian always (Hutchinson's
    estimate where BackPACK cannot form it).

    Args:
        track_schedule: When to track.
        verbose: Extra diagnostics.
        curvature: ``"diag_h"`` (default), ``"hutchinson"``, ``"diag_ggn_exact"`` or
            ``"diag_ggn_mc"``.
        key: History key (default ``"HessTrace"``).

    Raises:
        ValueError: For an unknown ``curvature``, listing the valid ones.
    """

    shard_local = True  # (sums of the per-sample results; no parameter read)

    Accumulator = PerParameter
    #: Where BackPACK has no exact curvature diagonal (a layer without a rule, a
    #: model that is not nn.Sequential), an unbiased estimate serves: the trace
    #: only sums the diagonal. Its standard errors are recorded under
    #: ``<key>_estimate``.
    estimable = frozenset({Need.DIAG_H, Need.DIAG_GGN_EXACT, Need.DIAG_GGN_MC})

    def __init__(self, track_schedule, verbose=False, curvature="diag_h", key=None):
        super().__init__(track_schedule, verbose=verbose, key=key)
        #: ``curvature="hutchinson"``: the Hessian, never the GGN in its place.
        self.hessian_only = curvature == HESSIAN_ONLY
        curvature = "diag_h" if self.hessian_only else curvature
        self.needs = frozenset({curvature_need(curvature)})
        self.curvature = curvature

    _curvature = Alias102("curvature")  # 1.0.2's name

    def bind(self, history) -> None:
        """Fused attention, differentiable twice (:mod:`cockpit.curvature.attention`).

        The Hessian's estimate differentiates the gradient again; the exact
        diagonals of BackPACK and the GGN choices need no such pass.
        """
        super().bind(history)
        if self.curvature == "diag_h" and not getattr(self, "_holds_attention", False):
            self._holds_attention = True
            attention.hold(self)

    def state_dict(self) -> dict:
        """The curvature source chosen for the run (and the GGN's last spread)."""
        return curvature_source.state_of(self)

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` saved."""
        curvature_source.restore(self, state)

    def accumulate(self, global_step: int, view: ParamView) -> None:
        """Sum the parameter's curvature diagonal."""
        self.acc.entries[view.index] = view.curvature(self.curvature).sum()

    def share(self, global_step: int, ctx: TrackContext, bucket) -> None:
        """Weight each shard's trace by its share of the joined batch; sum."""
        entries, weight = self.acc.entries, ctx.comm.weight
        for index, trace in list(entries.items()):
            bucket.sum(trace * weight, lambda v, i=index: entries.__setitem__(i, v))

    def _compute(self, global_step: int, ctx: TrackContext) -> list[float]:
        return torch.stack(self.acc.ordered(len(ctx.params)))  # recorded as a list
