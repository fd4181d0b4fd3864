"""Data-parallel runs: cockpit's process group, its collectives, the set-up check.

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
in the process group's key-value store (:mod:`cockpit.distributed.sync`). Every wait
is bounded (``timeout``): processes that track different steps, a process that left
a step with an error or stopped answering make every process raise a
:class:`DistributedError` naming the ranks and the step, instead of hanging.

Only cockpit's collectives live here; quantities see a
:class:`~cockpit.distributed.step.StepComm`.
"""

from __future__ import annotations

import datetime
import hashlib
import json
from typing import Any, Sequence

import torch
from torch import Tensor

from cockpit.distributed import sync as distributed_sync
from cockpit.distributed.sync import DistributedError, StepSync

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
    #: The FSDP2 layout of the parameters (:mod:`cockpit.distributed.sharded`).
    sharding = None

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
        except RuntimeError as error:  # a process died
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

    def reduce_scatter(self, tensor: Tensor, what: str, step: int | None) -> Tensor:
        """This process's block of the sum of ``tensor`` over the group.

        ``tensor`` holds one block per process, of equal sizes, in rank order;
        each process receives only its block of the sum. Waited for as every
        collective is (a process that fails is noticed at once): over gloo, whose
        reduce-scatter says it is done only once waited for, as an all-reduce of
        ``tensor`` (cockpit cuts what it scatters into pieces of at most
        ``SCATTER_ELEMENTS`` numbers, so that is a piece's size); elsewhere a
        reduce-scatter.
        """
        dist = _dist()
        device = self._device(tensor)
        size = tensor.numel() // self.size
        if self.backend == "gloo":
            total = self.all_reduce(tensor, what, step)
            return total[self.rank * size : (self.rank + 1) * size].clone()
        buffer = tensor.detach().to(device).contiguous()
        out = buffer.new_empty(size)
        # (torch 2.13 names it reduce_scatter_single; reduce_scatter_tensor warns)
        scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
        work = scatter(
            out, buffer, op=dist.ReduceOp.SUM, group=self._group(), async_op=True
        )
        self.calls += 1
        self.bytes_sent += buffer.numel() * buffer.element_size()
        self._wait(work, what, step)
        return out.to(tensor.device)

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

    def reduce_scatter(self, tensor, what, step):
        """The tensor itself (one process holds the one block)."""
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


def setup_fingerprint(
    quantities, params, first_step: int, layout: str = ""
) -> dict[str, int]:
    """Hashes of what every process must agree on before tracking anything.

    The quantities (class and key), their schedules over the next
    :data:`SCHEDULE_HORIZON` steps, and the parameters' shapes and dtypes (full
    shapes of sharded ones) with their sharding ``layout``, if any.
    """
    names = ";".join(f"{type(q).__qualname__}:{q.key}" for q in quantities)
    steps = range(first_step, first_step + SCHEDULE_HORIZON)
    schedules = ";".join(
        "".join("1" if q.should_compute(s) else "0" for s in steps) for q in quantities
    )
    shapes = ";".join(f"{tuple(p.shape)}:{p.dtype}" for p in params) + layout
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
    sharding = getattr(comm, "sharding", None)
    layout = "" if sharding is None else sharding.layout()
    mine = setup_fingerprint(quantities, params, first_step, layout)
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
