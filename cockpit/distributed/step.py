"""One tracked step of a data-parallel run: the header, the bucket, joined gradients.

A data-parallel step (:class:`StepComm`) starts a small header before the backward
pass and checks it before any other collective; the quantities put their partial
sums into one :class:`Bucket`, reduced together. The process group's collectives
and set-up checks are in :mod:`cockpit.distributed.process_group`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from cockpit.distributed.process_group import Communicator, PendingGather, _digest
from cockpit.distributed.sharded import Pieces, row_size
from cockpit.distributed.sync import DistributedError


@dataclass
class _Slot:
    """A tensor in the bucket and what to do with its reduced value."""

    tensor: Tensor
    then: Callable[[Tensor], None] | None
    value: Tensor | None = None
    index: int | None = None  # the parameter whose rows it is (``Bucket.rows``)
    #: ``(shape, dtype, device)`` of a slot of zeros (``tensor`` is ``None``)
    like: tuple | None = None


@dataclass
class _Piece:
    """Whole rows of one slot that go into one reduce-scatter (``Bucket._scatter``).

    ``spans``: per process, the rows of the parameter in this piece; ``row``: the
    elements of a row; ``width``: the largest process's elements in it;
    ``start``: where the piece starts in each process's rows; ``last``: the
    slot's last piece.
    """

    slot: _Slot
    spans: list[tuple[int, int]]
    row: int
    width: int
    start: int
    last: bool


class Bucket:
    """Partial sums of one step, reduced together in one collective (per operation).

    Quantities add tensors with :meth:`sum` (or :meth:`max`, :meth:`gather`) and get
    the global value back through ``then`` (or ``slot.value``) once
    :meth:`reduce` ran. Everything travels as float64, so counts stay exact.
    """

    def __init__(self, comm: StepComm):
        self.comm = comm
        self._slots: dict[str, list[_Slot]] = {"sum": [], "max": [], "rows": []}

    def sum(self, tensor: Tensor, then: Callable[[Tensor], None] | None = None):
        """Add ``tensor``: its sum over processes goes to ``then``."""
        slot = _Slot(torch.as_tensor(tensor), then)
        self._slots["sum"].append(slot)
        return slot

    def max(self, tensor: Tensor, then: Callable[[Tensor], None] | None = None):
        """Add ``tensor``: its elementwise maximum over processes goes to ``then``."""
        slot = _Slot(torch.as_tensor(tensor), then)
        self._slots["max"].append(slot)
        return slot

    def rows(
        self, tensor: Tensor, index: int, then: Callable[[Tensor], None] | None = None
    ):
        """Add a tensor shaped like parameter ``index`` (FSDP2): its rows, summed.

        ``then`` receives this process's rows of its sum over the processes. For
        elementwise sums (``sum_i g_i^2``, a curvature diagonal) that each
        process reduces on its rows: reduce-scatters of all such slots
        (:meth:`_scatter`), so no process receives a full sum. The bucket lets
        ``tensor`` go once it is sent: a caller that drops its own reference
        frees each sum as soon as it is on its way.
        """
        slot = _Slot(torch.as_tensor(tensor), then, index=index)
        self._slots["rows"].append(slot)
        return slot

    def zero_rows(
        self, index: int, dtype, device, then: Callable[[Tensor], None] | None = None
    ):
        """:meth:`rows` of zeros shaped like parameter ``index``, never allocated.

        For a process with no sum where the others have one (every process adds
        the same slots).
        """
        shape = tuple(self.comm.communicator.sharding.params[index].shape)
        slot = _Slot(None, then, index=index, like=(shape, dtype, device))
        self._slots["rows"].append(slot)
        return slot

    def gather(self, per_sample: Tensor, then: Callable[[Tensor], None] | None = None):
        """Add one value per local sample: all samples, in rank order, go to ``then``.

        The values go into this shard's slots of a zero vector over the global
        batch, summed over processes.
        """
        comm = self.comm
        per_sample = torch.as_tensor(per_sample).reshape(-1)
        if per_sample.numel() != comm.n_local:
            raise ValueError(
                f"Bucket.gather got {per_sample.numel()} values for a shard of "
                f"{comm.n_local} samples."
            )
        full = per_sample.new_zeros(comm.n_global)
        full[comm.offset : comm.offset + comm.n_local] = per_sample
        return self.sum(full, then)

    def reduce(self, what: str = "the step's sums") -> None:
        """All-reduce everything added (one collective per operation used).

        Every slot has its value before the first ``then`` runs, so a ``then``
        may read other slots of the same bucket. A ``then`` may add to the
        bucket again (a sum that needs another process's sum first, such as a
        shard-local sum over rows of a joined vector): those are reduced in a
        next round, until none is added (every process runs the same ``then``,
        so all make the same rounds).
        """
        comm = self.comm
        while any(self._slots.values()):
            rounds, self._slots = self._slots, {"sum": [], "max": [], "rows": []}
            for op, slots in rounds.items():
                if not slots:
                    continue
                if op == "rows":
                    self._scatter(slots, what)
                    continue
                device = slots[0].tensor.device
                flat = torch.cat(
                    [
                        s.tensor.detach().to(device, torch.float64).reshape(-1)
                        for s in slots
                    ]
                )
                total = comm.communicator.all_reduce(
                    flat, what, comm.global_step, op=op
                )
                position = 0
                for slot in slots:
                    size = slot.tensor.numel()
                    piece = total[position : position + size]
                    position += size
                    piece = piece.reshape(slot.tensor.shape)
                    slot.value = piece.to(slot.tensor.device, slot.tensor.dtype)
            for slots in rounds.values():
                for slot in slots:
                    if slot.then is not None:
                        slot.then(slot.value)

    def _scatter(self, slots: list[_Slot], what: str) -> None:
        """Reduce-scatter the ``rows`` slots: each process its rows of each sum.

        The slots are cut into pieces of whole rows (a parameter larger than
        :data:`SCATTER_ELEMENTS` float64 numbers over the processes into several)
        and consecutive pieces packed into one float64 vector of at most that
        many numbers: process ``q``'s block holds, for every piece, the elements
        of ``q``'s rows in it, padded to the largest process's. A slot's tensor
        is let go once its last piece is packed, so the sums not yet sent, one
        packed vector and the rows received are what the bucket holds.
        """
        comm = self.comm
        communicator = comm.communicator
        sharding = communicator.sharding
        if sharding is None:  # a plain tensor on every process: the whole sum
            for slot in slots:
                slot.value = communicator.all_reduce(
                    slot.tensor, what, comm.global_step
                )
            return
        processes, rank = len(sharding.ranks), communicator.rank
        pieces: list[_Piece] = []
        for slot in slots:
            spans = sharding.row_spans(slot.index)
            param = sharding.params[slot.index]
            row = row_size(param)
            most = max(b - a for a, b in spans)
            rows = max(1, SCATTER_ELEMENTS // (processes * row))
            first, stop = spans[rank]
            tensor = slot.tensor
            if tensor is None:  # zeros (``Bucket.zero_rows``): nothing to copy
                shape, dtype, device = slot.like
            else:
                shape, dtype, device = tensor.shape, tensor.dtype, tensor.device
                slot.tensor = tensor.detach().reshape(-1)  # (copied once, if at all)
            del tensor
            shape = (stop - first, *shape[1:])
            slot.value = torch.empty(shape, dtype=dtype, device=device)
            starts = range(0, most, rows) if most else [0]
            for start in starts:
                sub = [(min(a + start, b), min(a + start + rows, b)) for a, b in spans]
                width = min(rows, most - start) * row
                pieces.append(_Piece(slot, sub, row, width, start, start == starts[-1]))
        run: list[_Piece] = []
        size = 0
        for piece in pieces:
            if run and (size + piece.width) * processes > SCATTER_ELEMENTS:
                self._scatter_run(run, what)
                run, size = [], 0
            run.append(piece)
            size += piece.width
        if run:
            self._scatter_run(run, what)

    def _scatter_run(self, run: list[_Piece], what: str) -> None:
        """One reduce-scatter of a run of pieces (see :meth:`_scatter`)."""
        comm = self.comm
        communicator = comm.communicator
        block = sum(piece.width for piece in run)
        processes, rank = len(run[0].spans), communicator.rank
        device = run[0].slot.value.device
        flat = torch.zeros(processes * block, dtype=torch.float64, device=device)
        offset = 0  # where the piece starts in each process's block
        for piece in run:
            values, row = piece.slot.tensor, piece.row  # (flat; None: zeros)
            for q, (a, b) in enumerate(piece.spans if values is not None else ()):
                start = q * block + offset
                flat[start : start + (b - a) * row] = values[a * row : b * row]
            offset += piece.width
            del values
            if piece.last:  # (the slot's sum is let go)
                piece.slot.tensor = None
        if block:
            mine = communicator.reduce_scatter(flat, what, comm.global_step)
        else:  # (only empty rows)
            mine = flat
        del flat
        position = 0
        for piece in run:
            a, b = piece.spans[rank]
            count = (b - a) * piece.row  # (this process's rows of the piece)
            into = piece.start * piece.row
            value = piece.slot.value.reshape(-1)
            value[into : into + count] = mine[position : position + count]
            position += piece.width


#: The most float64 numbers one reduce-scatter of :meth:`Bucket.rows` packs (16 MiB).
SCATTER_ELEMENTS = 1 << 21


class StepComm:
    """One tracked step of a data-parallel run, as the quantities see it.

    The header (every process's step, shard size and plan) is gathered while the
    backward pass runs: :meth:`settle` waits for it and checks that the processes
    agree. ``n_local`` is known at once; ``counts``, ``n_global``, ``offset``,
    ``weight`` and ``uneven`` settle the header when first read.

    Attributes:
        communicator: The collectives.
        global_step: The step.
        n_local: This process's samples.
        counts: Samples per process, in rank order.
        n_global: All samples (the joined batch).
        offset: Where this process's samples start in the joined batch.
        weight: ``n_local / n_global``: this shard's share of a mean over the
            joined batch.
        uneven: Whether the shards differ in size.
        gradients: The joined batch's gradient per parameter (set after backward).
        graph_gradients: This shard's gradients with their autograd graph (for
            Hessian-vector products), where a quantity needs them.
    """

    def __init__(
        self,
        communicator: Communicator,
        global_step: int,
        counts: Sequence[int] | None = None,
        *,
        n_local: int | None = None,
        header: PendingGather | None = None,
    ):
        self.communicator = communicator
        self.global_step = global_step
        if counts is None and header is None:
            raise ValueError("StepComm needs the counts or a header in flight.")
        self._header = header
        self._error: DistributedError | None = None
        self._counts: list[int] | None = None
        if counts is not None:
            self._set_counts(counts)
        else:
            self.n_local = int(n_local)
        self.gradients: list[Tensor] | None = None
        self.graph_gradients: list[Tensor] | None = None
        #: FSDP2: the elementwise sums sent unit by unit during the backward pass
        #: (:class:`cockpit.distributed.unit_sums.UnitSums`), where a quantity
        #: forms them.
        self.unit_sums = None
        #: What several quantities of the step compute alike (e.g. the Gram
        #: tests' projections), computed and sent once: ``name -> result``.
        self.common: dict[str, Any] = {}

    def _set_counts(self, counts: Sequence[int]) -> None:
        self._counts = [int(c) for c in counts]
        rank = self.communicator.rank
        self.n_local = self._counts[rank]
        self._n_global = sum(self._counts)
        self._offset = sum(self._counts[:rank])

    @property
    def settled(self) -> bool:
        """Whether the header has been waited for (and agreed)."""
        return self._counts is not None

    def known_even(self) -> bool:
        """Whether the shards are known to be of one size, without waiting.

        ``False`` while the header is still on its way (or if it is bad).
        """
        if self._counts is None and (self._header is None or not self._header.ready()):
            return False
        try:
            return not self.uneven
        except DistributedError:
            return False

    def settle(self) -> StepComm:
        """Wait for the header and check it (once; later calls return at once).

        Raises:
            DistributedError: If processes are at different steps, plan different
                work or have an empty shard (on every process, every call).
        """
        if self._error is not None:
            raise self._error
        if self._counts is None:
            rows = self._header.wait()
            self._header = None
            try:
                self._set_counts(_check_header(rows, self.global_step))
            except DistributedError as error:
                self._error = error
                sync = getattr(self.communicator, "sync", None)
                if sync is not None:  # every process raises it: the run is broken
                    sync.stop(error)
                raise
        return self

    @property
    def counts(self) -> list[int]:
        """Samples per process, in rank order (settles the header)."""
        return list(self.settle()._counts)

    @property
    def n_global(self) -> int:
        """All samples of the step (the joined batch)."""
        return self.settle()._n_global

    @property
    def offset(self) -> int:
        """Where this process's samples start in the joined batch."""
        return self.settle()._offset

    @property
    def weight(self) -> float:
        """``n_local / n_global``: this shard's share of a joined mean."""
        n_global = self.n_global
        return self.n_local / n_global if n_global else 0.0

    @property
    def uneven(self) -> bool:
        """Whether the shards differ in size."""
        return len(set(self.counts)) > 1

    def projection(self, index: int, individual, vector: Tensor) -> Tensor:
        """``g_i . vector`` for parameter ``index``'s kept per-sample gradients.

        Computed once per step and parameter for equal vectors: with equal
        shards, the gradient tests' joined gradient and Alpha's SGD direction
        (``.grad``) are the same vector, and each projection costs a pass over
        the per-sample gradients.
        """
        key = ("projection", index)
        hit = self.common.get(key)
        if hit is not None and _same_values(hit[0], vector):
            return hit[1]
        dots = individual.project(vector).detach()
        self.common[key] = (vector, dots)
        return dots

    @property
    def sharded(self) -> bool:
        """Whether the parameters are ``fully_shard``'s (FSDP2)."""
        return getattr(self.communicator, "sharding", None) is not None

    @property
    def pieces(self):
        """How each process holds its rows of flat vectors (FSDP2), or ``None``.

        With ``fully_shard`` parameters, a
        :class:`~cockpit.distributed.sharded.Pieces` (the eigensolvers' vectors);
        made from the communicator's layout where asked for.
        """
        sharding = getattr(self.communicator, "sharding", None)
        if sharding is None:
            return None
        return Pieces(sharding, self.communicator, self.global_step)

    def mean(self, local_mean: Tensor, what: str) -> Tensor:
        """Return the mean over the joined batch of per-shard means (one collective).

        Used where a value is needed at once (each Hessian-vector product);
        partial sums of a step go into a :class:`Bucket` instead.
        """
        weighted = local_mean * self.weight
        return self.communicator.all_reduce(weighted, what, self.global_step)


def _same_values(a: Tensor, b: Tensor) -> bool:
    """Whether two tensors hold the same values (the same memory: at once)."""
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        return False
    if a.data_ptr() == b.data_ptr() and a.stride() == b.stride():
        return True
    return bool(torch.equal(a, b))


class _Stopping:
    """The header of a step that stops after the backward pass: none was sent."""

    def __init__(self, communicator: Communicator):
        self.communicator = communicator

    def ready(self) -> bool:
        """Never: waiting for it raises the conflict."""
        return False

    def wait(self):
        """Raise the conflict found when the step began."""
        self.communicator.sync.raise_pending()
        raise AssertionError("unreachable: a stopping step has a pending conflict")


#: What cockpit's communicator calls the header collective.
HEADER = "starting the step"


def start_header(
    communicator: Communicator, global_step: int, n_local: int, plan_text: str
) -> StepComm:
    """Before the backward pass: send the step, the shard size and the plan.

    The collective runs during the backward pass; :meth:`StepComm.settle` (after
    it, or at the first read of the counts) waits for it and checks it, before any
    other collective of cockpit's in the step.
    """
    plan = _digest(plan_text)
    if not communicator.claim(global_step, plan):  # stops after the backward pass
        return StepComm(
            communicator, global_step, n_local=n_local, header=_Stopping(communicator)
        )
    header = communicator.start_gather_ints(
        [global_step, n_local, plan], HEADER, global_step
    )
    return StepComm(communicator, global_step, n_local=n_local, header=header)


def exchange_header(
    communicator: Communicator, global_step: int, n_local: int, plan_text: str
) -> StepComm:
    """:func:`start_header` and wait for it: agree on the step and plan, get counts.

    Raises:
        DistributedError: If processes are at different steps or plan different
            work (on every process).
    """
    return start_header(communicator, global_step, n_local, plan_text).settle()


def _check_header(rows: list[list[int]], global_step: int) -> list[int]:
    """The counts of a gathered header; raise if the processes disagree."""
    steps = [row[0] for row in rows]
    if len(set(steps)) > 1:
        raise DistributedError(
            f"cockpit: the processes track different steps at once (steps {steps} in "
            "rank order). Fix: pass the same global_step on every process (the "
            "optimizer step), and give every process the same schedules."
        )
    plans = [row[2] for row in rows]
    if len(set(plans)) > 1:
        odd = [r for r, p in enumerate(plans) if p != plans[0]]
        raise DistributedError(
            f"cockpit at step {global_step}: rank(s) {odd} plan different work than "
            "rank 0 (other quantities, schedules or info, or no_sync on some ranks "
            "only). Fix: create the Cockpit with the same quantities on every "
            "process, and pass the same no_sync everywhere."
        )
    counts = [row[1] for row in rows]
    if min(counts) <= 0:
        raise DistributedError(
            f"cockpit at step {global_step}: a process has an empty shard (samples "
            f"per rank {counts}). Fix: give every process at least one sample, or "
            "skip tracking at this step on every process."
        )
    return counts


def joined_gradients(step: StepComm, local: Sequence[Tensor | None], params):
    """The joined batch's gradient from each shard's own (uneven shards).

    ``sum_r (n_r / N) g_r``, one collective. (With equal shards DDP's averaged
    ``.grad`` is already this, and nothing is sent.)
    """
    pieces = [
        (g if g is not None else torch.zeros_like(p)).detach() * step.weight
        for g, p in zip(local, params, strict=True)
    ]
    flat = torch.cat([p.reshape(-1).to(torch.float64) for p in pieces])
    total = step.communicator.all_reduce(flat, "the joined gradient", step.global_step)
    out, position = [], 0
    for p in params:
        out.append(total[position : position + p.numel()].reshape(p.shape).to(p.dtype))
        position += p.numel()
    return out


def uneven_message(counts: Sequence[int], global_step: int) -> str:
    """The warning for shards of different sizes (shown once per run)."""
    return (
        f"cockpit: the processes have shards of different sizes at step "
        f"{global_step} ({list(counts)} samples). DDP averages the processes' "
        "gradients with equal weights, so the optimizer's gradient is not the "
        "joined batch's; cockpit weights every sample equally and describes the "
        "joined batch (see docs/distributed.md). Nothing to fix unless DDP should "
        "weight by sample count. (Shown once.)"
    )


def rank_local_message(key: str) -> str:
    """The warning for a quantity that cannot combine processes."""
    return (
        f"{key} has no share() method, so in this data-parallel run its values "
        "describe this process's shard only, not the joined batch. Fix: implement "
        f"{key}.share(global_step, ctx, bucket) (see docs/distributed.md), or read "
        "only .grad and the parameters and inherit "
        "cockpit.quantities.base.NothingToShare. (Warned once.)"
    )
