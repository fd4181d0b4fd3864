"""Data-parallel runs: every quantity over the global batch of all processes.

In a run with ``torch.distributed`` (DDP via ``torchrun``), each process hands the
cockpit its own shard of the batch (``info`` describes the local shard, as in a
single-process loop). At a tracked step the cockpit then

1. starts a small header before the backward pass (the step, the shard's size and
   a fingerprint of the step's plan), gathered while the backward pass runs and
   checked before any other of cockpit's collectives: shards are weighted by their
   sample counts, and processes that disagree about what to track fail on every
   process;
2. after the backward pass, lets each quantity put its *partial sums* (sums over the
   local samples: per-sample squared norms, histogram counts, curvature diagonals
   weighted by the shard's share, per-sample projections in the shard's slots of a
   global vector, ...) into one :class:`Bucket`, all-reduced in one collective (two
   when a histogram range needs a maximum);
3. hands the quantities a global ``info`` (the loss of the joined batch, all
   per-sample losses, the global batch size) and the joined batch's gradient.

Untracked steps make no collective. cockpit's collectives run on a process group of
their own, so they never pair with DDP's; which step every process tracks is agreed
in the process group's key-value store (:mod:`cockpit.distributed_sync`). Every wait
is bounded (``timeout``): processes that track different steps, a process that left
a step with an error or stopped answering make every process raise a
:class:`DistributedError` naming the ranks and the step, instead of hanging.

Only cockpit's collectives live here; quantities see a :class:`StepComm`.
"""

from __future__ import annotations

import datetime
import hashlib
import json
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from cockpit import distributed_sync
from cockpit.distributed_sync import DistributedError, StepSync

#: ``Cockpit(process_group=AUTO)``: data-parallel when ``torch.distributed`` runs.
AUTO = "auto"
#: Default seconds a process waits for the others at one of cockpit's collectives.
DEFAULT_TIMEOUT = 300.0
#: Steps ahead over which the quantities' schedules are compared across processes.
SCHEDULE_HORIZON = 2048


def _dist():
    import torch.distributed as dist

    return dist


def resolve_group(process_group: Any) -> Any | None:
    """Return the process group to reduce over, or ``None`` for rank-local values.

    Args:
        process_group: :data:`AUTO` (the default group when ``torch.distributed``
            is initialised with more than one process), a process group, or
            ``None`` (rank-local: each process describes its own shard).

    Raises:
        ValueError: For a string other than ``"auto"``, without an initialised
            ``torch.distributed``, or for a group this process is not a member of.
    """
    if process_group is None:
        return None
    if isinstance(process_group, str):
        if process_group != AUTO:
            raise ValueError(
                f"process_group must be 'auto', None or a torch.distributed process "
                f"group, got {process_group!r}."
            )
        dist = _dist()
        if not (dist.is_available() and dist.is_initialized()):
            return None
        process_group = dist.group.WORLD
    dist = _dist()
    if not dist.is_initialized():
        raise ValueError(
            "Cockpit(process_group=...) got a process group, but torch.distributed "
            "is not initialised. Fix: call torch.distributed.init_process_group() "
            "first, or pass process_group=None."
        )
    if dist.get_rank(process_group) < 0:
        raise ValueError(
            f"Cockpit(process_group=...): this process (global rank "
            f"{dist.get_rank()}) is not a member of the process group it was given, "
            "so it has no share of that group's batch. Fix: build the Cockpit on the "
            "group's members with their group (each data-parallel group its own), "
            "or pass process_group=None for values of this process's shard."
        )
    return process_group if dist.get_world_size(process_group) > 1 else None


def _digest(text: str) -> int:
    """A 62-bit hash of ``text`` (fits an int64 on every process)."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") >> 2


class Communicator:
    """cockpit's collectives among the processes of one group, each wait bounded.

    At the first step (:meth:`begin`) the processes compare their set-up in the
    group's store and make a process group of cockpit's own over the same
    processes, on the same backend: cockpit's collectives never pair with DDP's,
    even when processes disagree, and a collective a failed step left behind
    cannot meet a later one of DDP.

    Args:
        group: The process group (the processes whose batches are joined).
        timeout: Seconds to wait for the other processes at each collective.
    """

    #: Whether values describe the local shard only (:class:`LocalCommunicator`).
    local = False

    def __init__(self, group: Any, timeout: float = DEFAULT_TIMEOUT):
        dist = _dist()
        self.user_group = group
        #: cockpit's own process group (made at the first step).
        self.group = None
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.timeout = float(timeout)
        self.backend = str(dist.get_backend(group))
        #: The store's side: claims, notes, the failed flag (made at the first step).
        self.sync: StepSync | None = None
        #: Bytes this process sent into cockpit's collectives (benchmarks).
        self.bytes_sent = 0
        #: Number of cockpit's collectives so far.
        self.calls = 0

    # --- the run's state ------------------------------------------------------------
    def begin(self, quantities, params, step: int) -> None:
        """Before every step: raise if the run broke; compare the set-up once.

        Raises:
            DistributedError: If an earlier step broke the run, or the processes'
                set-ups differ (:func:`check_setup`).
        """
        if self.sync is None:
            dist = _dist()
            ranks = dist.get_process_group_ranks(self.user_group)
            self.sync = StepSync(
                distributed_sync.default_store(),
                distributed_sync.namespace(ranks),
                self.rank,
                self.size,
                self.timeout,
            )
            self.sync.on_break = self._drop_group
            check_setup(self, quantities, params, step)
            self.group = dist.new_group(
                ranks=ranks,
                backend=self.backend,
                timeout=datetime.timedelta(seconds=self.timeout + 60),
                use_local_synchronization=True,
            )
        self.sync.check_alive()

    def _drop_group(self) -> None:
        """The run broke: stop using cockpit's own group (a collective may be in it).

        DDP's group is untouched. A gloo group is only forgotten (destroying it
        would wait for the collective left in it); an NCCL group is aborted, so
        that its watchdog does not end the process over that collective.
        """
        group, self.group = self.group, None
        if group is not None and self.backend == "nccl":
            from torch.distributed import distributed_c10d

            try:
                distributed_c10d._abort_process_group(group)
            except Exception:  # noqa: S110 - already failing; the error says why
                pass

    def claim(self, step: int, plan: int) -> bool:
        """Claim this process's next tracked step (see :meth:`StepSync.claim`).

        Returns:
            ``False`` if the step stops after the backward pass.
        """
        return self.sync.claim(step, plan)

    @property
    def stopping(self) -> bool:
        """Whether this step stops after the backward pass (a conflict was found)."""
        return self.sync is not None and self.sync.pending is not None

    def after_backward(self) -> None:
        """After a tracked step's backward pass (:meth:`StepSync.after_backward`)."""
        self.sync.after_backward()

    def untracked(self, step: int) -> None:
        """Before an untracked step's backward pass: no other process tracks it?"""
        self.sync.untracked(step)

    def after_untracked(self, step: int) -> None:
        """After an untracked step's backward pass: the same question again."""
        self.sync.after_untracked(step)

    def left(self, step: int, error: BaseException) -> None:
        """This process leaves a tracked step with ``error``: tell the others."""
        if self.sync is not None:
            self.sync.left(step, error)

    # --- collectives ------------------------------------------------------------------
    def _device(self, tensor: Tensor) -> torch.device:
        """Where a tensor must be for the group's backend."""
        if self.backend == "gloo":
            return torch.device("cpu")
        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return tensor.device

    def _wait(self, work, what: str, step: int | None) -> None:
        """Wait for ``work``: at most ``timeout``, and no longer once a process failed.

        Raises:
            DistributedError: On every process (see :meth:`StepSync.fail`).
        """
        self.sync.wait_for(work.is_completed, what, step)
        try:
            done = work.wait()
        except RuntimeError as error:  # a process died: its connection broke
            self.sync.fail(
                f"the connection to another process broke at step {step} ({what}): "
                f"{str(error).splitlines()[0]}",
                step,
                doing=f"waiting for the others ({what})",
                fix=distributed_sync.FIX_SILENT,
            )
        if done is False:
            self.sync.fail(
                f"a collective at step {step} ({what}) did not complete.", step
            )

    def _group(self):
        """Return cockpit's own group (an error once the run broke)."""
        self.sync.check_alive()
        return self.group

    def all_reduce(
        self, tensor: Tensor, what: str, step: int | None, op: str = "sum"
    ) -> Tensor:
        """Return the sum (or maximum) of ``tensor`` over the group."""
        dist = _dist()
        device = self._device(tensor)
        buffer = tensor.detach().to(device, copy=True).contiguous()  # never in place
        reduce_op = dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX
        work = dist.all_reduce(buffer, op=reduce_op, group=self._group(), async_op=True)
        self.calls += 1
        self.bytes_sent += buffer.numel() * buffer.element_size()
        self._wait(work, what, step)
        return buffer.to(tensor.device)

    def all_gather_ints(
        self, values: Sequence[int], what: str, step: int | None
    ) -> list[list[int]]:
        """Return every process's ``values`` (same length on all), in rank order."""
        return self.start_gather_ints(values, what, step).wait()

    def start_gather_ints(
        self, values: Sequence[int], what: str, step: int | None
    ) -> PendingGather:
        """Start gathering every process's ``values``; ``.wait()`` returns them.

        The collective runs while the caller goes on (the backward pass); the wait
        is bounded by ``timeout``.
        """
        dist = _dist()
        device = torch.device("cpu")
        if self.backend == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        mine = torch.tensor(list(values), dtype=torch.int64, device=device)
        gathered = [torch.empty_like(mine) for _ in range(self.size)]
        work = dist.all_gather(gathered, mine, group=self._group(), async_op=True)
        self.calls += 1
        self.bytes_sent += mine.numel() * mine.element_size()
        return PendingGather(self, work, gathered, what, step)


class PendingGather:
    """An all-gather of integers in flight (:meth:`Communicator.start_gather_ints`)."""

    def __init__(self, comm: Communicator, work, gathered, what: str, step):
        self.comm, self.work, self.gathered = comm, work, gathered
        self.what, self.step = what, step

    def ready(self) -> bool:
        """Whether :meth:`wait` would return at once (never blocks)."""
        return self.work is None or bool(self.work.is_completed())

    def wait(self) -> list[list[int]]:
        """Every process's values, in rank order (waits at most ``timeout``)."""
        if self.work is not None:
            self.comm._wait(self.work, self.what, self.step)
            self.work = None
        return [t.tolist() for t in self.gathered]


class LocalCommunicator(Communicator):
    """Each process on its own (``process_group=None`` in a run with several).

    The same step machinery with collectives that return their input: values
    describe the local shard. ``.grad`` is DDP's average over processes, so the
    shard's own gradient is caught on its way to DDP instead (``local = True``).
    """

    local = True

    def __init__(self):  # no super().__init__: there is no group
        self.group, self.rank, self.size = None, 0, 1
        self.timeout, self.backend = 0.0, "none"
        self.bytes_sent, self.calls = 0, 0

    stopping = False

    def begin(self, quantities, params, step):
        """Nothing to agree on (one process)."""

    def claim(self, step, plan):
        """Nothing to claim (one process)."""
        return True

    def after_backward(self):
        """Nothing to check (one process)."""

    def untracked(self, step):
        """Nothing to check (one process)."""

    def after_untracked(self, step):
        """Nothing to check (one process)."""

    def left(self, step, error):
        """Nobody to tell (one process)."""

    def all_reduce(self, tensor, what, step, op="sum"):
        """The tensor itself (one process)."""
        return tensor.detach().clone()

    def start_gather_ints(self, values, what, step):
        """The values themselves (one process), already there."""
        return PendingGather(self, None, [torch.tensor(list(values))], what, step)


def local_communicator() -> LocalCommunicator | None:
    """For ``process_group=None``: a local one if several processes run, else None."""
    dist = _dist()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return LocalCommunicator()
    return None


def setup_fingerprint(quantities, params, first_step: int) -> dict[str, int]:
    """Hashes of what every process must agree on before tracking anything.

    The quantities (class and key), their schedules over the next
    :data:`SCHEDULE_HORIZON` steps, and the parameters' shapes and dtypes.
    """
    names = ";".join(f"{type(q).__qualname__}:{q.key}" for q in quantities)
    steps = range(first_step, first_step + SCHEDULE_HORIZON)
    schedules = ";".join(
        "".join("1" if q.should_compute(s) else "0" for s in steps) for q in quantities
    )
    shapes = ";".join(f"{tuple(p.shape)}:{p.dtype}" for p in params)
    return {
        "quantities": _digest(names),
        "schedules": _digest(schedules),
        "parameters": _digest(shapes),
    }


def check_setup(comm: Communicator, quantities, params, first_step: int) -> None:
    """Compare the set-up of all processes once; raise on every process if it differs.

    The fingerprints meet in the group's store (no collective: a process that
    runs DDP's backward pass meanwhile cannot be paired with it).

    Raises:
        DistributedError: Naming what differs (quantities, schedules, parameters,
            first step) and between which ranks, or the ranks that did not come.
    """
    mine = setup_fingerprint(quantities, params, first_step)
    texts = comm.sync.exchange(
        "setup",
        json.dumps([first_step, *mine.values()]),
        first_step,
        "comparing the set-up at the first `with cockpit(...)`",
    )
    rows = [json.loads(text) for text in texts]
    labels = ["first step", *mine]
    for column, label in enumerate(labels):
        values = [row[column] for row in rows]
        if len(set(values)) > 1:
            odd = [r for r, v in enumerate(values) if v != values[0]]
            comm.sync.stop(
                DistributedError(
                    f"cockpit's set-up differs across processes: the {label} of "
                    f"rank(s) {odd} differ from rank 0's. Every process must create "
                    "the Cockpit with the same quantities (same classes, keys and "
                    "schedules) over the same parameters, and enter the first step "
                    "together. Fix: build the Cockpit from the same code on every "
                    "process, or pass Cockpit(..., process_group=None) for "
                    "rank-local values."
                )
            )


@dataclass
class _Slot:
    """A tensor in the bucket and what to do with its reduced value."""

    tensor: Tensor
    then: Callable[[Tensor], None] | None
    value: Tensor | None = None


class Bucket:
    """Partial sums of one step, reduced together in one collective (per operation).

    Quantities add tensors with :meth:`sum` (or :meth:`max`, :meth:`gather`) and get
    the global value back through ``then`` (or ``slot.value``) once
    :meth:`reduce` ran. Everything travels as float64, so counts stay exact.
    """

    def __init__(self, comm: StepComm):
        self.comm = comm
        self._slots: dict[str, list[_Slot]] = {"sum": [], "max": []}

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
        may read other slots of the same bucket.
        """
        comm = self.comm
        for op, slots in self._slots.items():
            if not slots:
                continue
            device = slots[0].tensor.device
            flat = torch.cat(
                [s.tensor.detach().to(device, torch.float64).reshape(-1) for s in slots]
            )
            total = comm.communicator.all_reduce(flat, what, comm.global_step, op=op)
            position = 0
            for slot in slots:
                size = slot.tensor.numel()
                piece = total[position : position + size].reshape(slot.tensor.shape)
                position += size
                slot.value = piece.to(slot.tensor.device, slot.tensor.dtype)
        for slots in self._slots.values():
            for slot in slots:
                if slot.then is not None:
                    slot.then(slot.value)
        self._slots = {"sum": [], "max": []}


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


__all__ = [
    "AUTO",
    "Bucket",
    "Communicator",
    "DistributedError",
    "StepComm",
    "check_setup",
    "exchange_header",
    "start_header",
    "joined_gradients",
    "resolve_group",
]


def communicator(process_group: Any, timeout: float) -> Communicator | None:
    """The cockpit's collectives for ``process_group`` (``None``: one process).

    ``None`` as the group under an initialised process group gives each process
    its shard's values (a local communicator, which still catches the shard's
    own gradient).
    """
    group = resolve_group(process_group)
    if group is not None:
        return Communicator(group, timeout)
    return local_communicator() if process_group is None else None
