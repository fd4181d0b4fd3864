"""Curvature diagonals estimated where no engine computes them exactly.

Where BackPACK cannot form the curvature (a model it cannot backpropagate
through), a quantity that accepts an unbiased estimate (``Quantity.estimable``)
gets a source from :mod:`cockpit.curvature.source`: the GGN of the cross-entropy
(:mod:`cockpit.step.features.ggn`) or, here, an estimate of the Hessian diagonal
made from Hessian-vector products (:mod:`cockpit.curvature.hutchinson`), with its
standard error; the ledger records both. Two ways, chosen per step (the first is
off, :data:`SHARE_LANCZOS`, so today every estimate is Hutchinson's):

* the step runs HessMaxEV's Lanczos anyway (the user's backward pass carries the
  graph, ``create_graph=True``): after the backward pass, that Lanczos run is done
  here, once, and its Krylov space is taken exactly; further products probe the
  rest (:func:`~cockpit.curvature.hutchinson.deflated`), as many as make the estimate
  about as precise as Hutchinson's with ``probes`` (:func:`deflated_probes`).
  HessMaxEV reads the same run, so the step spends the Lanczos products once for
  both, and no extra gradient pass;
* otherwise, before the user's backward pass frees the graph, the gradient is
  formed once more with a graph and ``probes`` Rademacher vectors are multiplied
  (:func:`~cockpit.curvature.hutchinson.hutchinson`).

``probes`` is ``Cockpit.HUTCHINSON_PROBES`` (16).
"""

from __future__ import annotations

import math

import torch

from cockpit.curvature import hutchinson as trace_estimators
from cockpit.curvature import source as curvature_source
from cockpit.engines import autograd as autograd_engine
from cockpit.param_view import ParamResults, ParamView
from cockpit.quantities.hess_max_ev import (
    HessMaxEV,
    _common_dtype,
    _graph_gradients,
    _make_hvp,
)
from cockpit.step.features.base import StepFeature, register_feature
from cockpit.step.features.failures import Guarded


def no_double_backward(error: Exception) -> bool:
    """Whether ``error`` is PyTorch's missing derivative of a backward operator."""
    text = str(error)
    return (
        isinstance(error, RuntimeError)
        and "derivative for" in text
        and "backward" in text
        and "not implemented" in text
    )


def hutchinson_method(probes: int) -> str:
    """How an estimate is made (shown in the coverage report)."""
    return trace_estimators.hutchinson_method(probes)


#: The fewest products on the rest of a Krylov-deflated estimate (its standard
#: error comes from their spread).
MIN_DEFLATED_PROBES = 8


def deflated_probes(probes: int, share: float | None) -> int:
    """Products on the rest of a Krylov-deflated estimate.

    As many as make it about as precise as Hutchinson's with ``probes``:
    ``share * probes``, with ``share`` the part of Hutchinson's variance that the
    previous tracked step's rest still had
    (:func:`~cockpit.curvature.hutchinson.residual_share`; chosen before this step's
    probes are drawn, so their spread stays an honest error), between
    :data:`MIN_DEFLATED_PROBES` and ``probes``; ``probes`` at the first step.
    """
    probes = max(2, int(probes))
    if share is None:
        return probes
    return min(probes, max(MIN_DEFLATED_PROBES, math.ceil(share * probes)))


#: Off: measured on GPT-2 (benchmarks/results/curvature_cost.md), the deflated
#: estimate was no more precise than Hutchinson's (standard error 250 vs 243 at 16
#: probes) and made full 1.3x slower, and it made one process's HessTrace differ
#: from a data-parallel run's on the same batch (which uses Hutchinson).
SHARE_LANCZOS = False


def shared_solver(run, plan=None) -> HessMaxEV | None:
    """The HessMaxEV whose Lanczos run the step's estimate can share, if any.

    Only where the user's backward pass carries the graph (``create_graph``) in a
    single process; power iteration keeps no basis.

    Args:
        run: The step.
        plan: Its plan (default: ``run.plan``).
    """
    plan = run.plan if plan is None else plan
    if not SHARE_LANCZOS or not plan.create_graph or run.communicator is not None:
        return None
    for quantity in plan.active:
        if (
            isinstance(quantity, HessMaxEV)
            and not quantity.use_power
            and not run.ledger.out(quantity)
        ):
            return quantity
    return None


def estimate_method(run, plan=None, quantity=None, losses=None) -> str | None:
    """How the step's estimate for ``quantity`` will be made (``None``: none serves).

    The source is chosen by :func:`cockpit.curvature.source.choose` (the GGN of the
    cross-entropy where it can be read, else Hutchinson's estimate of the
    Hessian); these are the coverage report's words.

    Args:
        run: The step.
        plan: Its plan (default: ``run.plan``).
        quantity: The estimated quantity (``None``: the Hessian's estimate).
        losses: The step's per-sample losses (with ``quantity``).
    """
    plan = run.plan if plan is None else plan
    if quantity is not None:
        source = curvature_source.choose(run, plan, quantity, losses)
        if source is None:
            return None
        if source == curvature_source.GGN:
            size = curvature_source.head_size(losses, run.params)
            how = curvature_source.method(source, size)
            if curvature_source.substitutes(quantity):
                how = f"{how}, in place of the Hessian (curvature='hutchinson' for it)"
            return how
    if shared_solver(run, plan) is not None:
        return (
            "Krylov-deflated Hutchinson: HessMaxEV's Lanczos vectors exact, at "
            f"most {run.probes} Hessian-vector products on the rest"
        )
    return hutchinson_method(run.probes)


@register_feature
class Hutchinson(StepFeature):
    """Show estimates of the Hessian diagonal to the estimated quantities."""

    order = 10

    @classmethod
    def applies(cls, run) -> bool:
        """Whether the feature has work at this step."""
        return bool(run.ledger.estimated())

    @staticmethod
    def served(run) -> list:
        """The estimated quantities that read the Hessian (not the GGN)."""
        return [
            q
            for q in run.ledger.estimated()
            if curvature_source.chosen(q) != curvature_source.GGN
        ]

    def __init__(self, run):
        super().__init__(run)
        self.solver = shared_solver(run)

    def before_backward(self) -> None:
        """Without a shared Lanczos run: Hutchinson on the per-sample losses."""
        if self.solver is not None or not self.served(self.run):
            return
        run = self.run
        params = run.params
        try:
            with run.quiet():
                loss = autograd_engine.sample_losses(run.engine_step.losses).mean()
                grads = torch.autograd.grad(
                    loss, params, create_graph=True, retain_graph=True,
                    allow_unused=True,
                )  # fmt: skip
                grads = [
                    torch.zeros_like(p) if g is None else g
                    for p, g in zip(params, grads, strict=True)
                ]
                dtype, device = _common_dtype(params), params[0].device
                hvp = _make_hvp(params, grads, dtype, device)
                estimate = trace_estimators.hutchinson(
                    hvp,
                    [p.shape for p in params],
                    run.probes,
                    run.router.generator,
                    dtype,
                    device,
                )
        except RuntimeError as error:
            if not no_double_backward(error):
                raise
            self._without_double_backward(error)
            return
        self._show(estimate, {"method": "hutchinson", "probes": estimate.products})

    def after_backward(self) -> None:
        """With HessMaxEV due: one Lanczos run for both, its basis deflates."""
        solver, run = self.solver, self.run
        if solver is None or not self.served(run):
            return
        params = run.params
        try:
            grads = _graph_gradients(params, solver.key, run.step)
        except RuntimeError as error:  # HessMaxEV raises it too, when tracked
            run.ledger.leave_out(self.served(run), str(error))
            return
        try:
            dtype, device = _common_dtype(params), params[0].device
            hvp = _make_hvp(params, grads, dtype, device)
            with run.routing.idle():
                dim = sum(p.numel() for p in params)
                result = solver.solve(run.step, hvp, dim, dtype, device)
                estimate = trace_estimators.deflated(
                    hvp,
                    result.krylov,
                    [p.shape for p in params],
                    deflated_probes(run.probes, solver.residual_share),
                    run.router.generator,
                )
                result.krylov = None  # the basis is freed with the estimate
            solver.residual_share = trace_estimators.residual_share(estimate)
        except RuntimeError as error:
            if no_double_backward(error):
                self._without_double_backward(error)
                return
            raise
        finally:
            grads = hvp = None
        self._show(
            estimate,
            {
                "method": "krylov-deflated hutchinson",
                "probes": estimate.products,
                "basis": result.num_hvps,
            },
        )

    def _without_double_backward(self, error: Exception) -> None:
        for quantity in self.served(self.run):
            self.run.without_double_backward(quantity, error)

    def _show(self, estimate: trace_estimators.TraceEstimate, settings: dict) -> None:
        """Hand the diagonals to the estimated quantities, record the errors."""
        run = self.run
        quantities = self.served(run)
        settings = {**settings, "curvature": "hessian"}
        guards = [Guarded(q) for q in quantities]
        run.guards.extend(guards)
        with torch.no_grad():
            for index, (param, diagonal) in enumerate(
                zip(run.params, estimate.diagonals, strict=True)
            ):
                view = ParamView(
                    param, index, ParamResults(curvatures={"diag_h": diagonal})
                )
                for guard in guards:
                    guard.accumulate(run.step, view)
                view.release()
        traces = estimate.traces
        errors = autograd_engine.trace_errors(traces)
        total = autograd_engine.sum_error(traces)
        for quantity in quantities:
            run.ledger.set_errors(quantity, (errors, total), settings)
            quantity.probe_traces(traces)
        run.probe_traces = traces
