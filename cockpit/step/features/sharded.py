"""FSDP2 steps: second derivatives on unsharded units; what cannot be joined, missing.

With ``fully_shard`` parameters (:mod:`cockpit.distributed.sharded`) the
first-order quantities compute on each process's rows and are joined like DDP's
(:mod:`cockpit.distributed.rows`). What needs second derivatives of the
loss (HessMaxEV's Hessian-vector products, Hutchinson's estimate of a curvature
diagonal) is formed as in DDP, from this process's loss before the user's backward
pass, with respect to the unsharded parameters, inside :func:`derivatives`: every
unit is unsharded and FSDP does not reshard it at the end of cockpit's own backward
passes (it would free the tensors the graph of the gradient reads). The GGN's
backward passes are first-order and need no such care, but run there as well.

What reads an optimizer whose class cannot be made from its parameter groups,
and Alpha's replay of an optimizer whose sharded state is not laid out like its
parameters (torch.optim's is: it is joined with them), is recorded as missing, with
the reason and what to do, before any work of the step (never a crash, never a
wrong number).
"""

from __future__ import annotations

import contextlib

import torch

from cockpit.needs import Need
from cockpit.quantities.optim import is_plain_sgd
from cockpit.step.features.base import StepFeature, register_feature


def derivatives(state):
    """Where to differentiate the loss of a step, and with respect to what.

    A context manager yielding the tensors the modules compute with
    (``state.engine.params``); on ``fully_shard`` parameters every unit is
    unsharded inside (:meth:`~cockpit.distributed.sharded.Sharding.unsharded`).
    """
    sharding = getattr(state.communicator, "sharding", None)
    if sharding is None:
        return contextlib.nullcontext(list(state.engine.params))
    return sharding.unsharded()


def sharded_replay_reason(key: str, optimizer: str, why: str) -> str:
    """Why a replayed update is missing on a ``fully_shard`` model, and the fix."""
    return (
        f"{key} replays the update of the optimizer ({optimizer}), whose state FSDP "
        f"holds in shards; cockpit joins each shard of that state like its "
        f"parameter's, but {why}. Fix: keep the optimizer's state sharded as "
        "fully_shard shards the parameters (torch.optim optimizers do), or track "
        "Alpha in a run without fully_shard"
    )


def sharded_optimizer_reason(key: str, why: str) -> str:
    """Why a quantity reading the optimizer is missing on a ``fully_shard`` model."""
    return (
        f"{key} reads the optimizer's learning rates (and replays its update), "
        "which cockpit reads from a copy of the optimizer over each process's "
        "rows of the parameters (or over the full tensors) on fully_shard "
        f"models, but {why}. Fix: give the optimizer's "
        "class a constructor that takes the parameter groups alone (as "
        "torch.optim optimizers do), or track it in a run without fully_shard"
    )


@register_feature
class ShardedReplay(StepFeature):
    """Leave out what reads an optimizer cockpit cannot copy over full tensors.

    The quantities that read the optimizer (``"optimizer"`` in their
    ``info_keys``: Alpha, CABS, EarlyStopping) where its class cannot be made from
    its parameter groups; Alpha's replay where its sharded state is not laid out
    like its parameters.
    """

    order = 5  # before any feature starts work
    only_if = ("communicator",)

    @classmethod
    def applies(cls, state) -> bool:
        """Only on a cockpit over ``fully_shard`` parameters."""
        return getattr(state.communicator, "sharding", None) is not None

    def begin(self) -> None:
        """Leave them out with the reason, at the step's opening.

        Before any feature or engine works on them.
        """
        state = self.state
        ledger, plan = state.ledger, state.plan
        optimizer = state.info.get("optimizer")
        if not isinstance(optimizer, torch.optim.Optimizer):
            return
        sharding = state.communicator.sharding
        why = sharding.optimizer_unbuildable(optimizer)
        if why is not None:  # the learning rates too are read from that copy
            readers = [
                q
                for q in plan.active
                if not ledger.out(q) and "optimizer" in getattr(q, "info_keys", ())
            ]
            for quantity in readers:
                ledger.leave_out(
                    quantity,
                    sharded_optimizer_reason(quantity.key, why),
                    once=("fsdp-optimizer", quantity.key),
                    short="not on fully_shard parameters with this optimizer",
                )
            return
        if is_plain_sgd(optimizer):
            return
        why = sharding.state_unsharded(optimizer)
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
