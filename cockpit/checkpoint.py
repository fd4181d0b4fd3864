"""Checkpoints: the state a restarted run needs to continue exactly where it was.

A cockpit's state is every quantity's own state (keyed by quantity key; e.g.
Distance's start point and the pending starts of two-step quantities such as
UpdateSize and Alpha), the history so far, the last step seen and the optimizer's
name. :meth:`Cockpit.state_dict <cockpit.Cockpit.state_dict>` and
:meth:`Cockpit.load_state_dict <cockpit.Cockpit.load_state_dict>` use these
functions.
"""

from __future__ import annotations

from typing import Any, Mapping

#: Version of the dictionary returned by :func:`cockpit_state`.
STATE_VERSION = 1


def cockpit_state(cockpit) -> dict[str, Any]:
    """Return the state of ``cockpit`` as a dictionary of tensors and plain values."""
    return {
        "version": STATE_VERSION,
        "last_step": cockpit.last_step,
        "optimizer_name": cockpit.optimizer_name,
        "quantities": {q.key: q.state_dict() for q in cockpit.quantities},
        "history": cockpit.history.state_dict(),
    }


def load_cockpit_state(cockpit, state: Mapping[str, Any], strict: bool = True) -> None:
    """Restore ``state`` (from :func:`cockpit_state`) into ``cockpit``.

    Create the Cockpit with the same quantities (and ``logpath``, to append to the
    same streamed log). Records that the interrupted run streamed for steps after
    the checkpoint are superseded by those of the resumed run.

    Args:
        cockpit: The cockpit of the resumed run.
        state: The saved dictionary.
        strict: Require the same quantity keys in ``state`` and the cockpit.

    Raises:
        ValueError: If ``state`` is not a cockpit state, or (with ``strict``) the
            quantity keys differ.
    """
    if not isinstance(state, Mapping) or "quantities" not in state:
        keys = f" with keys {sorted(state)}" if isinstance(state, Mapping) else ""
        raise ValueError(
            f"Expected a dictionary from Cockpit.state_dict(), got "
            f"{type(state).__name__}{keys}. Fix: save cockpit.state_dict() and "
            "pass that dictionary."
        )
    version = state.get("version", STATE_VERSION)
    if version > STATE_VERSION:
        raise ValueError(
            f"The cockpit state has version {version}, newer than this cockpit "
            f"reads ({STATE_VERSION}). Fix: upgrade cockpit."
        )
    saved = state["quantities"]
    keys = [q.key for q in cockpit.quantities]
    missing = sorted(set(keys) - set(saved))
    unexpected = sorted(set(saved) - set(keys))
    if strict and (missing or unexpected):
        raise ValueError(
            f"The cockpit state does not match the quantities: missing "
            f"{missing}, unexpected {unexpected}. Fix: create the Cockpit with "
            "the quantities (and keys) of the saved run, or pass strict=False "
            "to start the missing ones afresh and ignore the unexpected ones."
        )
    for quantity in cockpit.quantities:
        if quantity.key in saved:
            quantity.load_state_dict(saved[quantity.key])
    cockpit.history.load_state_dict(state.get("history") or {})
    cockpit.last_step = state.get("last_step")
    cockpit.optimizer_name = state.get("optimizer_name", cockpit.optimizer_name)
