"""Alpha: where on the local one-dimensional parabola did the optimizer's step land?"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from cockpit.distributed.rows import foreign_reason, is_foreign, squared_norms
from cockpit.errors import CockpitWarning
from cockpit.needs import Need
from cockpit.param_view import ParamView
from cockpit.precision import compute_dtype
from cockpit.quantities import functional as F
from cockpit.quantities.base import Missing, TrackContext, TwoStepQuantity
from cockpit.quantities.optim import (
    ReplayError,
    is_elementwise,
    is_plain_sgd,
    learning_rates,
    replay_update,
)
from cockpit.utils.host import Deferred


@dataclass
class _StepParts:
    """What the backward pass of one step keeps (Alpha's accumulator).

    ``starts``: per parameter index, the entry of a start step; ``end_dots``: the
    per-sample projections onto the pending step's direction, summed over
    parameters (end steps).
    """

    starts: dict[int, _StartEntry] = field(default_factory=dict)
    end_dots: Tensor | None = None
    #: Data-parallel start steps: per parameter index, the per-sample gradients,
    #: projected once the step's gradient is known on every process.
    kept: dict[int, Any] = field(default_factory=dict)
    #: FSDP2 end steps: the per-sample gradients, projected after the backward
    #: pass onto each parameter's full direction (it is kept as rows).
    kept_end: dict[int, Any] = field(default_factory=dict)
    #: FSDP2 start steps: the slot of ``tau^2`` (a sum over rows).
    tau_squared: Any = None
    #: FSDP2 end steps: whether a process's kept direction was another's.
    foreign: Any = None
    #: FSDP2 start steps: on how many processes a replay failed (a slot).
    failed: Any = None
    #: FSDP2 start steps: the direction on this process's rows (formed once).
    direction: list[Tensor] | None = None


@dataclass
class _StartEntry:
    """What the backward pass of a start step keeps of one parameter.

    ``kind`` is ``"sgd"`` (``vector`` is the gradient ``g_p``; the direction is
    ``-lr_p g_p``, scaled once the learning rate is read after the backward pass),
    ``"replay"`` (``vector`` is the update ``d_p`` replayed from the optimizer with
    id ``owner``) or ``"failed"`` (``reason`` says why). ``dots`` are the per-sample
    projections ``g_i,p . vector``, shape ``[N]``.
    """

    kind: str
    vector: Tensor | None = None
    dots: Tensor | None = None
    owner: int | None = None
    reason: str = ""


def _per_sample_dots(view: ParamView, vector: Tensor) -> Tensor:
    """Return ``g_i,p . vector`` for every sample, shape ``[N]`` (no autograd graph)."""
    vector = vector.to(device=view.param.device, dtype=compute_dtype(vector.dtype))
    return view.project(vector).detach()


class Alpha(TwoStepQuantity):
    """The normalised step length ``alpha`` of Schneider et al. (2021).

    Between the parameters ``theta_t`` of a scheduled step ``t`` and ``theta_{t+1}``
    of the next step, a quadratic is fitted along the update ``d = theta_{t+1} -
    theta_t`` (length ``tau``, unit direction ``u``) to four noisy observations:
    the mini-batch losses ``f_0 = L_t``, ``f_1 = L_{t+1}`` and the slopes
    ``f'_k = mean_i u . g_i^(k)``, weighted by the inverses of their per-sample
    variances (unbiased; a zero variance is replaced by ``1e-10`` with a warning
    shown once). With the fit's minimiser ``x*``, ``alpha = tau / x* - 1``: ``-1``
    means the step did not move (also stored when the fit has no minimum ahead),
    ``0`` that it landed in the minimum, ``+1`` at the opposite point of equal height,
    more than ``1`` that it overshot. The value is stored under step ``t`` once step
    ``t + 1`` has been tracked; nothing is stored when the fit is singular.

    All per-sample work happens inside the backward pass (per-sample gradients are
    needed on scheduled steps and on the step after each): each module's per-sample
    gradients are projected onto the step there and freed.

    * **Plain SGD** (``torch.optim.SGD`` with momentum, dampening and weight decay
      0): at step ``t`` the hook keeps ``g_p`` and the projections ``g_i,p . g_p``;
      after the backward pass ``d_p = -lr_p g_p`` (each parameter's group learning
      rate). Works from the very first step.
    * **Any other optimizer** (momentum, Adam, ...): the hook replays the optimizer's
      update for each parameter on copies (same class, group settings and state,
      gradient ``g_p``; :func:`cockpit.quantities.optim.replay_update`), which gives
      ``d_p`` exactly, and projects the per-sample gradients onto it. The
      optimizer is read from the step's ``info`` before the backward pass, so this
      works from the very first step and right after a restart.
    * At step ``t + 1`` the hook projects the new per-sample gradients onto the
      stored ``d``.

    Both paths assume that ``optimizer.step()`` sees the gradient of this backward
    pass unchanged (gradients zeroed before it; no clipping in between).

    Memory: Alpha holds the direction ``d`` (``D`` numbers) of a pending start
    between steps; while the hooks of a step that both ends and starts run, at most
    ``2 D + N (P + 1)`` numbers (``P`` parameter tensors), on both paths. Replaying
    adds, for the duration of one parameter's hook, a copy of that parameter, its
    gradient and its optimizer state. Per-sample gradients are never kept beyond
    their module's hook. Measured (``tests/engines/test_per_sample_memory.py``, and a
    784-256-10 MLP, ``N = 128``, float32, SGD and Adam): ``D = 203,530``, between
    steps exactly ``D`` numbers (0.8 MiB; and 5 scalars: ``tau`` and the start's
    observations, kept on the device), at most ``2 D + N (P + 1) = 407,700``
    (1.6 MiB); cockpit-for-pytorch cached ``N D`` numbers for each of the two steps
    with non-SGD optimizers (``2 N D``: 199 MiB).

    ``info`` keys read at both steps: ``loss``, ``individual_losses`` (shape ``[N]``;
    any further axes are averaged) and ``optimizer``. Two-step state (``d``, ``tau``
    and the start's observations) is in :meth:`state_dict`, so a restored run
    finishes a pending start.

    Args:
        track_schedule: The start steps ``t``.
        verbose: Extra diagnostics (unused).
        key: History key (default ``"Alpha"``).

    Raises:
        ValueError: If ``info["individual_losses"]`` does not hold one loss per
            sample of the backward pass.
    """

    needs = frozenset({Need.PROJECTIONS, Need.OPTIMIZER_UPDATE})
    info_keys = ("loss", "individual_losses", "optimizer")
    Accumulator = _StepParts

    @property
    def shard_local(self) -> bool:
        """On FSDP2, with an optimizer whose update is elementwise: from the rows.

        The direction is replayed on each process's rows (its rows of the
        optimizer's state) and kept as rows; each parameter's full direction is
        formed only for the projection of its per-sample gradients
        (:meth:`cockpit.distributed.rows.Rows.project`). Other optimizers (and
        before the step's optimizer is read): on the full parameters, joined for
        it.
        """
        return is_elementwise(self._optimizer)

    #: As in 1.0.2: the value computed at step ``t + 1`` is stored under ``t``.
    SAVE_SHIFT = 1

    def __init__(self, track_schedule, verbose=False, key=None):
        super().__init__(track_schedule, verbose=verbose, key=key)
        self._optimizer = None  # the optimizer of the step being tracked
        self._warned: set[str] = set()

    def prepare(self, global_step: int, info) -> None:
        """Read the step's optimizer before the backward pass (the hook needs it)."""
        self._optimizer = None if info is None else info.get("optimizer")

    # --- inside the backward pass ------------------------------------------------
    def accumulate(self, global_step: int, view: ParamView) -> None:
        """Project the parameter's per-sample gradients onto the step(s)."""
        if self.finishes(global_step):
            pending = self._pending[global_step - 1]
            if "owner" in pending:  # rows (FSDP2): projected after the backward pass
                if self.shared is not None and self.shared.sharded:
                    self.acc.kept_end[view.index] = view.keep_individual()
            else:
                direction = pending["direction"][view.index]
                dots = _per_sample_dots(view, direction)
                previous = self.acc.end_dots
                self.acc.end_dots = dots if previous is None else previous + dots
        if self.should_compute(global_step):
            if self.shared is not None:  # the update is known after all processes
                self.acc.kept[view.index] = view.keep_individual()
            else:
                grad = view.mean_gradient().detach()
                self.acc.starts[view.index] = self._start_entry(
                    view.param,
                    grad,
                    lambda v: _per_sample_dots(view, v),
                    lambda: view.mean_dots().detach(),
                )

    def _start_entry(self, param, grad: Tensor, project, mean_dots=None) -> _StartEntry:
        """What a start step keeps of one parameter (``mean_dots``: ``g_i . g``)."""
        optimizer = self._optimizer
        if is_plain_sgd(optimizer):
            dots = mean_dots() if mean_dots is not None else project(grad)
            return _StartEntry("sgd", grad, dots)
        try:
            update = replay_update(optimizer, param, grad)
        except ReplayError as error:
            return _StartEntry("failed", reason=str(error))
        return _StartEntry("replay", update, project(update), owner=id(optimizer))

    def share(self, global_step: int, ctx: TrackContext, bucket) -> None:
        """Gather the per-sample projections of all processes.

        At a start step the direction comes from ``.grad`` (what the optimizer
        will use: DDP's average), and each process projects its kept per-sample
        gradients onto it.
        """
        acc = self.acc
        if ctx.rows is not None and self.shard_local:
            self._share_rows(global_step, ctx, bucket)
            return
        # (FSDP2: the optimizer over the full parameters, its state joined)
        self._optimizer = ctx.info.get("optimizer", self._optimizer)
        for index in sorted(acc.kept):
            individual = acc.kept.pop(index)
            param = ctx.params[index]
            grad = param.grad.detach() if param.grad is not None else param * 0

            def project(vector, individual=individual, index=index, param=param):
                vector = vector.to(
                    device=param.device, dtype=compute_dtype(vector.dtype)
                )
                return ctx.comm.projection(index, individual, vector)

            entry = self._start_entry(param, grad.detach(), project)
            acc.starts[index] = entry
            if entry.dots is not None:
                bucket.gather(entry.dots, lambda v, e=entry: setattr(e, "dots", v))
        if acc.end_dots is not None:
            bucket.gather(acc.end_dots, lambda v: setattr(acc, "end_dots", v))

    def _share_rows(self, global_step: int, ctx: TrackContext, bucket) -> None:
        """FSDP2: the direction on this process's rows; projections; ``tau^2``.

        The direction is the update of ``.grad``'s rows (what ``optimizer.step()``
        will see; with shards of different sizes not the joined batch's
        gradient). Every process joins each parameter's full vector for the
        projections and adds the same slots to the bucket, in the same order,
        whatever it found (a parameter its hooks did not see, a replay that
        failed, a foreign direction): what it found is decided by sums.
        """
        acc, rows = self.acc, ctx.rows
        optimizer = rows.optimizer
        self._optimizer = optimizer
        count, n_local = len(rows.params), ctx.comm.n_local
        if self.should_compute(global_step):  # a start
            failed = 0
            for index in range(count):
                individual = acc.kept.pop(index, None)
                grad = rows.steps[index]
                entry = self._start_entry(rows.params[index], grad, lambda v: None)
                vector = entry.vector if entry.vector is not None else grad * 0
                dots = rows.project(index, individual, vector)
                if dots is None:  # (no per-sample gradients of it here)
                    dots = grad.new_zeros(n_local)
                entry.dots = dots
                failed += entry.kind == "failed"
                bucket.gather(entry.dots, lambda v, e=entry: setattr(e, "dots", v))
                acc.starts[index] = entry
            entries = [acc.starts[i] for i in range(count)]
            found = self._direction(global_step, optimizer, entries, rows.params, False)
            partial = torch.zeros((), dtype=torch.float64, device=rows.device)
            if not isinstance(found, Missing):
                acc.direction = found[0]
                partial = sum_of_squares(found[0])
            acc.tau_squared = bucket.sum(partial)
            acc.failed = bucket.sum(torch.tensor(float(failed), device=rows.device))
        pending = (
            self._pending.get(global_step - 1) if self.finishes(global_step) else None
        )
        if pending is not None and "owner" in pending:  # an end, kept as rows
            foreign = is_foreign(pending["owner"], rows)
            direction = pending["direction"]
            total = torch.zeros(n_local, dtype=torch.float64, device=rows.device)
            for index in range(count):
                vector = rows.params[index] * 0 if foreign else direction[index]
                vector = vector.to(compute_dtype(vector.dtype))
                individual = acc.kept_end.pop(index, None)
                dots = rows.project(index, individual, vector)
                if dots is not None:
                    total = total + dots.to(torch.float64)
            acc.end_dots = total
            flag = torch.tensor(float(foreign), dtype=torch.float64, device=rows.device)
            acc.foreign = bucket.sum(flag)
        if acc.end_dots is not None:
            bucket.gather(acc.end_dots, lambda v: setattr(acc, "end_dots", v))

    # --- after the backward pass ---------------------------------------------------
    def track_step(self, global_step: int, ctx: TrackContext) -> list[tuple[int, Any]]:
        """Finish the previous start, then start anew; drop the step's buffers."""
        results = super().track_step(global_step, ctx)  # drops the step's accumulator
        self._optimizer = None
        return results

    def _compute_start(self, global_step: int, ctx: TrackContext) -> dict | None:
        optimizer = ctx.info.require("optimizer", self.key)
        params = ctx.params
        if ctx.rows is not None and self.acc.tau_squared is not None:  # FSDP2 rows
            optimizer, params = ctx.rows.optimizer, ctx.rows.params
        failed = self.acc.failed
        if failed is not None and bool(failed.value > 0):  # (alike on every process)
            return Missing(
                f"{int(failed.value)} replays of the optimizer's update on the "
                "processes' rows of the parameters failed (the warning of the "
                "process that failed says why); Alpha needs the update each "
                "parameter will receive. Fix: use an optimizer whose step treats "
                "each parameter separately (every torch.optim optimizer except "
                "LBFGS) and pass the same optimizer in info on every step"
            )
        entries = [self.acc.starts[index] for index in range(len(params))]
        direction_and_dots = self._direction(
            global_step, optimizer, entries, params, known=self.acc.direction
        )
        if isinstance(direction_and_dots, Missing):  # recorded at this step
            return direction_and_dots
        direction, dots = direction_and_dots
        if self.acc.tau_squared is not None:  # summed over the processes' rows
            tau = self.acc.tau_squared.value.sqrt()
        else:
            tau = torch.stack([(d**2).sum() for d in direction]).sum().sqrt()
        tau = tau.to(torch.float64)  # a tensor: no synchronisation
        value, value_var = self._loss_observation(ctx, dots.shape[0], dots.device)
        slope, slope_var = _slope_observation(dots, tau)
        kept = {
            "direction": direction,
            "tau": tau,
            "value": value,
            "value_var": value_var,
            "slope": slope,
            "slope_var": slope_var,
        }
        if self.acc.tau_squared is not None:  # each process's rows (FSDP2)
            kept["owner"] = ctx.rows.owner
        return kept

    def _direction(
        self, global_step, optimizer, entries, params, dots=True, known=None
    ):
        """The step ``d`` per parameter and ``sum_p g_i,p . d_p`` (``dots``).

        Or why there is none (:class:`Missing`). ``known``: the direction formed
        earlier in the step from the same entries (FSDP2's ``tau^2``), not formed
        again.
        """
        kinds = {entry.kind for entry in entries}
        if kinds == {"sgd"} and is_plain_sgd(optimizer):
            factors = [-lr for lr in learning_rates(optimizer, params)]
            direction = known or [c * e.vector for c, e in zip(factors, entries)]
            if not dots:
                return direction, None
            dots = torch.stack([c * e.dots for c, e in zip(factors, entries)])
            return direction, dots.sum(0)
        if kinds == {"replay"} and all(e.owner == id(optimizer) for e in entries):
            direction = [e.vector for e in entries]
            if not dots:
                return direction, None
            return direction, torch.stack([e.dots for e in entries]).sum(0)
        reasons = sorted({e.reason for e in entries if e.kind == "failed"})
        why = reasons[0] if reasons else "the optimizer changed during the step"
        fix = (
            "Fix: use an optimizer whose step treats each parameter separately "
            "(every torch.optim optimizer except LBFGS) and pass the same optimizer "
            "in info on every step"
        )
        return Missing(  # (recorded with a warning, once)
            f"{why}; Alpha needs the update each parameter will receive. {fix}"
        )

    def _compute_end(self, global_step: int, ctx: TrackContext, state: dict):
        """The fit along the step, on the device; decided on the host.

        Nothing is synchronised: ``alpha``, whether it is defined and whether a
        variance was floored travel to the host with the step's values
        (:class:`~cockpit.utils.host.Deferred`), where the warning is given and
        a fit without a minimiser becomes :class:`Missing`.
        """
        if "owner" in state and ctx.rows is not None and self.rows_of(ctx) is None:
            return Missing(self._left_rows_reason(global_step))
        if "owner" in state and (
            self.rows_of(ctx) is None
            or self.acc.foreign is None
            or bool(self.acc.foreign.value > 0)
        ):  # rows of a fully_shard run, not this process's (or read without FSDP)
            return Missing(foreign_reason(self.key))
        dots = self.acc.end_dots
        value, value_var = self._loss_observation(ctx, dots.shape[0], dots.device)
        start = [
            torch.as_tensor(state[k], dtype=torch.float64, device=dots.device)
            for k in ("tau", "value", "value_var", "slope", "slope_var")
        ]
        tau, start_value, start_value_var, start_slope, start_slope_var = start
        slope, slope_var = _slope_observation(dots, tau)
        variances = torch.stack(
            [start_value_var, value_var, start_slope_var, slope_var]
        )
        zero = variances <= 0
        variances = torch.where(zero, F.VARIANCE_FLOOR, variances)
        observed = torch.stack([start_value, value, start_slope, slope])
        coefficients, solved = F.quadratic_fit(tau, observed, variances)
        alpha, defined = F.alpha_of_fit(tau, coefficients, solved)
        moved = tau != 0  # (a step that did not move is -1, whatever the fit)
        finite = torch.isfinite(observed).all() & torch.isfinite(variances).all()
        flags = torch.stack([defined, zero.any() & moved, finite])
        return Deferred((alpha, flags), lambda host: self._decided(global_step, *host))

    def _left_rows_reason(self, global_step: int) -> str:
        """Why a start kept as rows cannot end at a step on the full tensors."""
        optimizer = type(self._optimizer).__name__
        return (
            f"the step taken at step {global_step - 1} was kept as each process's "
            "rows of the fully_shard model (the optimizer's update replayed on "
            f"them), and at step {global_step} the optimizer is a {optimizer}, "
            "whose update cockpit replays only on the full tensors. Fix: keep one "
            "elementwise torch.optim optimizer (SGD, Adam, AdamW, ...) from a step "
            "where Alpha starts to the next, or track Alpha where it does not change"
        )

    def _decided(self, global_step: int, alpha: float, flags: list) -> float | Missing:
        defined, floored, finite = flags
        if floored:
            self._warn_once(
                "zero-variance",
                f"Alpha at step {global_step - 1}: a loss or slope observation has "
                f"zero variance over the mini-batch (e.g. batch size 1 or identical "
                f"samples); it was replaced by {F.VARIANCE_FLOOR}, which makes the "
                "fit follow that observation almost exactly. Use mini-batches of "
                "at least two distinct samples to avoid this. Shown once.",
            )
        if defined:
            return alpha
        return Missing(
            "the quadratic fit of the loss along the step has no minimiser to "
            "report (a singular fit, or a zero slope at the start of the step). "
            "Fix: none if rare; if it repeats, check that the updates and the "
            "gradients are not zero"
            if finite
            else f"the loss or its slope at step {global_step - 1} or "
            f"{global_step} is not finite, so the fit along the step is "
            "undefined. Fix: see the warning about non-finite values"
        )

    def _loss_observation(
        self, ctx: TrackContext, n: int, device: torch.device
    ) -> tuple[Tensor, Tensor]:
        """The mini-batch loss and its per-sample variance (float64, on ``device``)."""
        loss = ctx.info.require("loss", self.key)
        losses = torch.as_tensor(ctx.info.require("individual_losses", self.key))
        losses = losses.detach()
        if losses.dim() > 1:
            losses = losses.flatten(start_dim=1).mean(1)
        if losses.dim() != 1 or losses.shape[0] != n:
            raise ValueError(
                f"{self.key} needs info['individual_losses'] of shape [N] = [{n}] "
                f"(one loss per sample of this backward pass), got shape "
                f"{tuple(losses.shape)}. Fix: pass the per-sample losses of the same "
                "mini-batch, e.g. loss_fn(outputs, targets, reduction='none')."
            )
        if isinstance(loss, Tensor):
            value = loss.detach().to(device=device, dtype=torch.float64)
        else:
            value = torch.tensor(float(loss), dtype=torch.float64, device=device)
        losses = losses.to(device=device, dtype=torch.float64)
        return value, F.sample_variance(losses)

    # --- helpers -------------------------------------------------------------------
    def _warn_once(self, kind: str, message: str) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            warnings.warn(message, CockpitWarning, stacklevel=2)


def sum_of_squares(tensors) -> Tensor:
    """``sum_p ||t_p||^2`` in float64 (a process's rows: a partial sum)."""
    return squared_norms(tensors).sum()


def _slope_observation(dots: Tensor, tau: Tensor) -> tuple[Tensor, Tensor]:
    """Mean and unbiased variance of ``dots / tau`` (zeros if ``tau = 0``; tensors)."""
    projections = dots.detach().to(torch.float64) / torch.where(tau == 0, 1.0, tau)
    moved = tau != 0
    mean = torch.where(moved, projections.mean(), 0.0)
    return mean, torch.where(moved, F.sample_variance(projections), 0.0)


# --- 1.0.2's module-level helpers -----------------------------------------------------
# A two-step quantity copied from 1.0.2's Alpha calls these; Alpha itself uses
# :mod:`cockpit.quantities.functional`. Same arguments and results as in 1.0.2.
def _root_sum_of_squares(values) -> float:
    """``sqrt(sum_k v_k^2)`` of a list of numbers."""
    return math.sqrt(sum(float(v) ** 2 for v in values))


def _projected_gradient(u, v) -> float:
    """``u . v / ||v||`` of two vectors given as lists of tensors (per parameter)."""
    dot = sum(float((a * b).sum()) for a, b in zip(u, v))
    return dot / _root_sum_of_squares([float(b.norm(2)) for b in v])


def _exact_variance(grads, search_dir) -> float:
    """Unbiased variance over samples of ``g_i . d / ||d||``.

    Args:
        grads: Per parameter, the per-sample gradients ``[N, *shape]``.
        search_dir: Per parameter, the direction ``d``.
    """
    projections = [
        _projected_gradient(list(per_sample), search_dir) for per_sample in zip(*grads)
    ]
    return float(np.var(projections, ddof=1))


def _fit_quadratic(t, fs, dfs, fs_var, dfs_var):
    """Weighted least-squares quadratic through two noisy values and slopes.

    A zero variance is replaced by ``1e-10``, with a warning.

    Args:
        t: Position of the second observation (the first is at 0).
        fs: The two values.
        dfs: The two slopes.
        fs_var: The variances of the values.
        dfs_var: The variances of the slopes.

    Returns:
        ``numpy`` array ``(w0, w1, w2)`` of ``w0 + w1 x + w2 x^2``, or ``None`` if
        the system is singular.
    """
    variances, replaced = F.floor_variances((*fs_var, *dfs_var))
    if replaced:
        warnings.warn(
            "A variance is 0, using a small value instead.",
            CockpitWarning,
            stacklevel=2,
        )
    fit = F.fit_quadratic(float(t), tuple(fs), tuple(dfs), variances)
    return None if fit is None else fit.numpy()


def _get_alpha(mu, t):
    """``alpha`` of a fit from :func:`_fit_quadratic` and step length ``t``.

    ``-1`` for ``t = 0`` or a fit without minimum, ``None`` without a fit.
    """
    return F.alpha_from_fit(float(t), None if mu is None else torch.as_tensor(mu))
