"""Keeping the processes of a data-parallel run in step, through the group's store.

cockpit's collectives run on a process group of their own (:mod:`cockpit.distributed`),
so they can never pair with DDP's. Whether every process is *at the same tracked
step* is agreed in the process group's key-value store (the c10d store every
``torch.distributed`` run has), where a process can look without waiting:

* at a tracked step a process **claims** its n-th tracked step (``compare_set``:
  the first to arrive writes the step and a hash of the plan, the others compare);
  a process whose n-th tracked step is another step, or the same step with other
  work, knows before its backward pass;
* at an untracked step a process **looks** whether another process already claimed
  a tracked step at or before this one (a step this process did not track), and
  leaves a **pass** in the claim it has not made yet (``u|step|rank``, the highest
  step passed; :mod:`cockpit.distributed.passes`): a process that claims a step
  another already passed untracked knows before its backward pass, whichever came
  first, and so does every process that claims after it;
* a process that cannot go on (it found a disagreement, left a step with an error,
  or waited in vain) writes a **note** (where it is, what happened) and raises the
  **failed** flag; every process waiting in cockpit polls that flag, writes its own
  note, and raises a :class:`~cockpit.distributed.DistributedError` composed from
  all notes, so every process names the same ranks and step.

The waits are bounded by the cockpit's ``timeout``. A process in DDP's own
collectives cannot be reached from here; the claims are made so that a process
notices before its next backward pass, where DDP would wait.
"""

from __future__ import annotations

import json
import time
from typing import Any, Callable, NoReturn

from cockpit.distributed import passes

#: A value no key of cockpit's holds (read without waiting, see StepSync._read).
_ABSENT = "\x00absent"
#: What a process that stopped writes into the next claims: later steps stop too.
_STOPPED = "stopped"
#: Per process: how many data-parallel cockpits were made on each group (their
#: namespaces in the store; every process makes them in the same order).
_INSTANCES: dict[tuple, int] = {}


class DistributedError(RuntimeError):
    """The processes of a data-parallel run disagree, or one did not answer."""


def default_store():
    """The key-value store of the default process group."""
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


def namespace(ranks) -> str:
    """A fresh namespace in the store for a cockpit on the processes ``ranks``."""
    group = tuple(int(r) for r in ranks)
    _INSTANCES[group] = _INSTANCES.get(group, 0) + 1
    return f"cockpit/{'-'.join(map(str, group))}/{_INSTANCES[group]}"


def _plural(ranks) -> str:
    ranks = sorted(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


#: The fix of a disagreement about which steps are tracked.
FIX_STEPS = (
    "Fix: every process must wrap every backward pass in `with cockpit(step, "
    "info=...)`, pass the same step numbers (the optimizer step) and use schedules "
    "that do not read the process's own data."
)
#: The fix after a process left a step with an error.
FIX_LEFT = (
    "Fix: see that process's error. A process that leaves a tracked step with an "
    "error cannot go on with the data-parallel cockpit (the others were inside the "
    "step with it): stop every process, or catch the error around the whole run."
)
#: The fix after a process did not answer.
FIX_SILENT = (
    "Fix: see the other processes' errors and output. If a process is merely slow "
    "(a long evaluation on one rank), raise Cockpit(..., timeout=...)."
)


class StepSync:
    """The store's side of a data-parallel cockpit (one per cockpit).

    Args:
        store: The process group's key-value store.
        prefix: This cockpit's namespace in it (:func:`namespace`).
        rank: This process's rank in the group.
        size: The number of processes.
        timeout: Seconds any wait may take.
    """

    def __init__(self, store, prefix: str, rank: int, size: int, timeout: float):
        self.store, self.prefix = store, prefix
        self.rank, self.size, self.timeout = rank, size, float(timeout)
        #: Tracked steps this process has claimed.
        self.claimed = 0
        #: Set once this cockpit cannot go on (raised again at every later step).
        self.broken: DistributedError | None = None
        #: Where this process is, for its note: ``(step, tracking)``.
        self.position: tuple[int | None, bool] = (None, False)
        #: Called once when the cockpit breaks (drops cockpit's own group).
        self.on_break: Callable[[], None] | None = None
        #: A conflict found before the backward pass: ``(cause, step, fix)``.
        self.pending: tuple[str, int, str] | None = None
        #: ``(claim number, value)``: what this process last found at its next
        #: claim's key when it left a pass there (:func:`passes.leave`).
        self._seen: tuple[int, str] = (-1, "")
        #: The steps this process passed untracked since its last claim (a pass
        #: of one of them is no conflict: the steps were counted down).
        self._untracked: set[int] = set()

    # --- keys ---------------------------------------------------------------------
    def _key(self, *parts: Any) -> str:
        return "/".join([self.prefix, *map(str, parts)])

    def _read(self, key: str) -> str | None:
        """The value at ``key``, or ``None`` if there is none (one look, no wait).

        ``compare_set`` with an expected value no key holds answers in one round
        trip (``check`` and ``get`` take two) and writes nothing.
        """
        there = self.store.compare_set(key, _ABSENT, _ABSENT).decode()
        return None if there == _ABSENT else there

    @property
    def grace(self) -> float:
        """Seconds a failing process waits for the others' notes."""
        return min(2.0, max(0.2, self.timeout / 5))

    # --- the set-up ------------------------------------------------------------------
    def exchange(self, name: str, value: str, step: int | None, what: str) -> list[str]:
        """Every process's ``value`` under ``name``, in rank order (bounded wait).

        Raises:
            DistributedError: If some process did not write its value in time
                (naming which), or another process failed.
        """
        self.store.set(self._key(name, self.rank), value)
        keys = [self._key(name, r) for r in range(self.size)]
        self.wait_for(lambda: self.store.check(keys), what, step, keys=keys)
        return [v.decode() for v in self.store.multi_get(keys)]

    # --- tracked and untracked steps ----------------------------------------------
    #
    # DDP pairs the processes' backward passes, so when a process is about to run
    # its backward pass no other can have finished a later one: a claim it sees
    # for its next tracked step was made at this step (that process is before or
    # in the same backward pass: stopping now would leave it inside DDP's
    # collective, so this process runs its backward pass and stops after it) or at
    # an earlier step (that process finished its backward pass and waits in
    # cockpit: stop now, since this process's backward pass would wait for it).

    def claim(self, step: int, plan: int) -> bool:
        """Claim this process's next tracked step before its backward pass.

        Returns:
            Whether the step goes on (``False``: it stops after the backward pass,
            see :meth:`after_backward`).

        Raises:
            DistributedError: If another process made the claim at an earlier step
                and waits for this one.
        """
        self.check_alive()
        number = self.claimed
        self.claimed += 1
        self.position = (step, True)
        mine = f"{step}|{plan}|{self.rank}"
        key = self._key("claim", number)
        seen = self._seen[1] if self._seen[0] == number else ""
        excused, self._untracked = self._untracked, set()
        there, _ = passes.claim_over(
            self.store, key, mine, step, self.rank, seen, excused
        )
        if self.rank == 0 and number >= 2:  # every process is past that one
            self.store.delete_key(self._key("claim", number - 2))
        if there == _STOPPED:  # another process stopped: say why, before the backward
            self.fail(None, step, doing="starting the step")
        other_step, other_plan, other, skipped = _claimed(there)
        if skipped is not None and other_step == step:  # a pass of this step or a
            # later one was there (that process is in or past its backward pass,
            # not in cockpit): stop after the backward pass, with no collective
            passed_step, passer = skipped
            cause = _parted(self.rank, step, passer, passed_step, tracked=False)
            self._defer(cause, min(passed_step, step), FIX_STEPS)
            return False
        if (other_step, other_plan) == (step, plan):
            return True
        if other_step == step:
            cause = (
                f"{_plural([other, self.rank])} plan different work at step {step} "
                "(other quantities, schedules or info, or no_sync on some processes "
                "only)."
            )
            fix = (
                "Fix: create the Cockpit with the same quantities on every process, "
                "and pass the same no_sync everywhere."
            )
        else:
            (low_rank, low), (high_rank, high) = sorted(
                [(other, other_step), (self.rank, step)], key=lambda pair: pair[1]
            )
            cause = _parted(low_rank, low, high_rank, high, tracked=True)
            fix = FIX_STEPS
        self._conflict(other, other_step, step, number, cause, fix)
        return False

    def untracked(self, step: int) -> None:
        """Before an untracked step's backward pass: does another process track it?

        (Or an earlier step this process did not track.)

        Raises:
            DistributedError: If another process made that claim at an earlier step
                and waits for this one (at this step's claim: see
                :meth:`after_untracked`).
        """
        self.check_alive()
        self.position = (step, False)
        self._untracked.add(step)
        number, key = self.claimed, self._key("claim", self.claimed)
        seen = self._seen[1] if self._seen[0] == number else ""
        there, seen = passes.leave(self.store, key, step, self.rank, seen)
        self._seen = (number, seen)
        if there is None:
            return
        if there == _STOPPED:
            self.fail(None, step, doing="starting the step")
        other_step, _, other, _ = _claimed(there)
        cause = _parted(other, other_step, self.rank, step, tracked=False)
        self._conflict(other, other_step, step, self.claimed, cause, FIX_STEPS)

    def after_untracked(self, step: int) -> None:
        """After an untracked step's backward pass: the same question again.

        Another process may have claimed this step meanwhile.

        Raises:
            DistributedError: For a conflict found now or before the backward pass.
        """
        self.raise_pending()
        there = self._read(self._key("claim", self.claimed))
        if there is None or passes.passed(there) is not None:  # (untracked too)
            return
        if there == _STOPPED:
            self.fail(None, step, doing="ending the step")
        other_step, _, other, _ = _claimed(there)
        if other_step <= step:  # (a later step: that process is merely ahead)
            self.fail(_parted(other, other_step, self.rank, step, False), other_step)

    def after_backward(self) -> None:
        """After a tracked step's backward pass: stop if a conflict was found.

        Else tell the others that this process waits in cockpit now.

        Raises:
            DistributedError: For a conflict found before the backward pass.
        """
        self.raise_pending()
        self.store.set(self._key("waits", self.rank), str(self.claimed - 1))

    def _conflict(self, other, other_step, step, number, cause, fix) -> None:
        """Stop now if ``other`` claimed at an earlier step, else after the backward.

        A process that claimed at an earlier step waits in cockpit for this one.
        """
        if other_step != step and self._waits(other, number):
            self.fail(cause, min(other_step, step), fix=fix)
        self._defer(cause, min(other_step, step), fix)

    def _defer(self, cause: str, at: int, fix: str) -> None:
        """Stop after this backward pass; tell the others now (the failed flag)."""
        self.pending = (cause, at, fix)
        note = self._note(at, cause, "finishing its backward pass first", fix)
        self.store.compare_set(self._key("failed"), "", note)  # (claims: after it)

    def _waits(self, rank: int, number: int) -> bool:
        """Whether ``rank`` waits in cockpit after its claim ``number``'s backward.

        Looked at for :attr:`grace` seconds at most.
        """
        deadline = time.monotonic() + self.grace
        while True:
            there = self._read(self._key("waits", rank))
            if there is not None and int(there) >= number:
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)

    def raise_pending(self) -> None:
        """Raise the conflict found before this backward pass, if one was."""
        self.check_alive()
        if self.pending is not None:
            cause, step, fix = self.pending
            self.pending = None
            self.fail(cause, step, fix=fix)

    # --- waiting and failing --------------------------------------------------------
    def _raise_flag(self, note: str) -> None:
        """Raise the failed flag (the first note wins) and stop the next claims.

        A process that is not waiting in cockpit now sees the stop at its next
        step, before its backward pass, whether tracked or not.
        """
        self.store.compare_set(self._key("failed"), "", note)
        for number in (self.claimed, self.claimed + 1):
            key = self._key("claim", number)
            passes.claim_over(self.store, key, _STOPPED, None, self.rank)

    def failed(self) -> bool:
        """Whether some process has raised the failed flag (one look, no wait).

        A store that cannot be reached counts as failed (its host process, rank 0
        of the default group, is gone).
        """
        try:
            return bool(self.store.check([self._key("failed")]))
        except Exception:  # noqa: BLE001 - any store error: the run cannot go on
            return True

    def wait_for(
        self,
        done: Callable[[], bool],
        what: str,
        step: int | None,
        keys: list[str] | None = None,
    ) -> None:
        """Wait until ``done()``, at most ``timeout`` seconds; stop if a process failed.

        Raises:
            DistributedError: On every waiting process, if another process failed
                or the time is up (naming the processes that did not answer).
        """
        if done():
            return
        start = time.monotonic()
        delay = 1e-4
        while True:
            time.sleep(delay)
            delay = min(2 * delay, 0.02)
            if done():
                return
            waited = time.monotonic() - start
            if waited > 0.002 and self.failed():
                self.fail(None, step, doing=f"waiting for the others ({what})")
            if waited > self.timeout:
                silent = None
                if keys is not None:
                    silent = [
                        r for r, k in enumerate(keys) if not self.store.check([k])
                    ]
                named = f" from {_plural(silent)}" if silent else ""
                self.fail(
                    f"no answer{named} within {self.timeout:g} s at step {step} "
                    f"({what}).",
                    step,
                    doing=f"waiting for the others ({what})",
                    fix=FIX_SILENT,
                )

    def fail(
        self,
        cause: str | None,
        step: int | None,
        doing: str | None = None,
        fix: str | None = None,
    ) -> NoReturn:
        """Say why this process stops, collect the others' notes, and raise.

        ``cause=None``: another process failed first (its note says why).

        Raises:
            DistributedError: Always, composed from every process's note.
        """
        if self.broken is not None:
            raise self.broken
        note = self._note_text(step, cause, doing, fix)
        try:
            self.store.set(self._key("note", self.rank), note)
            self._raise_flag(note)
            notes = self._roll_call()
            first = self._read(self._key("failed")) or note
        except Exception as error:  # noqa: BLE001 - the store's host is gone
            unreachable = (
                f"the process group's store cannot be reached ({type(error).__name__}"
                f": {error}): the process that holds it (rank 0 of the default "
                "group) is probably gone."
            )
            first = self._note_text(step, cause or unreachable, doing, fix)
            notes = {self.rank: json.loads(note)}
        self.stop(
            DistributedError(compose(json.loads(first), notes, self.rank, self.size))
        )

    def left(self, step: int, error: BaseException | None) -> None:
        """This process leaves a tracked step with ``error``: tell the others.

        ``error=None``: the step ended before this process's collectives without
        an error (a check stopped it, e.g. several backward passes inside it).

        The error itself goes on (it is the user's); the cockpit is broken from
        here on, and its next step raises a :class:`DistributedError`.
        """
        if self.broken is not None or isinstance(error, DistributedError):
            return
        if error is None:
            what = "a check that stopped the step on this process only"
            cause = f"rank {self.rank} ended step {step} early ({what})"
        else:
            what = f"{type(error).__name__}: {error}".strip()
            cause = f"rank {self.rank} left step {step} with {what}"
        note = self._note(step, cause + ".", f"left the step ({what})", FIX_LEFT)
        self._raise_flag(note)
        first = json.loads(self._read(self._key("failed")) or note)
        notes = {self.rank: json.loads(note)}
        self._break(DistributedError(compose(first, notes, self.rank, self.size)))

    def stop(self, error: DistributedError) -> NoReturn:
        """Break the cockpit with ``error`` (every process raises its own)."""
        self._break(error)
        raise error

    def _break(self, error: DistributedError) -> None:
        if self.broken is None:
            self.broken = error
            if self.on_break is not None:
                self.on_break()

    def check_alive(self) -> None:
        """Raise the error that broke this cockpit, if one did."""
        if self.broken is not None:
            raise self.broken

    def _note(self, step, cause, doing, fix) -> str:
        """Write this process's note (where it is, what happened); return it."""
        text = self._note_text(step, cause, doing, fix)
        self.store.set(self._key("note", self.rank), text)
        return text

    def _note_text(self, step, cause, doing, fix) -> str:
        here, tracking = self.position
        note = {
            "rank": self.rank,
            "step": step if step is not None else here,
            "at": here,
            "tracking": tracking,
            "doing": doing,
            "cause": cause,
            "fix": fix,
        }
        return json.dumps(note)

    def _roll_call(self) -> dict[int, dict]:
        """Every process's note that arrives within :attr:`grace` seconds."""
        notes: dict[int, dict] = {}
        deadline = time.monotonic() + self.grace
        while True:
            for rank in range(self.size):
                if rank not in notes:
                    text = self._read(self._key("note", rank))
                    if text is not None:
                        notes[rank] = json.loads(text)
            if len(notes) == self.size or time.monotonic() > deadline:
                return notes
            time.sleep(0.02)


def _claimed(there: str) -> tuple[int, int, int, tuple[int, int] | None]:
    """``(step, plan, rank, pass)`` of a claim.

    ``pass``: the ``(step, rank)`` of another process's pass the claim replaced
    (:mod:`cockpit.distributed.passes`), else ``None``.
    """
    fields = [int(x) for x in there.split("|")]
    skipped = (fields[3], fields[4]) if len(fields) == 5 else None
    return fields[0], fields[1], fields[2], skipped


def _parted(tracker: int, at: int, other: int, other_at: int, tracked: bool) -> str:
    """Why: ``tracker`` tracks step ``at``, which ``other`` (at ``other_at``) skips."""
    here = "tracked" if tracked else "untracked"
    why = (
        "its schedule skips that step"
        if at == other_at
        else "it skipped that step (untracked, or its backward pass ran outside "
        "`with cockpit(...)`), or it counts steps differently"
    )
    return (
        f"rank {tracker} tracks step {at}, which rank {other} does not track (rank "
        f"{other} is at step {other_at}, {here}: {why})."
    )


def _where(note: dict) -> str:
    at = note.get("at")
    if note.get("doing"):
        place = f"at step {at}" if at is not None else "before its first step"
        if note.get("tracking"):
            place = f"tracking step {at}"
        return f"{place}, {note['doing']}"
    if at is None:
        return "before its first step"
    return f"tracking step {at}" if note.get("tracking") else f"at step {at}, untracked"


def compose(first: dict, notes: dict[int, dict], me: int, size: int) -> str:
    """The message every process raises: the first failure, where everyone is."""
    step = first.get("step")
    places = []
    for rank in range(size):
        if rank in notes:
            places.append(f"rank {rank}: {_where(notes[rank])}")
        else:
            places.append(
                f"rank {rank}: no report (stopped, busy outside cockpit, or gone)"
            )
    cause = first.get("cause") or "another process failed."
    fix = first.get("fix") or FIX_STEPS
    at = f" at step {step}" if step is not None else ""
    return (
        f"cockpit on rank {me} of {size}: the data-parallel run stops{at}: {cause} "
        f"Where each process is: {'; '.join(places)}. {fix} This cockpit cannot "
        "go on with the run."
    )
