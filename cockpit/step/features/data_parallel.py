"""The data-parallel part of a tracked step (a step feature; see ``distributed.py``).

Every process tracks its own shard; this feature sends the step's header (step,
shard size, plan) while the backward pass runs, catches each shard's gradient where
``.grad`` is not the joined one, and, after the backward pass, joins the shards:
the joined batch's gradient, ``info`` and the quantities' partial sums, so that
every process computes the values of the joined batch.
"""

from __future__ import annotations

import sys
from dataclasses import replace

import torch
from torch import Tensor

from cockpit import distributed
from cockpit.context import StepInfo
from cockpit.curvature.hutchinson import sum_error, trace_errors
from cockpit.distributed.rows import Rows
from cockpit.distributed.unit_sums import UnitSums
from cockpit.needs import Need
from cockpit.per_sample import sample_losses
from cockpit.precision import upcast
from cockpit.quantities.base import TrackContext
from cockpit.quantities.utils_params import gradients
from cockpit.step.features.base import StepFeature, register_feature
from cockpit.step.features.sharded import derivatives
from cockpit.step.state import Produced


def _missing_batch_size(step: int) -> str:
    return (
        f"In a data-parallel run cockpit needs info['batch_size'] (the "
        f"number of samples of this process) at step {step} to weight the "
        f"processes' shards. Fix: pass it as cockpit({step}, "
        "info={'batch_size': x.shape[0], ...}), or "
        "Cockpit(..., process_group=None) for rank-local values."
    )


def _unsynchronised(step: int, low: float, high: float) -> str:
    return (
        f"cockpit at step {step}: the gradients differ across "
        f"processes (checksums from {low:.6g} to {high:.6g}), so the "
        "parameters are not trained data-parallel. Fix: wrap the model in "
        "torch.nn.parallel.DistributedDataParallel (a step tracked inside "
        "its no_sync() needs `with cockpit(step, info=..., no_sync=True)`), "
        "or pass Cockpit(..., process_group=None) for values of each "
        "process's own shard."
    )


@register_feature
class DataParallel(StepFeature):
    """Join the processes' shards (only in a run with a communicator)."""

    order = 60

    def __init__(self, state):
        super().__init__(state)
        self.comm = state.communicator
        #: Whether the step is tracked (else the feature only checks the others).
        self.tracked = bool(state.plan.active)
        #: ``.grad`` is this process's own gradient (inside DDP's ``no_sync()``).
        self.no_sync = bool(state.no_sync and not self.comm.local)
        self._captured: dict[int, Tensor] = {}
        self._hooks: list = []
        #: Whether this process did its share of the step's collectives.
        self.done = not self.tracked
        #: The step's collective state (:class:`cockpit.distributed.StepComm`).
        self.shared = None

    only_if = ("communicator",)

    @classmethod
    def applies(cls, state) -> bool:
        """Whether the feature has work at this step (in a run with a communicator).

        Every step of a data-parallel run (an untracked one checks that no other
        process tracks it); the tracked steps of a rank-local one.
        """
        return bool(state.plan.active) or not state.communicator.local

    def begin(self) -> Produced | None:
        """Send the step's header (a tracked step), or check no other tracks it."""
        state = self.state
        if not self.tracked:  # did another process track this step?
            self.comm.untracked(state.step)
            return None
        channels = self._unit_channels()
        try:
            self.shared = self._exchange_header(channels)
        except BaseException as error:  # e.g. no batch_size: the others must know
            self.comm.left(state.step, error)
            raise
        if channels and not self.comm.stopping:  # (a stopping step sends nothing)
            self.shared.unit_sums = UnitSums(self.shared, self.comm.sharding, channels)
        return Produced(comm=self.shared)

    def _unit_channels(self) -> list[str]:
        """FSDP2: the channels of the elementwise sums sent unit by unit.

        One per sum a shard-local quantity names in ``sums_in_backward``
        (TICDiag's two; MeanGSNR's and EarlyStopping's ``sum_i g_i^2``, one
        common channel for both, ``Quantity.common_sums``); they are part of the step's
        plan in the header, so the processes' collectives inside the backward
        pass agree.
        """
        state = self.state
        if self.comm.sharding is None:
            return []
        return sorted(
            {
                q.channel(name)
                for q in state.plan.active
                if q.shard_local and not state.ledger.out(q)
                for name in getattr(q, "sums_in_backward", ())
            }
        )

    def _exchange_header(self, channels=()) -> distributed.StepComm:
        """Send the step, this shard's size and the plan to the other processes."""
        state = self.state
        info, step = state.info, state.step
        if info.has("batch_size"):
            n_local = int(info.get("batch_size"))
        elif isinstance(info.get("individual_losses"), Tensor):
            n_local = int(info.get("individual_losses").shape[0])
        else:
            raise KeyError(_missing_batch_size(step))
        plan_text = ";".join(
            f"{q.key}:{sorted(n.name for n in state.plan.needs_of(q))}"
            for q in state.plan.active
        )
        plan_text += f";no_sync={self.no_sync}"  # the joined gradient's collective
        if channels:  # (sent unit by unit in the backward pass)
            plan_text += f";unit_sums={','.join(sorted(channels))}"
        return distributed.start_header(self.comm, step, n_local, plan_text)

    def before_backward(self) -> Produced | None:
        """Hessian-vector products from this shard's graph; catch local gradients.

        (Nothing at an untracked step.)

        DDP cannot run ``backward(create_graph=True)``, and the user's backward
        pass frees the forward graph: the quantities tracked after the cleanup
        (HessMaxEV) are computed here, from this shard's gradient with its graph.
        With shards of different sizes, or inside ``no_sync()``, each parameter's
        local gradient is caught on its way to DDP, to be joined afterwards.
        """
        if not self.tracked or self.comm.stopping:  # (stops after the backward)
            return None
        state = self.state
        shared, step, params = self.shared, state.step, state.params
        last = [q for q in state.plan.last if not state.ledger.out(q)]
        early: dict[int, tuple] = {}
        if state.plan.create_graph and last:
            loss = state.info.require("loss", "cockpit (Hessian-vector products)")
            # FSDP2: with respect to the unsharded parameters, every unit unsharded
            with derivatives(state) as wrt, state.engine.quiet():
                ctx = TrackContext(step, wrt, state.info, comm=shared)
                grads = torch.autograd.grad(
                    loss, wrt, create_graph=True, allow_unused=True
                )
                shared.graph_gradients = [
                    g if g is not None else torch.zeros_like(p)
                    for g, p in zip(grads, wrt, strict=True)
                ]
                grads = None
                for quantity in last:
                    try:
                        early[id(quantity)] = (quantity.track_step(step, ctx), None)
                    except Exception as error:  # handled where it is recorded
                        early[id(quantity)] = (None, error)
                shared.graph_gradients = None  # frees the double-backward graph
        if self.comm.local or self.no_sync or not shared.settled or shared.uneven:
            # FSDP2: the unsharded tensors carry the shard's gradient (the
            # DTensors get only FSDP's reduce-scattered rows)
            sharding = self.comm.sharding
            hooked = params if sharding is None else sharding.engine_params()
            for index, param in enumerate(hooked):
                self._hooks.append(param.register_hook(self._catcher(index)))
        if shared.unit_sums is not None:  # (after cockpit's own backward passes)
            shared.unit_sums.arm()
        return Produced(early=tuple(early.items())) if early else None

    def _catcher(self, index: int):
        """A hook that keeps parameter ``index``'s local gradient where needed.

        Until the header has arrived with equal shard sizes, gradients are kept
        (the backward pass goes on while it travels); they are dropped if the
        shards turn out even.
        """
        shared = self.shared
        always = self.comm.local or self.no_sync

        def catch(grad):
            if always or not shared.known_even():
                self._captured[index] = grad.detach().clone()

        return catch

    def after_backward(self, produced) -> Produced:
        """Combine the processes: the joined batch's gradient, info and sums."""
        state = self.state
        shared, info, step, params = self.shared, state.info, state.step, state.params
        self._unhook()
        self.comm.after_backward()  # a conflict found at the start stops here
        shared.settle()
        if shared.unit_sums is not None:  # the units FSDP left; a failure kept
            shared.unit_sums.finish()
        if shared.uneven:
            state.checks.warn_once(
                "uneven-shards", distributed.uneven_message(shared.counts, step)
            )
        sharding = self.comm.sharding
        rows = None
        if sharding is not None:  # FSDP2: each process's rows; joined where needed
            params, rows, info = self._shard_local(sharding, shared, params, info)
        elif self.comm.local:  # .grad is DDP's average: the shard's own
            shared.gradients = [
                self._captured.get(i, torch.zeros_like(p)) for i, p in enumerate(params)
            ]
        elif shared.uneven or self.no_sync:  # .grad is not the joined gradient
            local = [self._captured.get(i) for i in range(len(params))]
            shared.gradients = distributed.joined_gradients(shared, local, params)
        else:
            shared.gradients = gradients(params)
        self._captured.clear()
        if not (self.comm.local or self.no_sync or sharding) and not getattr(
            self.comm, "checked_gradients", False
        ):  # inside no_sync() the processes' .grad differ by design
            self._check_synchronised(shared)
        ctx = TrackContext(
            step, params, info, comm=shared, grads=shared.gradients, rows=rows
        )
        bucket = distributed.Bucket(shared)
        joined = dict(info.values)
        if info.has("loss"):
            loss = info.get("loss")
            loss = loss.detach() if isinstance(loss, Tensor) else torch.tensor(loss)
            n = shared.n_global
            bucket.sum(loss * shared.n_local, lambda v: joined.update(loss=v / n))
        losses = info.get("individual_losses")
        if isinstance(losses, Tensor) and losses.shape[:1] == (shared.n_local,):
            per_sample = sample_losses(losses.detach())
            bucket.gather(per_sample, lambda v: joined.update(individual_losses=v))
        joined["batch_size"] = shared.n_global
        for quantity in state.plan.active:
            if state.ledger.out(quantity):
                continue
            if quantity.share(step, ctx, bucket) is NotImplemented:
                state.checks.warn_once(
                    ("rank-local", quantity.key),
                    distributed.rank_local_message(quantity.key),
                )
        for served, traces in produced.estimates:  # each estimate's own draws
            served = [q for q in served if not state.ledger.out(q)]
            if served:
                bucket.sum(
                    traces * shared.weight,
                    lambda total, served=served: self._errors(served, total),
                )
        bucket.reduce()
        self.done = True  # this process's collectives of the step are over
        return Produced(context=replace(ctx, info=StepInfo(step, joined)))

    def _shard_local(self, sharding, shared, params, info):
        """FSDP2: this process's rows, and the full tensors only where needed.

        The shard-local quantities (``shard_local``) read this process's rows of
        the parameters and of the joined gradient (:class:`Rows`, no
        communication); only where a quantity of the step is not one are the
        full parameters and gradient joined on every process (:meth:`_joined`),
        with an optimizer over them. With shards of different sizes (or inside
        ``no_sync``) ``.grad`` is not the joined batch's gradient: it is joined
        from each process's own and its rows taken.

        Returns:
            ``(params, rows, info)`` for the quantities' context.
        """
        state, step = self.state, shared.global_step
        optimizer = info.get("optimizer")
        joined = (
            shared.uneven
            or self.no_sync
            or any(
                not getattr(q, "shard_local", False)
                for q in state.plan.active
                if not state.ledger.out(q)
            )
        )
        if joined:
            params, shared.gradients = self._joined(sharding, shared, params)
        rows = Rows(sharding, self.comm, step, optimizer=optimizer)
        if shared.uneven or self.no_sync:  # the joined gradient's rows
            rows.grads = [
                upcast(rows.take(i, g)) for i, g in enumerate(shared.gradients)
            ]
        if (  # (an optimizer that cannot be rebuilt: its readers are left out)
            joined
            and isinstance(optimizer, torch.optim.Optimizer)
            and sharding.optimizer_unbuildable(optimizer) is None
        ):
            # the optimizer over the full parameters, its state joined for a replay
            replays = any(
                Need.OPTIMIZER_UPDATE in state.plan.needs_of(q)
                for q in state.plan.active
                if not state.ledger.out(q) and not getattr(q, "shard_local", False)
            )
            optimizer = sharding.full_optimizer(
                self.comm, optimizer, params, step, state=replays
            )
            # the shard's info, but the optimizer over the full parameters
            info = StepInfo(step, {**info.values, "optimizer": optimizer})
        return params, rows, info

    def _joined(self, sharding, shared, params):
        """FSDP2: each process's rows of the parameters and joined gradient, joined.

        Two all-reduces of ``D`` numbers in the parameters' dtype
        (:meth:`Sharding.gather`), one for the parameters, one for the gradient:
        the full tensors are views of their vector, and a quantity that keeps the
        gradient to the next step keeps ``D`` numbers, not ``2 D``. With shards of
        different sizes (or inside ``no_sync``) the joined gradient is formed from
        each process's own gradient, caught at the unsharded tensors.
        """
        step = shared.global_step
        grads = [p.grad for p in params]
        full_params = sharding.gather(self.comm, params, "the parameters' shards", step)
        full_grads = sharding.gather(self.comm, grads, "the gradient's shards", step)
        for param, grad, given in zip(full_params, full_grads, grads, strict=True):
            param.grad = None if given is None else grad  # what the optimizer sees
        if shared.uneven or self.no_sync:
            local = [self._captured.get(i) for i in range(len(params))]
            full_grads = distributed.joined_gradients(shared, local, full_params)
        return full_params, full_grads

    def _errors(self, quantities, total: Tensor) -> None:
        """The standard errors of the joined batch's estimate, for its quantities."""
        errors = (trace_errors(total), sum_error(total))
        for quantity in quantities:
            self.state.ledger.set_errors(quantity, errors)
            quantity.probe_traces(total)

    def _check_synchronised(self, shared: distributed.StepComm) -> None:
        """At the first tracked step: are the gradients the same on every process?

        Raises:
            DistributedError: On every process, naming both fixes.
        """
        checksum = torch.stack(
            [g.detach().to(torch.float64).sum() for g in shared.gradients]
        ).sum()
        pair = torch.stack([checksum, -checksum])
        largest = self.comm.all_reduce(
            pair, "comparing gradients", shared.global_step, op="max"
        )
        self.comm.checked_gradients = True
        high, low = float(largest[0]), -float(largest[1])
        if abs(high - low) > 1e-6 * max(1.0, abs(high), abs(low)):
            raise distributed.DistributedError(
                _unsynchronised(shared.global_step, low, high)
            )

    def _unhook(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        if self.shared is not None and self.shared.unit_sums is not None:
            self.shared.unit_sums.disarm()

    def close(self) -> None:
        """Remove what the feature hooked; say so if the step ends half-way.

        A tracked step that ends before this process's collectives (an error in
        the backward pass or in cockpit) leaves the others waiting: they are told
        at once, with the error, instead of waiting for the timeout.
        """
        self._unhook()
        if not self.done:
            self.done = True
            self.comm.left(self.state.step, sys.exc_info()[1])
