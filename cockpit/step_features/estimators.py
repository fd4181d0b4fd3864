"""Curvature diagonals estimated where no engine computes them exactly.

Where BackPACK cannot form the curvature (a model it cannot backpropagate
through), a quantity that accepts an unbiased estimate (``Quantity.estimable``)
reads a Hutchinson estimate of the Hessian diagonal, from Hessian-vector products
of the per-sample losses, with its standard error; the ledger records both.
"""

from __future__ import annotations

import torch

from cockpit.engines import autograd as autograd_engine
from cockpit.param_view import ParamResults, ParamView
from cockpit.step_features.base import StepFeature, register_feature
from cockpit.step_features.failures import Guarded


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
    return f"Hutchinson, {probes} Hessian-vector products"


@register_feature
class Hutchinson(StepFeature):
    """Show Hutchinson estimates of the Hessian diagonal to the estimated ones."""

    order = 10

    @classmethod
    def applies(cls, run) -> bool:
        """Whether the feature has work at this step."""
        return bool(run.ledger.estimated())

    def before_backward(self) -> None:
        """Work before the user's backward pass (see the module)."""
        run = self.run
        quantities = run.ledger.estimated()
        run.ledger.estimator = {"method": "hutchinson", "probes": run.probes}
        try:
            with run.quiet():
                diagonals, errors, traces = autograd_engine.hutchinson_diagonals(
                    run.engine_step.losses,
                    run.params,
                    run.probes,
                    run.router.generator,
                    return_traces=True,
                )
        except RuntimeError as error:
            if not no_double_backward(error):
                raise
            for quantity in quantities:
                run.without_double_backward(quantity, error)
            return
        guards = [Guarded(q) for q in quantities]
        run.guards.extend(guards)
        with torch.no_grad():
            for index, (param, diagonal) in enumerate(
                zip(run.params, diagonals, strict=True)
            ):
                view = ParamView(
                    param, index, ParamResults(curvatures={"diag_h": diagonal})
                )
                for guard in guards:
                    guard.accumulate(run.step, view)
                view.release()
        total = autograd_engine.sum_error(traces)
        for quantity in quantities:
            run.ledger.set_errors(quantity, (errors, total))
            quantity.probe_traces(traces)
        run.probe_traces = traces
