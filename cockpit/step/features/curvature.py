"""Curvature diagonals estimated where no engine computes them exactly.

Where BackPACK cannot form the curvature (a model it cannot backpropagate
through), a quantity that accepts an estimate (``Quantity.estimable``) was given a
source by :func:`cockpit.curvature.source.choose` when the step was routed. This
feature forms it before the user's backward pass frees the graph, for each
estimated quantity from the source it was given:

* the **GGN** of the cross-entropy (HessTrace, TICTrace, TICDiag where exact), from
  the per-sample losses' mean: exactly where that takes at most
  :data:`~cockpit.curvature.source.EXACT_MAX_PRODUCTS` backward passes, otherwise
  as the Monte-Carlo estimate with the number of drawn labels
  :func:`~cockpit.curvature.source.draws_for` chooses (:mod:`cockpit.curvature.ggn`).
  A quantity that reads the GGN in place of the Hessian says so once
  (:class:`~cockpit.errors.CockpitWarning`); where the loss turns out not to be a
  cross-entropy, such a quantity falls back to the Hessian's estimate;
* **Hutchinson**'s estimate of the Hessian diagonal
  (:func:`cockpit.curvature.hutchinson.hessian_diagonal`), ``probes``
  (``Cockpit.HUTCHINSON_PROBES``, 16) Hessian-vector products.

It hands the diagonals to the quantities and records the standard errors (zero
where exact) with the curvature used, under ``<key>_estimate``. It returns the
quantities it showed a diagonal (their errors are raised after the backward pass)
and each estimate's per-draw traces with the quantities it served (a
data-parallel step joins them for those quantities' standard errors). In a
data-parallel run each process forms its shard's part, the exact-or-Monte-Carlo
choice made on the joined batch's size (one all-gather of every process's sizes,
:class:`~cockpit.curvature.source.Share`).
"""

from __future__ import annotations

import torch

from cockpit.curvature import hutchinson
from cockpit.curvature import source as curvature_source
from cockpit.curvature.ggn import Head, NotCrossEntropy
from cockpit.param_view import ParamResults, ParamView
from cockpit.per_sample import sample_losses
from cockpit.step.features.backward_checks import Guarded
from cockpit.step.features.base import StepFeature, register_feature
from cockpit.step.features.sharded import derivatives
from cockpit.step.state import Produced

#: Every curvature label the GGN serves (the Hessian's where it stands in).
_GGN_KINDS = ("diag_h", "diag_ggn_exact", "diag_ggn_mc")


def substitution_warning(keys: list[str], sharded: bool = False) -> str:
    """The warning of quantities that read the GGN in place of the Hessian.

    ``sharded``: the model's parameters are FSDP2's (no engine serving them
    forms a Hessian diagonal).
    """
    names = ", ".join(keys)
    why = (
        "no engine that serves fully_shard (FSDP2) models forms the Hessian "
        "diagonal (BackPACK does not serve them)"
        if sharded
        else "BackPACK cannot form this model's Hessian diagonal"
    )
    return (
        f"{names}: {why}, and "
        "Hutchinson's estimate of the Hessian trace is too noisy to read at any "
        "affordable budget (a relative error of 17-270 % at 16 products on real "
        "architectures), so for this run they use the generalised Gauss-Newton of "
        "the cross-entropy (positive semi-definite; exact where the classes and "
        "rows are few, else a Monte-Carlo estimate with its standard error). The "
        "log's '<key>_estimate' says curvature 'ggn'. Fix: to keep the Hessian "
        "(Hutchinson's estimate), pass curvature='hutchinson' to the quantity"
    )


def _reads_ggn(state) -> list:
    return [
        q
        for q in state.ledger.estimated()
        if curvature_source.chosen(q) == curvature_source.GGN
    ]


def _reads_hessian(state) -> list:
    return [
        q
        for q in state.ledger.estimated()
        if curvature_source.chosen(q) != curvature_source.GGN
    ]


@register_feature
class Curvature(StepFeature):
    """Show estimated curvature diagonals to the estimated quantities."""

    order = 10
    only_if = ("plan.estimated",)  # some quantity's curvature is estimated

    def before_backward(self) -> Produced | None:
        """The GGN for those that read it, then Hutchinson for the others."""
        state = self.state
        produced = Produced()
        ggn = _reads_ggn(state)
        if ggn:  # a loss the GGN cannot read sends some to Hutchinson
            produced = produced.then(self._ggn(ggn))
        hessian = _reads_hessian(state)
        if hessian:
            produced = produced.then(self._hutchinson(hessian))
        return produced

    # --- the GGN of the cross-entropy -----------------------------------------------
    def _ggn(self, quantities) -> Produced | None:
        state = self.state
        with derivatives(state) as wrt, state.engine.quiet():
            loss = sample_losses(state.engine.losses).mean()
            try:
                head = Head(loss, wrt)
            except NotCrossEntropy as error:
                self._not_cross_entropy(quantities, error)
                return None
            share, elements, products = self._share(head, loss)
            if elements <= curvature_source.EXACT_MAX_PRODUCTS:
                estimate = head.exact()
                products = estimate.products if products is None else products
                settings = {"method": "ggn_exact", "probes": products}
            else:
                quantities = self._drop_exact_only(quantities, elements)
                if not quantities:
                    return None
                estimate = curvature_source.monte_carlo(
                    head, quantities, state.generator, share
                )
                settings = {"method": "ggn_monte_carlo", "probes": estimate.products}
            head = loss = None
        settings["curvature"] = curvature_source.GGN
        exact = estimate.traces.shape[0] <= 1
        guards = self._show(quantities, estimate, settings, _GGN_KINDS, exact)
        swapped = [q.key for q in quantities if curvature_source.substitutes(q)]
        if swapped:
            sharded = getattr(state.communicator, "sharding", None) is not None
            state.checks.warn_once(
                ("ggn-for-hessian", tuple(swapped)),
                substitution_warning(swapped, sharded),
            )
        # a data-parallel step joins the draws' traces for the standard errors
        drawn = () if exact else ((tuple(quantities), estimate.traces),)
        return Produced(guards=guards, estimates=drawn)

    def _share(self, head, loss) -> tuple:
        """This process's part of the joined batch's GGN (data-parallel runs).

        Returns:
            The :class:`~cockpit.curvature.source.Share` (``None`` in one
            process), ``log p``'s elements and the exact diagonal's products, both
            of the joined batch (one collective: every process's sizes; in one
            process the products are the estimate's own, ``None`` here).
        """
        comm = self.state.communicator
        if comm is None or comm.local or comm.stopping:  # (stopping: no collective)
            return None, head.log_p.numel(), None
        n_local = int(sample_losses(self.state.engine.losses).shape[0])
        mine = [head.log_p.numel(), head.root.shape[0], head.exact_products, n_local]
        step = self.state.step
        every = comm.start_gather_ints(mine, "the GGN's sizes", step).wait()
        elements, rows, products, samples = (sum(column) for column in zip(*every))
        first = sum(sizes[1] for sizes in every[: comm.rank])
        weight = n_local / samples  # this shard's share of the joined mean

        def join(traces):
            return comm.all_reduce(traces * weight, "the GGN's draws", step)

        share = curvature_source.Share((first, rows), elements, join)
        return share, elements, products

    def _drop_exact_only(self, quantities, elements: int) -> list:
        """Data-parallel: leave out those that take only the exact diagonal.

        (One process knows the joined batch's size when routing; a process sees
        its shard's then, and the joined size only here.)
        """
        keep = []
        for quantity in quantities:
            if not getattr(quantity, "exact_curvature_only", False):
                keep.append(quantity)
                continue
            self.state.ledger.leave_out(
                quantity,
                f"{quantity.key} divides by the curvature diagonal elementwise and "
                "takes only an exact one, and the GGN's of this joined batch would "
                f"take {elements} > {curvature_source.EXACT_MAX_PRODUCTS} backward "
                "passes. Fix: track TICTrace (estimated with its standard error), "
                "or smaller batches at its steps",
                once=("ggn-exact-only", quantity.key),
            )
        return keep

    def _not_cross_entropy(self, quantities, error: NotCrossEntropy) -> None:
        """A loss the GGN cannot read: the Hessian's estimate, or missing."""
        state = self.state
        for quantity in quantities:
            if curvature_source.substitutes(quantity):
                curvature_source.fall_back(quantity)
                how = hutchinson.hutchinson_method(state.probes)
                state.ledger.estimate(quantity, how)
            else:
                state.ledger.leave_out(
                    quantity,
                    f"{quantity.key} reads the GGN of a cross-entropy, but {error}. "
                    "Fix: compute the loss with F.cross_entropy / "
                    "nn.CrossEntropyLoss on the model's logits, or track it on a "
                    "model BackPACK serves",
                    once=("ggn-not-cross-entropy", quantity.key),
                )

    # --- Hutchinson's estimate of the Hessian ---------------------------------------
    def _hutchinson(self, quantities) -> Produced:
        state = self.state
        try:
            with derivatives(state) as wrt, state.engine.quiet():
                estimate = hutchinson.hessian_diagonal(
                    state.engine.losses, wrt, state.probes, state.generator
                )
        except RuntimeError as error:
            if not hutchinson.no_double_backward(error):
                raise
            return Produced(undifferentiable=tuple((q, error) for q in quantities))
        settings = {
            "method": "hutchinson",
            "probes": estimate.products,
            "curvature": "hessian",
        }
        guards = self._show(quantities, estimate, settings, ("diag_h",), False)
        return Produced(
            guards=guards, estimates=((tuple(quantities), estimate.traces),)
        )

    # --- handing it to the quantities ----------------------------------------------
    def _show(self, quantities, estimate, settings, kinds, exact) -> tuple:
        """Hand the diagonals to the quantities; record the errors.

        Returns:
            The guards of the quantities (their errors while reading).
        """
        state = self.state
        guards = tuple(Guarded(q) for q in quantities)
        with torch.no_grad():
            for index, (param, diagonal) in enumerate(
                zip(state.engine.params, estimate.diagonals, strict=True)
            ):
                results = ParamResults(curvatures=dict.fromkeys(kinds, diagonal))
                view = ParamView(param, index, results)
                for guard in guards:
                    guard.accumulate(state.step, view)
                view.release()
        traces = estimate.traces
        if exact:
            total = traces.new_zeros((), dtype=torch.float64)
            errors = [total.clone() for _ in state.params]
        else:
            errors = hutchinson.trace_errors(traces)
            total = hutchinson.sum_error(traces)
        for quantity in quantities:
            state.ledger.set_errors(quantity, (errors, total), settings)
            quantity.probe_traces(traces)
        return guards
