"""The GGN of the cross-entropy as the curvature of estimated quantities.

Where BackPACK cannot form a curvature diagonal and
:func:`cockpit.curvature.source.choose` gave a quantity the GGN (HessTrace,
TICTrace, TICDiag where exact), this feature forms it before the user's backward
pass frees the graph, from the per-sample losses' mean: exactly where that takes
at most :data:`~cockpit.curvature.source.EXACT_MAX_PRODUCTS` backward passes,
otherwise as the Monte-Carlo estimate with the number of drawn labels
:func:`~cockpit.curvature.source.draws_for` chooses
(:mod:`cockpit.curvature.ggn`). It hands the diagonals to the quantities and records
the standard errors (zero where exact) with the curvature used, under
``<key>_estimate`` like Hutchinson's. A quantity that reads the GGN in place of
the Hessian says so once (:class:`~cockpit.errors.CockpitWarning`).
"""

from __future__ import annotations

import torch

from cockpit.curvature import source as curvature_source
from cockpit.curvature.ggn import Head, NotCrossEntropy
from cockpit.engines import autograd as autograd_engine
from cockpit.param_view import ParamResults, ParamView
from cockpit.step.features.base import StepFeature, register_feature
from cockpit.step.features.estimators import hutchinson_method
from cockpit.step.features.failures import Guarded

#: Every curvature label the GGN serves (the Hessian's where it stands in).
_KINDS = ("diag_h", "diag_ggn_exact", "diag_ggn_mc")


def substitution_warning(keys: list[str]) -> str:
    """The warning of quantities that read the GGN in place of the Hessian."""
    names = ", ".join(keys)
    return (
        f"{names}: BackPACK cannot form this model's Hessian diagonal, and "
        "Hutchinson's estimate of the Hessian trace is too noisy to read at any "
        "affordable budget (a relative error of 17-270 % at 16 products on real "
        "architectures), so for this run they use the generalised Gauss-Newton of "
        "the cross-entropy (positive semi-definite; exact where the classes and "
        "rows are few, else a Monte-Carlo estimate with its standard error). The "
        "log's '<key>_estimate' says curvature 'ggn'. Fix: to keep the Hessian "
        "(Hutchinson's estimate), pass curvature='hutchinson' to the quantity"
    )


@register_feature
class GGNCurvature(StepFeature):
    """Show the GGN diagonal to the quantities whose curvature it serves."""

    order = 9  # before Hutchinson's (10): a loss it cannot read falls back there

    @classmethod
    def applies(cls, run) -> bool:
        """Whether any estimated quantity reads the GGN at this step."""
        return bool(cls.served(run))

    @staticmethod
    def served(run) -> list:
        """The estimated quantities that read the GGN."""
        return [
            q
            for q in run.ledger.estimated()
            if curvature_source.chosen(q) == curvature_source.GGN
        ]

    def before_backward(self) -> None:
        """Form the GGN diagonal (exact or drawn) from the per-sample losses."""
        run = self.run
        quantities = self.served(run)
        params = run.params
        with run.quiet():
            loss = autograd_engine.sample_losses(run.engine_step.losses).mean()
            try:
                head = Head(loss, params)
            except NotCrossEntropy as error:
                self._refuse(quantities, error)
                return
            size = head.log_p.numel()
            if size <= curvature_source.EXACT_MAX_PRODUCTS:
                estimate = head.exact()
                settings = {"method": "ggn_exact", "probes": estimate.products}
            else:
                estimate = curvature_source.monte_carlo(
                    head, quantities, run.router.generator
                )
                settings = {"method": "ggn_monte_carlo", "probes": estimate.products}
            head = loss = None
        settings["curvature"] = curvature_source.GGN
        self._show(quantities, estimate, settings)
        swapped = [q.key for q in quantities if curvature_source.substitutes(q)]
        if swapped:
            run.diagnostics.warn_once(
                ("ggn-for-hessian", tuple(swapped)), substitution_warning(swapped)
            )

    def _refuse(self, quantities, error: NotCrossEntropy) -> None:
        """A loss the GGN cannot read: the Hessian's estimate, or missing."""
        run = self.run
        for quantity in quantities:
            if curvature_source.substitutes(quantity):
                curvature_source.fall_back(quantity)
                run.ledger.estimate(quantity, hutchinson_method(run.probes))
            else:
                run.ledger.leave_out(
                    quantity,
                    f"{quantity.key} reads the GGN of a cross-entropy, but {error}. "
                    "Fix: compute the loss with F.cross_entropy / "
                    "nn.CrossEntropyLoss on the model's logits, or track it on a "
                    "model BackPACK serves",
                    once=("ggn-not-cross-entropy", quantity.key),
                )

    def _show(self, quantities, estimate, settings: dict) -> None:
        """Hand the diagonals to the quantities; record the errors."""
        run = self.run
        guards = [Guarded(q) for q in quantities]
        run.guards.extend(guards)
        with torch.no_grad():
            for index, (param, diagonal) in enumerate(
                zip(run.params, estimate.diagonals, strict=True)
            ):
                results = ParamResults(curvatures=dict.fromkeys(_KINDS, diagonal))
                view = ParamView(param, index, results)
                for guard in guards:
                    guard.accumulate(run.step, view)
                view.release()
        traces = estimate.traces
        if traces.shape[0] > 1:
            errors = autograd_engine.trace_errors(traces)
            total = autograd_engine.sum_error(traces)
        else:  # exact
            errors = [torch.zeros((), dtype=torch.float64) for _ in run.params]
            total = torch.zeros((), dtype=torch.float64)
        for quantity in quantities:
            run.ledger.set_errors(quantity, (errors, total), settings)
            quantity.probe_traces(traces)
