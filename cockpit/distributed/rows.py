"""This process's rows of a ``fully_shard`` model: what quantities read shard-locally.

After an FSDP2 backward pass each process holds its rows of every parameter and of
the joined batch's gradient (FSDP's reduce-scattered ``.grad``): sums over the
elements of the parameters or of the gradient (a norm, ``||g||^2``, a distance)
are then each process's partial sum over its rows, added to the step's bucket and
summed over the processes; no process forms the full parameters or gradient of the
model. Where a quantity needs one parameter's full tensor (the per-sample
gradients, formed on the unsharded module, projected onto the gradient or the
optimizer's step), :meth:`Rows.full` joins that one parameter, for the time of the
product: never more than FSDP itself gathers for a unit.

A quantity that computes shard-locally says so (``shard_local = True``, see
:class:`cockpit.quantities.base.Quantity`) and reads ``ctx.rows``; where a
quantity of the step does not, the cockpit joins the shards for it as before
(:meth:`cockpit.distributed.sharded.Sharding.gather`).

What a shard-local quantity keeps across steps (Distance's first parameters,
UpdateSize's and Alpha's start) is this process's rows, marked with
:attr:`Rows.owner`: loaded on another process (every rank loading rank 0's
checkpoint), it is recognised as foreign and the value is recorded missing with
the fix, on every process alike.
"""

from __future__ import annotations

import copy
from typing import Sequence

import torch
from torch import Tensor

from cockpit.precision import compute_dtype, upcast
from cockpit.quantities.optim import rebuilt_over


def is_foreign(owner, rows: Rows | None) -> bool:
    """Whether state kept with ``owner`` cannot be read as this step's rows."""
    if rows is None:
        return owner is not None  # rows of an FSDP run, read without FSDP
    return owner != rows.owner


def foreign_reason(key: str) -> str:
    """Why a value kept as another process's rows is missing, and the fix."""
    return (
        f"{key} keeps each process's rows of a fully_shard model's parameters "
        "across steps, and the state a process loaded holds another process's "
        "rows (or those of another layout). Fix: have each process save and load "
        "its own cockpit state (Cockpit.state_dict() on every rank)"
    )


class Rows:
    """This process's rows of the parameters and of the joined batch's gradient.

    Args:
        sharding: The layout (:class:`cockpit.distributed.sharded.Sharding`).
        communicator: cockpit's collectives.
        step: The step (for messages).
        grads: The joined gradient's rows where ``.grad`` does not hold them
            (shards of different sizes, ``no_sync``); by default ``.grad``'s.
        optimizer: The step's optimizer (``info["optimizer"]``), if any.

    Attributes:
        params: Each parameter's rows (``[rows, ...]``, detached; no rows: an
            empty tensor).
        grads: Each parameter's rows of the joined gradient (half precision as
            float32, as :func:`cockpit.quantities.utils_params.gradients`).
        owner: Names this process's rows in this layout (the same string on a
            restart with the same processes and model).
    """

    def __init__(self, sharding, communicator, step: int, grads=None, optimizer=None):
        from cockpit.distributed.sharded import local

        self.sharding, self.communicator, self.step = sharding, communicator, step
        self.params = [local(p).detach() for p in sharding.params]
        #: Each parameter's rows of ``.grad``: what ``optimizer.step()`` will
        #: see (with shards of different sizes not the joined batch's gradient).
        self.steps = [
            upcast(local(p.grad).detach())
            if p.grad is not None
            else torch.zeros_like(r, dtype=compute_dtype(r.dtype))
            for p, r in zip(sharding.params, self.params, strict=True)
        ]
        self.grads = list(grads) if grads is not None else self.steps
        #: The parameters' device (where the partial sums are made).
        self.device = self.params[0].device if self.params else torch.device("cpu")
        self.owner = f"rank {communicator.rank} of {communicator.size}, " + (
            sharding.digest()
        )
        self._optimizer = optimizer
        self._rows_optimizer = None
        self._projections: dict[int, list[tuple[Tensor, Tensor]]] = {}

    def take(self, index: int, full: Tensor) -> Tensor:
        """This process's rows of parameter ``index``'s full tensor ``full``."""
        param, shard = self.sharding.params[index], self.sharding.shards[index]
        start, stop = shard.elements(param)
        return full.reshape(-1)[start:stop].reshape(self.params[index].shape)

    def full(self, index: int, rows: Tensor) -> Tensor:
        """Parameter ``index``'s full tensor from every process's ``rows`` of it.

        One SUM all-reduce of that parameter's size (each element one process's
        value plus zeros: exact), in ``rows``' dtype.
        """
        param, shard = self.sharding.params[index], self.sharding.shards[index]
        flat = rows.new_zeros(param.numel())
        start, stop = shard.elements(param)
        flat[start:stop] = rows.reshape(-1)
        what = f"the rows of parameter {index}"
        return self.communicator.all_reduce(flat, what, self.step).reshape(param.shape)

    def project(self, index: int, individual, rows: Tensor) -> Tensor:
        """``g_i . v`` for parameter ``index``'s kept per-sample gradients ``g_i``.

        ``v`` is the full tensor of ``rows`` (:meth:`full`, freed after the
        product). The projection onto the same rows tensor (the gradient tests'
        and Alpha's SGD direction, both the gradient's rows) is formed once.
        ``individual`` ``None`` (this process's hooks did not see the
        parameter): the vector is joined all the same, as on the processes that
        did see it, and ``None`` returned.
        """
        if individual is None:
            self.full(index, rows)
            return None
        kept = self._projections.setdefault(index, [])
        for seen, dots in kept:
            if seen is rows:
                return dots
        dots = individual.project(self.full(index, rows)).detach()
        kept.append((rows, dots))
        return dots

    @property
    def optimizer(self):
        """The step's optimizer over :attr:`params`, its state's rows (or ``None``).

        An optimizer of the same class and groups that never steps: its learning
        rates are read by parameter and its update replayed on the rows (Alpha);
        each ``DTensor`` entry of the state is this process's rows of it (FSDP
        shards torch.optim's state like the parameters), the rest copied.
        """
        if self._rows_optimizer is None and isinstance(
            self._optimizer, torch.optim.Optimizer
        ):
            self._rows_optimizer = over_rows(
                self._optimizer, self.sharding, self.params
            )
        return self._rows_optimizer


def over_rows(optimizer, sharding, rows: Sequence[Tensor]):
    """An optimizer like ``optimizer`` over each parameter's ``rows``.

    ``None`` where it holds none of them.
    """
    from cockpit.distributed.sharded import is_dtensor, local

    twin = rebuilt_over(optimizer, sharding.params, rows)
    if twin is None:
        return None
    for param, row in zip(sharding.params, rows, strict=True):
        state = optimizer.state.get(param)
        if state:
            twin.state[row] = {
                k: local(v) if is_dtensor(v) else copy.deepcopy(v)
                for k, v in state.items()
            }
    return twin


def squared_norms(tensors: Sequence[Tensor]) -> Tensor:
    """``||t||^2`` of each tensor, stacked, in float64 (partial sums over rows)."""
    if not tensors:
        return torch.zeros(0, dtype=torch.float64)
    return torch.stack([(t.detach().to(torch.float64) ** 2).sum() for t in tensors])
