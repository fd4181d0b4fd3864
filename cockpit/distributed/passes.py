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

The key keeps the latest step passed; a claim, or the stop of a failed run,
replaces the passes there. Every function below is one ``compare_set`` in the
common case. (``compare_set`` answers the expected value where the key is
absent, so a key expected to hold a value and answered with it is absent.)
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

    A pass of an earlier step is replaced; one of this step or a later one (by
    another process) is left.

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
        there = store.compare_set(key, seen, mine).decode()
        if there == mine:
            return None, there
        if seen and there == seen:  # (the key is absent)
            seen = ""
            continue
        found = passed(there)
        if found is None:
            return there, seen
        if found[0] >= step:
            return None, there
        seen = there


def claim_over(store, key: str, mine: str, step: int, rank: int):
    """Write the claim (or stop) ``mine`` over the passes at ``key``.

    Unless a claim or stop is there already.

    Returns:
        ``(there, skipped)``: what the key holds now (``mine``, another process's
        claim, or a stop) and the latest pass replaced that another process made
        of ``step`` or a later one (``(step, rank)``), else ``None``.
    """
    seen, skipped = "", None
    while True:
        there = store.compare_set(key, seen, mine).decode()
        if seen and there == seen:  # (the key is absent)
            seen = ""
            continue
        found = passed(there)
        if found is None:
            return there, skipped
        if found[0] >= step and found[1] != rank:
            skipped = found
        seen = there
