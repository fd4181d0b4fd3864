"""Passes: untracked steps, left where a process's next claim goes.

Under FSDP (and before HessMaxEV's products under DDP) a tracking process makes
collectives of cockpit's before or inside its backward pass. A process that
passed that step untracked is inside FSDP's (or DDP's) collectives by then and
looks at the claim (:class:`cockpit.distributed.sync.StepSync`) only after its
backward pass, which waits for the tracking one: both would wait until cockpit's
timeout. So the untracked process leaves a *pass* (``u|step|rank``) at the key of
the claim it has not made yet, in the one round trip its look makes anyway, and a
claim that finds another process's pass of its step or a later one stops after
the backward pass, whose collectives then pair (neither process sends cockpit's).

The key keeps the highest step passed; a claim, or the stop of a failed run,
replaces the passes there. A claim that replaces another process's pass of its
step or a later one carries it (``step|plan|rank|passed step|passed rank``), so
that every process claiming after it stops too, whatever the number of
processes. Every function below is one ``compare_set`` in the common case (given
what the key held at the process's last look). (``compare_set`` answers the
expected value where the key is absent, so a key expected to hold a value and
answered with it is absent.)

Limit: after a loop whose count went down (a pass of step 9 left, then step 3
tracked), a pass of a lower step is not kept over the higher one, so a process
that skips step 3 then is noticed as before passes (after its backward pass).
"""

from __future__ import annotations

#: The start of a pass.
PREFIX = "u|"


def passed(there: str) -> tuple[int, int] | None:
    """``(step, rank)`` of a pass; else (a claim, a stop) ``None``."""
    if not there.startswith(PREFIX):
        return None
    step, rank = there[len(PREFIX) :].split("|")
    return int(step), int(rank)


def leave(store, key: str, step: int, rank: int, seen: str) -> tuple[str | None, str]:
    """Leave ``rank``'s pass of ``step`` at ``key``, unless a claim is there.

    A pass of an earlier step is replaced; one of this step or a later one is
    left (only looked at).

    Args:
        store: The process group's key-value store.
        key: The key of this process's next claim.
        step: The step passed untracked.
        rank: This process.
        seen: What this process last found at ``key`` (``""``: nothing yet).

    Returns:
        ``(claim, seen)``: the claim (or stop) found at ``key``, else ``None``;
        and what the key holds now (the next call's ``seen``).
    """
    mine = f"{PREFIX}{step}|{rank}"
    while True:
        found = passed(seen) if seen else None
        desired = seen if found is not None and found[0] >= step else mine
        there = store.compare_set(key, seen, desired).decode()
        if seen and there == seen and desired == mine:  # (the key is absent)
            seen = ""
            continue
        if there == desired:
            return None, there
        found = passed(there)
        if found is None:
            return there, seen
        if found[0] >= step:  # (another process's pass of this step or later)
            return None, there
        seen = there


def claim_over(
    store, key: str, mine: str, step: int, rank: int, seen: str = "", excused=()
):
    """Write the claim ``mine`` over the passes at ``key``, unless a claim is there.

    Args:
        store: The process group's key-value store.
        key: The key of the claim.
        mine: The claim (``step|plan|rank``), or a stop.
        step: The step claimed (a stop: ``None``, nothing carried).
        rank: This process.
        seen: What this process last found at ``key`` (``""``: nothing yet).
        excused: Steps this process passed untracked too (a pass of one of them
            is no conflict: the count went down).

    Returns:
        ``(there, skipped)``: what the key holds now (``mine``, carrying the
        pass it replaced where that pass was another process's of ``step`` or
        a later one; another process's claim; or a stop) and that pass
        (``(step, rank)``), else ``None``.
    """
    while True:
        found = passed(seen) if seen else None
        skip = None
        if found is not None and step is not None and found[1] != rank:
            if found[0] >= step and found[0] not in excused:
                skip = found
        desired = mine if skip is None else f"{mine}|{skip[0]}|{skip[1]}"
        there = store.compare_set(key, seen, desired).decode()
        if seen and there == seen:  # (the key is absent)
            seen = ""
            continue
        if there == desired:
            return there, skip
        if passed(there) is None:
            return there, None
        seen = there
