"""Checkpoints: the state a restarted run needs to continue exactly where it was.

A cockpit's state is every quantity's own state (keyed by quantity key; e.g.
Distance's start point and the pending starts of two-step quantities such as
UpdateSize and Alpha), the history so far, the last step seen, the optimizer's
name and the state of the random source of Hutchinson estimates (so that a resumed
run draws the probes the uninterrupted run would have drawn). It also describes
what it can be loaded into: the shape and dtype of every parameter and the class
of every quantity, checked by :func:`load_cockpit_state` before anything is
restored (the first mismatch is named).
:meth:`Cockpit.state_dict <cockpit.Cockpit.state_dict>` and
:meth:`Cockpit.load_state_dict <cockpit.Cockpit.load_state_dict>` use these
functions.
"""

from __future__ import annotations

import warnings
from typing import Any, Mapping

import torch

from cockpit.errors import CockpitWarning
from cockpit.log.format import ESTIMATE_SUFFIX

#: Version of the dictionary returned by :func:`cockpit_state`. Optional keys added
#: later (``"estimate_generator"``) leave it unchanged: older readers ignore them and
#: this reader fills in their defaults.
STATE_VERSION = 1
#: Key of the state of the Hutchinson probes' random source (a ``uint8`` tensor
#: from ``torch.Generator.get_state()``).
GENERATOR_KEY = "estimate_generator"
#: Key of the parameters' shapes and dtypes (``[{"shape": [...], "dtype": str}]``).
PARAMS_KEY = "params"
#: Key of the quantities' classes (``{key: class name}``).
TYPES_KEY = "quantity_types"


def cockpit_state(cockpit) -> dict[str, Any]:
    """Return the state of ``cockpit`` as a dictionary of tensors and plain values.

    Raises:
        RuntimeError: Inside an open step (between ``begin`` and ``end``): the
            step's values are not recorded yet, so a run resumed from it would
            go on without them.
    """
    if cockpit.open_step is not None:
        raise RuntimeError(
            f"Cockpit.state_dict() was called while step {cockpit.open_step} is "
            "open, so the state would lack that step's values and a resumed run "
            "would go on without them. Fix: save the state after the step's "
            "`with cockpit(...)` block (after cockpit.end()), e.g. after "
            "optimizer.step()."
        )
    return {
        "version": STATE_VERSION,
        PARAMS_KEY: [
            {"shape": list(p.shape), "dtype": _dtype_name(p.dtype)}
            for p in cockpit.params
        ],
        TYPES_KEY: {q.key: type(q).__name__ for q in cockpit.quantities},
        "last_step": cockpit.last_step,
        "optimizer_name": cockpit.optimizer_name,
        "quantities": {q.key: q.state_dict() for q in cockpit.quantities},
        "history": cockpit.history.state_dict(),
        GENERATOR_KEY: cockpit._router.generator.get_state(),
    }


def load_cockpit_state(cockpit, state: Mapping[str, Any], strict: bool = True) -> None:
    """Restore ``state`` (from :func:`cockpit_state`) into ``cockpit``.

    Create the Cockpit with the same quantities (and ``logpath``, to append to the
    same streamed log). Records that the interrupted run streamed for steps after
    the checkpoint are superseded by those of the resumed run.

    A state without the random source of Hutchinson estimates (saved by an older
    cockpit) keeps the fresh cockpit's source (seeded with 0): estimates after the
    checkpoint are as unbiased, but drawn with other probes than the uninterrupted
    run's. If the saved history holds estimates, a
    :class:`~cockpit.errors.CockpitWarning` says so (runs without estimates are
    unaffected and are not warned).

    Args:
        cockpit: The cockpit of the resumed run.
        state: The saved dictionary.
        strict: Require the same quantity keys in ``state`` and the cockpit.

    Raises:
        ValueError: If ``state`` is not a cockpit state, if the parameters differ
            in number, shape or dtype from those it was saved with, or (with
            ``strict``) the quantity keys or classes differ; the message names
            the first mismatch. Nothing is restored then.
        RuntimeError: Inside an open step.
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
    if cockpit.open_step is not None:
        raise RuntimeError(
            f"Cockpit.load_state_dict() was called while step {cockpit.open_step} "
            "is open. Fix: load the state before the first step of the resumed "
            "run (or after cockpit.end())."
        )
    check_params(cockpit, state.get(PARAMS_KEY))
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
    classes = check_quantity_types(cockpit, state.get(TYPES_KEY) or {}, strict)
    generator = state.get(GENERATOR_KEY)
    if generator is not None:
        try:
            restored = _generator_with(generator, cockpit._router.generator.device)
        except (TypeError, RuntimeError) as error:
            raise ValueError(
                f"The cockpit state's {GENERATOR_KEY!r} is not a state of "
                f"torch.Generator ({error}). Fix: pass the dictionary of "
                "Cockpit.state_dict() unchanged (torch.save/torch.load keep it)."
            ) from None
    for quantity in cockpit.quantities:
        if quantity.key in saved and quantity.key not in classes:
            quantity.load_state_dict(saved[quantity.key])
    cockpit.history.load_state_dict(state.get("history") or {})
    cockpit.last_step = state.get("last_step")
    cockpit.optimizer_name = state.get("optimizer_name", cockpit.optimizer_name)
    saved_keys = set(cockpit.history.keys)
    if generator is not None:
        cockpit._router.generator = restored
    elif any(  # a state of an older cockpit, of a run with estimates
        f"{q.key}{ESTIMATE_SUFFIX}" in saved_keys for q in cockpit.quantities
    ):
        warnings.warn(
            "The cockpit state has no random source of the Hutchinson estimates (it "
            "was saved by an older cockpit), so estimates after step "
            f"{cockpit.last_step} are drawn with other probes than the uninterrupted "
            "run's (as unbiased, not identical). Nothing to fix for this run; "
            "checkpoints of this cockpit save it.",
            CockpitWarning,
            stacklevel=3,
        )


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def check_params(cockpit, saved) -> None:
    """Raise ``ValueError`` naming the first parameter that differs from ``saved``.

    ``saved`` is the state's list of shapes and dtypes (``None`` in states of
    older cockpits, which are not checked).
    """
    if saved is None:
        return
    params = cockpit.params
    fix = (
        "Fix: create the Cockpit with the parameters of the model the state was "
        "saved with (same architecture, same dtype, same order: model.parameters() "
        "after loading the model's own checkpoint), or start a new run without "
        "the cockpit state."
    )
    if len(saved) != len(params):
        raise ValueError(
            f"The cockpit state was saved with {len(saved)} parameter tensors, this "
            f"cockpit has {len(params)}. {fix}"
        )
    for index, (entry, param) in enumerate(zip(saved, params, strict=True)):
        shape, dtype = tuple(entry["shape"]), entry["dtype"]
        label = cockpit._checks.param_label(index)
        if shape != tuple(param.shape):
            raise ValueError(
                f"Parameter {label} has shape {tuple(param.shape)}, but shape "
                f"{shape} in the cockpit state. {fix}"
            )
        if dtype != _dtype_name(param.dtype):
            raise ValueError(
                f"Parameter {label} has dtype {_dtype_name(param.dtype)}, but "
                f"{dtype} in the cockpit state. {fix}"
            )


def check_quantity_types(cockpit, saved: Mapping[str, str], strict: bool) -> set:
    """The keys whose quantity is of another class than in the state.

    Raises:
        ValueError: With ``strict``, naming the first such quantity.
    """
    other = set()
    for quantity in cockpit.quantities:
        name = saved.get(quantity.key)
        if name is None or name == type(quantity).__name__:
            continue
        if strict:
            raise ValueError(
                f"Quantity {quantity.key!r} is a {type(quantity).__name__} here but "
                f"a {name} in the cockpit state. Fix: create the Cockpit with the "
                "quantities of the saved run, or pass strict=False to start this "
                "one afresh."
            )
        other.add(quantity.key)
    return other


def _generator_with(state, device) -> torch.Generator:
    """A generator in ``state``, on ``device`` if the state is of one there.

    Else on the CPU (a state saved on another device): the draws go on from it
    there, and are moved where they are used.
    """
    try:
        return torch.Generator(device=device).set_state(state)
    except (TypeError, RuntimeError):
        return torch.Generator().set_state(state)
