"""FSDP2 steps: what cockpit cannot form on sharded parameters, recorded missing.

With ``fully_shard`` parameters (:mod:`cockpit.distributed.sharded`) the
first-order quantities are joined like DDP's. What needs second derivatives of the
loss (HessMaxEV's Hessian-vector products, the Hutchinson and GGN estimates of a
curvature diagonal) would differentiate the gradient with respect to the
parameters again, through a backward pass FSDP runs without ``create_graph`` and
across units it reshards: it is recorded as missing, with the reason and what to
do, before any work of the step (never a crash, never a wrong number); so is
Alpha's replay of an optimizer whose sharded state is not laid out like its
parameters (torch.optim's is: it is joined with them). Curvature
diagonals BackPACK forms inside the backward pass (``DiagHessian``, ``DiagGGN``
extensions) are not affected.
"""

from __future__ import annotations

from cockpit.needs import Need
from cockpit.quantities.optim import is_plain_sgd
from cockpit.step.features.base import StepFeature, register_feature


def sharded_curvature_reason(key: str) -> str:
    """Why a curvature value is missing on a ``fully_shard`` model, and the fix."""
    return (
        f"{key} needs second derivatives of the loss (Hessian-vector products), "
        "which cockpit does not form on FSDP2 (fully_shard) parameters: FSDP "
        "cannot run the backward pass with create_graph=True. Fix: track it in a "
        "run without fully_shard (one process or DDP on a smaller model), or use "
        "curvature BackPACK forms in the backward pass (e.g. TICDiag with "
        "curvature='diag_ggn_exact' on a model of BackPACK's layers)"
    )


def sharded_replay_reason(key: str, optimizer: str, why: str) -> str:
    """Why a replayed update is missing on a ``fully_shard`` model, and the fix."""
    return (
        f"{key} replays the update of the optimizer ({optimizer}), whose state FSDP "
        f"holds in shards; cockpit joins each shard of that state like its "
        f"parameter's, but {why}. Fix: keep the optimizer's state sharded as "
        "fully_shard shards the parameters (torch.optim optimizers do), or track "
        "Alpha in a run without fully_shard"
    )


@register_feature
class ShardedCurvature(StepFeature):
    """Record the second-order quantities of an FSDP2 step as missing."""

    order = 5  # before the curvature estimates (10) start work
    only_if = ("communicator",)

    @classmethod
    def applies(cls, state) -> bool:
        """Only on a cockpit over ``fully_shard`` parameters."""
        return getattr(state.communicator, "sharding", None) is not None

    def begin(self) -> None:
        """Leave out what needs second derivatives (or a sharded optimizer's replay).

        At the step's opening, before any feature or engine works on them.
        """
        state = self.state
        ledger, plan = state.ledger, state.plan
        out = [
            q
            for q in plan.active
            if not ledger.out(q)
            and (
                Need.HESSIAN_VECTOR_PRODUCTS in plan.needs_of(q)
                or q in ledger.estimated()
            )
        ]
        for quantity in out:
            ledger.leave_out(
                quantity,
                sharded_curvature_reason(quantity.key),
                once=("fsdp-curvature", quantity.key),
                short="not on fully_shard parameters (no second derivatives)",
            )
        optimizer = state.info.get("optimizer")
        if optimizer is None or is_plain_sgd(optimizer):
            return
        why = state.communicator.sharding.state_unsharded(optimizer)
        if why is None:  # joined like the parameters after the backward pass
            return
        replayed = [
            q
            for q in plan.active
            if not ledger.out(q) and Need.OPTIMIZER_UPDATE in plan.needs_of(q)
        ]
        for quantity in replayed:
            ledger.leave_out(
                quantity,
                sharded_replay_reason(quantity.key, type(optimizer).__name__, why),
                once=("fsdp-replay", quantity.key),
                short="not on fully_shard parameters with this optimizer",
            )
