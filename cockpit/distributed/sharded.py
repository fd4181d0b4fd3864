"""Sharded parameters (``DTensor``): FSDP2's ``fully_shard`` served, the rest refused.

FSDP2 (``torch.distributed.fsdp.fully_shard``) replaces each parameter by a
``DTensor`` sharded along its first dimension over a one-dimensional device mesh
(each process owns a block of rows). Inside a unit's forward and backward pass the
module holds the *unsharded* parameter instead, a plain tensor of the full shape
that FSDP all-gathers (and frees again when it reshards); the gradient it
accumulates there is reduce-scattered into the sharded parameter's ``.grad`` (a
``DTensor`` with the process's rows of the joined gradient).

:func:`sharding` finds that layout when the Cockpit is made. A :class:`Sharding`

* gives the engines the unsharded parameters (the tensors the modules use in the
  forward and backward pass, where per-sample results are formed on this process's
  samples, as in DDP), found by unsharding each unit once when the Cockpit is made;
* joins the shards after the backward pass where a quantity needs the full
  tensors (:meth:`Sharding.gather`; the shard-local ones read each process's rows,
  :mod:`cockpit.distributed.rows`): each process puts its rows of the parameters
  (and, in a second vector, of the joined gradient) into a vector of the full size
  in their dtype, summed over the processes in cockpit's own group;
* names the layout for the set-up fingerprint (:meth:`Sharding.layout`);
* unshards every unit for cockpit's own second derivatives before the user's
  backward pass (:meth:`Sharding.unsharded`), and holds the eigensolvers' vectors
  as each process's rows (:class:`Pieces`).

Every other ``DTensor`` layout (tensor parallel, a mesh of two or more dimensions
such as HSDP, a shard on another dimension, parameters FSDP does not manage next to
ones it does) is refused with a ``ValueError`` on every process when the Cockpit is
made: no process reaches a step, so no process waits for another.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import hashlib
import sys
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import Tensor

from cockpit.quantities.optim import rebuilt, rebuilt_over

#: What a refusal says to do.
FIX = (
    "Fix: wrap the model with torch.distributed.fsdp.fully_shard on a "
    "one-dimensional mesh over the Cockpit's process group (the default "
    "shard_placement_fn, Shard(0)), or give the Cockpit only plain parameters "
    "(DDP, or one process); see docs/distributed.md."
)


def is_dtensor(tensor: Any) -> bool:
    """Whether ``tensor`` is a ``torch.distributed.tensor.DTensor``.

    Without that module imported no tensor can be one; importing it (with sympy)
    takes over a second, which a process that never shards must not pay.
    """
    module = sys.modules.get("torch.distributed.tensor")
    dtensor = getattr(module, "DTensor", None)
    return dtensor is not None and isinstance(tensor, dtensor)


def local(tensor: Tensor) -> Tensor:
    """The process's own part of ``tensor`` (itself unless a ``DTensor``)."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


def _fsdp_params() -> dict[int, Any]:
    """``id(sharded parameter)`` -> FSDP2's record of it, for every FSDP2 module."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover
        return {}
    found: dict[int, Any] = {}
    for obj in gc.get_objects():
        if issubclass(type(obj), FSDPModule):
            state = obj._get_fsdp_state()
            for group in getattr(state, "_fsdp_param_groups", None) or []:
                for record in group.fsdp_params:
                    found[id(record.sharded_param)] = (obj, record)
    return found


def _describe(param: Tensor) -> str:
    placements = ", ".join(str(p) for p in param.placements)
    mesh = tuple(param.device_mesh.shape)
    return f"placements ({placements}) on a device mesh of shape {mesh}"


def _refuse(label: str, what: str) -> ValueError:
    return ValueError(
        f"cockpit cannot serve {label}: {what}. It serves FSDP2's fully_shard "
        f"layout (Shard(0) over a one-dimensional mesh). {FIX}"
    )


def row_size(param: Tensor) -> int:
    """The elements of one row of ``param`` (its first dimension; 1 for a scalar)."""
    return param.numel() // max(1, param.shape[0]) if param.dim() else 1


@dataclass
class _Shard:
    """One sharded parameter: its FSDP record and where its rows sit."""

    module: Any
    record: Any
    offset: int  # first row this process owns
    rows: int  # rows this process owns

    def elements(self, param: Tensor) -> tuple[int, int]:
        """Where this process's rows sit in ``param`` flattened: ``(start, stop)``."""
        row = row_size(param)
        return self.offset * row, (self.offset + self.rows) * row


class Sharding:
    """The FSDP2 layout of the cockpit's parameters (see the module).

    Args:
        params: The cockpit's parameters (``DTensor``).
        shards: Their FSDP records and row ranges.
        ranks: The mesh's global ranks, in mesh order.
    """

    def __init__(self, params: Sequence[Tensor], shards: list[_Shard], ranks):
        self.params = list(params)
        self.shards = shards
        self.ranks = list(ranks)
        self._engine_params: list[Tensor] | None = None
        self._digest: str | None = None

    def row_spans(self, index: int) -> list[tuple[int, int]]:
        """Which rows of parameter ``index`` each process holds: ``(start, stop)``.

        In mesh order, by DTensor's rule for ``Shard(0)`` (the first processes
        hold ``ceil(rows / processes)`` rows each, the last ones fewer or none).
        """
        from torch.distributed.tensor import Shard

        param, processes = self.params[index], len(self.ranks)
        rows = param.shape[0] if param.dim() else 0
        spans = []
        for rank in range(processes):
            size, offset = Shard.local_shard_size_and_offset(rows, processes, rank)
            spans.append((offset, offset + size))
        return spans

    def digest(self) -> str:
        """A short hash of :meth:`layout` (made once)."""
        if self._digest is None:
            self._digest = hashlib.sha256(self.layout().encode()).hexdigest()[:16]
        return self._digest

    def layout(self) -> str:
        """The layout for the set-up fingerprint: the same on every process.

        Full shapes, placements, the mesh's shape and processes (each process's
        rows follow from them).
        """
        rows = ";".join(f"{tuple(p.shape)}:{_describe(p)}" for p in self.params)
        return f"{rows};mesh={self.ranks}"

    def engine_params(self) -> list[Tensor]:
        """The unsharded parameters the modules use in the forward/backward pass.

        FSDP makes them at a unit's first all-gather and keeps the same tensors
        (it frees and refills their storage); units not yet run are unsharded and
        resharded once here (one all-gather of each such unit, on FSDP's group,
        while every process makes its Cockpit).
        """
        if self._engine_params is None:
            todo = {}
            for shard in self.shards:
                if not hasattr(shard.record, "_unsharded_param"):
                    todo[id(shard.module)] = shard.module
            for module in todo.values():
                module.unshard()
            for module in todo.values():
                module.reshard()
            self._engine_params = [s.record._unsharded_param for s in self.shards]
        return self._engine_params

    @contextlib.contextmanager
    def unsharded(self):
        """Every unit unsharded, and kept so through cockpit's own backward passes.

        For second derivatives (Hessian-vector products, Hutchinson's probes):
        ``torch.autograd.grad(..., create_graph=True)`` with respect to the
        unsharded parameters differentiates this process's loss through the
        forward graph, whose saved tensors are those parameters; a unit FSDP
        reshards at the end of one of these passes would leave the next reading
        freed storage. Inside, each unit's ``reshard_after_backward`` is off
        (FSDP's hooks still run in these passes; with no ``.grad`` accumulated
        they reduce nothing); afterwards it is what it was, and the units stay
        unsharded until the user's backward pass reshards them as usual. Costs
        one all-gather per unit that was sharded, and every unit's full
        parameters on each process meanwhile.

        Every unit of the model, not only those holding the cockpit's parameters:
        the graph of the gradient reads a frozen unit's weights too (the loss
        depends on earlier units through them).

        Yields:
            The unsharded parameters (:meth:`engine_params`).
        """
        states = self._states()
        groups = [group for state in states for group in state._fsdp_param_groups]
        saved = [group.reshard_after_backward for group in groups]
        for group in groups:
            group.reshard_after_backward = False
        try:
            for state in states:
                if state._fsdp_param_groups:
                    state._modules[0].unshard()  # (the state's FSDPModule)
            yield self.engine_params()
        finally:
            for group, flag in zip(groups, saved, strict=True):
                group.reshard_after_backward = flag

    def _states(self) -> list:
        """FSDP2's state of every unit of the model(s) the parameters are in.

        After the first forward pass the root's context lists every state of
        its tree; before it, each unit's own.
        """
        found: dict[int, Any] = {}
        for shard in self.shards:
            state = shard.module._get_fsdp_state()
            for other in getattr(state._state_ctx, "all_states", None) or [state]:
                found.setdefault(id(other), other)
            found.setdefault(id(state), state)
        return list(found.values())

    def remap(self, owners: dict[int, list]) -> dict[int, list]:
        """The owners of the sharded parameters, keyed by the unsharded ones."""
        out = dict(owners)
        for param, unsharded in zip(self.params, self.engine_params(), strict=True):
            out[id(unsharded)] = owners.get(id(param), [])
        return out

    def full_optimizer(
        self, communicator, optimizer, full_params: Sequence[Tensor], step, state: bool
    ):
        """An optimizer like ``optimizer`` over the full parameters; it never steps.

        For the quantities that read learning rates by parameter (CABS, Alpha's
        plain SGD step) and, with ``state``, those that replay the update (Alpha
        with momentum, Adam, ...): each parameter's sharded state (``DTensor``
        entries such as ``momentum_buffer``, ``exp_avg``; checked by
        :meth:`state_unsharded`) is joined in one all-reduce like the parameters
        (:meth:`gather`), the rest (a step count) copied. Parameters it does not
        hold stay out.
        """
        twin = rebuilt_over(optimizer, self.params, full_params)
        if twin is None:
            return optimizer
        if not state:
            return twin
        states = [optimizer.state.get(p) or {} for p in self.params]
        keys = sorted({k for s in states for k, v in s.items() if is_dtensor(v)})
        sharded = [
            s.get(k) if is_dtensor(s.get(k)) else None for k in keys for s in states
        ]
        joined = self.gather(
            communicator, sharded, "the optimizer state's shards", step
        )
        count = len(self.params)
        for j, (own, full) in enumerate(zip(states, full_params, strict=True)):
            if own:
                twin.state[full] = {
                    k: joined[keys.index(k) * count + j].to(v.dtype)
                    if is_dtensor(v)
                    else copy.deepcopy(v)
                    for k, v in own.items()
                }
        return twin

    def optimizer_unbuildable(self, optimizer) -> str | None:
        """Why no optimizer like ``optimizer`` can be made over the full tensors.

        Tried on one small tensor per parameter group when the step opens, so
        that the quantities reading the optimizer are left out before any work.
        """
        like = local(self.params[0])
        try:
            probe = [
                {**group, "params": [like.new_zeros(1).requires_grad_()]}
                for group in optimizer.param_groups
            ]
            rebuilt(optimizer, probe)
        except Exception as error:  # any constructor's refusal
            return (
                f"cockpit could not make a {type(optimizer).__name__} over copies "
                f"of the parameters ({type(error).__name__}: {error})"
            )
        return None

    def state_unsharded(self, optimizer) -> str | None:
        """Why the optimizer's state cannot be joined like the parameters, if so.

        Each ``DTensor`` entry must be sharded as its parameter (its full shape and
        placements); metadata only, no communication.
        """
        for index, param in enumerate(self.params):
            for key, value in (optimizer.state.get(param) or {}).items():
                if not is_dtensor(value):
                    continue
                same = tuple(value.shape) == tuple(param.shape) and tuple(
                    value.placements
                ) == tuple(param.placements)
                if not same:
                    return (
                        f"its state {key!r} of parameter {index} is a DTensor of shape "
                        f"{tuple(value.shape)} placed {value.placements}, not "
                        f"sharded like the parameter ({tuple(param.shape)}, "
                        f"{param.placements})"
                    )
        return None

    def gather(self, communicator, tensors: Sequence[Tensor | None], what: str, step):
        """The full tensors of ``tensors`` (each a ``DTensor`` like a parameter).

        One SUM all-reduce of a vector of all their elements: each process fills
        its own rows (``None``: zeros), so every element is one process's value
        plus zeros, exact in any floating dtype. The vector has the tensors'
        common dtype (at least float32: 16-bit floats are joined in float32) and
        is made on the parameters' device (the communicator moves it where its
        backend reduces); the full tensors returned (in their parameter's dtype)
        are views of it where that is its dtype.
        """
        sizes = [p.numel() for p in self.params]
        groups = len(tensors) // len(self.params)
        device = local(self.params[0]).device
        given = [local(t).dtype for t in tensors if t is not None]
        dtype = _joined_dtype(given or [local(p).dtype for p in self.params])
        flat = torch.zeros(sum(sizes) * groups, dtype=dtype, device=device)
        position = 0
        for k, tensor in enumerate(tensors):
            j = k % len(self.params)
            param, shard = self.params[j], self.shards[j]
            if tensor is not None and shard.rows:
                start = position + shard.elements(param)[0]
                piece = local(tensor).detach().reshape(-1)
                flat[start : start + piece.numel()] = piece
            position += sizes[j]
        total = communicator.all_reduce(flat, what, step)
        out, position = [], 0
        for k in range(len(tensors)):
            param = self.params[k % len(self.params)]
            piece = total[position : position + param.numel()].reshape(param.shape)
            out.append(piece.to(local(param).device, param.dtype))
            position += param.numel()
        return out


def _joined_dtype(dtypes) -> torch.dtype:
    """The common floating dtype of ``dtypes``, at least float32."""
    dtype = torch.float32
    for other in dtypes:
        dtype = torch.promote_types(dtype, other)
    return dtype


class Pieces:
    """Flat vectors over the parameters, each process holding its rows (FSDP2).

    A vector of all parameters' elements (in the cockpit's order) is held as this
    process's piece: its rows of each parameter, as FSDP shards them, one after
    the other. The eigensolvers keep their vectors so
    (:func:`cockpit.curvature.lanczos.lanczos_max_ev` with :meth:`total`): each
    process holds ``1 / processes`` of the Lanczos basis.

    Args:
        sharding: The layout.
        communicator: cockpit's collectives.
        step: The step (for messages).
    """

    def __init__(self, sharding: Sharding, communicator, step: int):
        self.communicator, self.step = communicator, step
        self.ranges: list[tuple[int, int]] = []
        position = 0
        for param, shard in zip(sharding.params, sharding.shards, strict=True):
            if shard.rows:
                start, stop = shard.elements(param)
                self.ranges.append((position + start, position + stop))
            position += param.numel()
        #: The whole vectors' size.
        self.dim = position
        #: How many processes hold pieces.
        self.processes = int(communicator.size)

    def take(self, full: Tensor) -> Tensor:
        """This process's piece of a whole vector (a new tensor)."""
        if not self.ranges:
            return full[:0].clone()
        return torch.cat([full[a:b] for a, b in self.ranges])

    def join(self, piece: Tensor, what: str) -> Tensor:
        """The whole vector of every process's piece (one SUM all-reduce)."""
        full = piece.new_zeros(self.dim)
        position = 0
        for a, b in self.ranges:
            full[a:b] = piece[position : position + b - a]
            position += b - a
        return self.communicator.all_reduce(full, what, self.step)

    def total(self, partial: Tensor) -> Tensor:
        """Partial inner products summed over the processes (one all-reduce)."""
        return self.communicator.all_reduce(
            partial, "an inner product of Lanczos vectors", self.step
        )


def sharding(params: Sequence[Tensor], labels: Sequence[str], group) -> Sharding | None:
    """The layout of ``params``, or ``None`` if none is a ``DTensor``.

    Args:
        params: The cockpit's parameters.
        labels: How to name each in a message.
        group: The data-parallel group the Cockpit reduces over (``None``: none).

    Raises:
        ValueError: For a layout cockpit cannot serve (named, with the fix).
    """
    sharded = [i for i, p in enumerate(params) if is_dtensor(p)]
    if not sharded:
        return None
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    records = _fsdp_params()
    plain = [i for i, p in enumerate(params) if not is_dtensor(p)]
    if plain:
        raise _refuse(
            labels[plain[0]],
            f"it is a plain tensor while {labels[sharded[0]]} is sharded "
            f"({_describe(params[sharded[0]])}); its gradient is not joined "
            "across the processes like the others'",
        )
    shards, mesh_ranks = [], None
    for i, param in enumerate(params):
        mesh = param.device_mesh
        if mesh.ndim != 1:
            raise _refuse(
                labels[i],
                f"{_describe(param)}: a mesh of {mesh.ndim} dimensions (e.g. HSDP "
                "or FSDP with tensor parallelism) is not built",
            )
        if id(param) not in records:
            raise _refuse(
                labels[i],
                f"a DTensor with {_describe(param)} that fully_shard does not "
                "manage (tensor parallelism or distribute_tensor): its forward "
                "pass computes on shards",
            )
        if tuple(param.placements) != (Shard(0),):
            raise _refuse(
                labels[i],
                f"{_describe(param)}: only shards along dimension 0 are built",
            )
        ranks = mesh.mesh.reshape(-1).tolist()
        if mesh_ranks is None:
            mesh_ranks = ranks
        elif ranks != mesh_ranks:
            raise _refuse(labels[i], "its mesh differs from the other parameters'")
        shape, offset = compute_local_shape_and_global_offset(
            param.shape, mesh, param.placements
        )
        module, record = records[id(param)]
        rows = shape[0] if param.dim() else 0
        shards.append(_Shard(module, record, offset[0] if param.dim() else 0, rows))
    import torch.distributed as dist

    if group is None:
        raise _refuse(
            "the sharded parameters",
            "the Cockpit has no data-parallel group to join their shards over (it "
            "was made before torch.distributed.init_process_group(), or with "
            "process_group=None); a sharded parameter has no rank-local value",
        )
    group_ranks = dist.get_process_group_ranks(group)
    if group_ranks != mesh_ranks:
        raise _refuse(
            "the sharded parameters",
            f"their mesh holds the processes {mesh_ranks}, but the Cockpit joins "
            f"the processes {group_ranks} (process_group=...); they must be the "
            "same processes in the same order",
        )
    return Sharding(params, shards, mesh_ranks)
