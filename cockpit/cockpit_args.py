"""What the user hands the :class:`~cockpit.Cockpit`, checked with errors that fix.

Parameters (:func:`collect_params`), quantities (:func:`check_quantities`,
:func:`check_new_quantity`), the writing rank (:func:`check_log_rank`), the order
of the steps (:func:`check_step_order`) and the values a loop records as missing
by hand (:func:`manual_missing`).
"""

from __future__ import annotations

import operator
import warnings
from typing import Any, Iterable

from torch import Tensor

from cockpit.distributed import sharded
from cockpit.errors import CockpitWarning
from cockpit.quantities.base import Quantity


def as_step(global_step) -> int:
    """Return ``global_step`` as an int, or say how to pass it."""
    try:
        return operator.index(global_step)
    except TypeError:
        raise TypeError(
            f"global_step must be an int, got {global_step!r}. Fix: pass the "
            "iteration counter, e.g. cockpit(step, info=...) with step an int."
        ) from None


def check_step_order(global_step: int, last_step: int | None) -> None:
    """Raise ``ValueError`` unless ``global_step`` comes after ``last_step``.

    ``last_step`` is the last step the cockpit tracked to the end (a step
    abandoned on an error does not count: it can be tried again), or the step a
    checkpoint was taken at after :meth:`Cockpit.load_state_dict
    <cockpit.Cockpit.load_state_dict>`. A repeated or smaller step would make
    two-step quantities (UpdateSize, Alpha) span the wrong updates, and the
    history and the log hold one record per step.
    """
    if last_step is not None and global_step <= last_step:
        raise ValueError(
            f"Step {global_step} does not come after step {last_step}, the last "
            "step this cockpit tracked: step numbers must increase (a repeated or "
            "smaller one would make UpdateSize and Alpha span the wrong updates). "
            "Fix: pass a global step counter that "
            "keeps growing across epochs; to start the loop over, create a new "
            "Cockpit (with a new logpath); to go on from a checkpoint, call "
            "cockpit.load_state_dict(state) with the state saved there."
        )


def collect_params(params: Iterable) -> tuple[list[Tensor], list[str | None]]:
    """The trainable parameters (and names) of ``params``; frozen ones warned.

    Raises:
        TypeError: If an item is not a tensor.
        ValueError: If a tensor is given twice, or none requires gradients.
    """
    kept: list[Tensor] = []
    names: list[str | None] = []
    frozen: list[str] = []
    for i, item in enumerate(params):
        name = None
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
            name, item = item
        label = f"Parameter #{i}" + (f" ({name!r})" if name else "")
        if not isinstance(item, Tensor):
            raise TypeError(
                f"{label} is a {type(item).__name__}, not a tensor. Fix: pass "
                "model.parameters() or model.named_parameters()."
            )
        seen = [j for j, other in enumerate(kept) if other is item]
        if seen:
            raise ValueError(
                f"{label} is the same tensor as parameter #{seen[0]}. Fix: pass each "
                "parameter once (model.parameters() already skips tied weights)."
            )
        if item.requires_grad:
            kept.append(item)
            names.append(name)
        else:
            frozen.append(f"{label} (shape {tuple(item.shape)})")
    if not kept:
        what = (
            f"none of its {len(frozen)} parameters requires gradients (e.g. "
            f"{frozen[0]} does not require gradients)"
            if frozen
            else "no parameters"
        )
        raise ValueError(
            f"The Cockpit got {what}, so it can never track anything. Fix: pass "
            "the model's trainable parameters, e.g. "
            "Cockpit(model.parameters(), quantities=...)."
        )
    if frozen:
        warnings.warn(
            f"The Cockpit skips {len(frozen)} frozen parameter(s) (they do not "
            f"require gradients): {', '.join(frozen[:3])}"
            f"{', ...' if len(frozen) > 3 else ''}. It tracks the "
            f"{len(kept)} trainable one(s). Nothing to fix if that is intended.",
            CockpitWarning,
            stacklevel=3,
        )
    return kept, names


def check_log_rank(log_rank, size: int | None) -> int:
    """``log_rank`` as an int naming a process of a group of ``size`` (if any)."""
    if isinstance(log_rank, bool) or not hasattr(type(log_rank), "__index__"):
        raise TypeError(f"log_rank must be an int, got {log_rank!r}.")
    log_rank = operator.index(log_rank)
    if size is not None and not 0 <= log_rank < size:
        raise ValueError(
            f"log_rank={log_rank} names no process of this data-parallel "
            f"group of {size} (ranks 0 to {size - 1}, within the group), so "
            "no process would write the log. Fix: pass a rank of the group, "
            "e.g. log_rank=0."
        )
    return log_rank


def check_quantities(quantities) -> list[Quantity]:
    """The list of quantities handed to ``Cockpit(...)`` (``None``: none yet)."""
    if isinstance(quantities, Quantity):
        raise TypeError(
            f"quantities must be a list of Quantity instances, got the single "
            f"quantity {quantities!r}. Fix: Cockpit(params, quantities=[...])."
        )
    if quantities is None:
        return []
    quantities = list(quantities)
    if not quantities:
        raise ValueError(
            "The Cockpit got an empty list of quantities, so it would track "
            "nothing. Fix: pass some, e.g. quantities=configuration('economy') "
            "(from cockpit.utils.configuration), or leave quantities out and "
            "call cockpit.add(quantity) later."
        )
    return quantities


def check_new_quantity(quantity, existing: Iterable[Quantity]) -> None:
    """Raise ``ValueError`` unless ``quantity`` is a quantity with a new key."""
    if not isinstance(quantity, Quantity):
        hint = (
            " (a class was passed: instantiate it, e.g. GradNorm(linear(1)))"
            if isinstance(quantity, type)
            else ""
        )
        raise ValueError(
            f"Only cockpit.quantities.Quantity instances can be added, got "
            f"{quantity!r}{hint}."
        )
    for other in existing:
        if other.key == quantity.key:
            raise ValueError(
                f"Two quantities share the key {quantity.key!r}: {other!r} and "
                f"{quantity!r}. Give one a distinct key, e.g. "
                f"{type(quantity).__name__}(..., key='{quantity.key}2')."
            )


def manual_missing(cockpit, step: int, quantities, reason, cause: Any) -> None:
    """Check and record :meth:`Cockpit.missing <cockpit.Cockpit.missing>`'s values."""
    if not isinstance(reason, str):
        raise TypeError(
            f"reason must be a string, got {reason!r}. Fix: say why the values "
            "are missing, e.g. cockpit.missing(step, ['Alpha'], 'the update was "
            "clipped. Fix: ...')."
        )
    if not reason.strip():
        raise ValueError(
            "reason is empty. Fix: say why the values are missing (and the fix), "
            "it is what the log and the warning show."
        )
    if cockpit.open_step is not None:
        raise RuntimeError(
            f"Cockpit.missing() was called while step {cockpit.open_step} is open. "
            "Fix: call it before cockpit.begin() or after cockpit.end()."
        )
    chosen = _quantities_of(cockpit.quantities, quantities)
    if step in cockpit.history:
        recorded = cockpit.history.view(step)
        taken = [q.key for q in chosen if q.key in recorded]
        if taken:
            raise ValueError(
                f"{', '.join(taken)} already has a value at step {step}, so it "
                "cannot be missing there. Fix: call cockpit.missing() for values "
                "that were not recorded (e.g. right after cockpit.end() for a "
                "value that a later step would finish, such as Alpha)."
            )
    for q in chosen:
        q.discard_start(step)
        cockpit._checks.missing(
            cockpit.recorder,
            [step],
            q.key,
            reason,
            once=("missing", q.key, reason if cause is None else cause),
            stacklevel=5,  # the caller of Cockpit.missing
        )
    cockpit.recorder.flush()


def _quantities_of(own: list[Quantity], quantities) -> list[Quantity]:
    """The quantities of ``own`` named by ``quantities`` (objects or keys)."""
    if isinstance(quantities, (Quantity, str)):
        quantities = [quantities]
    by_key = {q.key: q for q in own}
    chosen: list[Quantity] = []
    for item in quantities:
        if isinstance(item, str):
            quantity = by_key.get(item)
            what = f"key {item!r}"
        elif isinstance(item, Quantity):
            quantity = item if any(q is item for q in own) else None
            what = f"quantity {item!r}"
        else:
            raise TypeError(
                f"Cockpit.missing() takes quantities or their keys, got {item!r}. "
                "Fix: pass e.g. [quantity] or ['Alpha']."
            )
        if quantity is None:
            raise ValueError(
                f"Cockpit.missing() got the {what}, which is not one of this "
                f"cockpit's quantities (keys: {sorted(by_key)}). Fix: pass one "
                "of those keys or quantities (cockpit.quantities)."
            )
        if all(q is not quantity for q in chosen):
            chosen.append(quantity)
    return chosen


def sharded_layout(params, names, cockpit):
    """The FSDP2 layout of ``params`` (``None``: plain tensors); others refused.

    The layout is handed to the cockpit's communicator (its set-up fingerprint
    and the step's joining read it).

    Raises:
        ValueError: For a ``DTensor`` layout cockpit cannot serve, or sharded
            parameters without a data-parallel group over the mesh's processes
            (on every process: each makes its Cockpit from the same model).
    """
    from cockpit.step.checks import param_label

    labels = [param_label(i, p, n) for i, (p, n) in enumerate(zip(params, names))]
    comm = cockpit._communicator
    group = comm.user_group if cockpit.data_parallel else None
    layout = sharded.sharding(params, labels, group)
    if comm is not None:
        comm.sharding = layout
    return layout


def make_router(params, layout):
    """The cockpit's router; with FSDP2, over the unsharded parameters."""
    from cockpit.engines.base import engine_classes
    from cockpit.engines.modules import ModuleMap, discover
    from cockpit.engines.routing import Router

    if layout is None:
        return Router(params)
    found = discover(params)  # the modules hold the sharded ones now
    modules = ModuleMap(layout.remap(found.owners), found.parents)
    engines = [cls for cls in engine_classes() if cls.__name__ in SHARDED_ENGINES]
    _take_off_backpack(found)
    return Router(layout.engine_params(), engines=engines, modules=modules)


def _take_off_backpack(found) -> None:
    """BackPACK's hooks off the sharded model (``extend`` left them; none serve).

    Without them an extended model runs as it would unextended (BackPACK would
    store each module's output as ``module.output``, a clash in Hugging Face
    models, and keep inputs between the forward and the backward pass).
    """
    from cockpit.engines.backpack import hooks

    owners = [m for found_ in found.owners.values() for m, _ in found_]
    seen, stack, roots = set(), list(owners), []
    while stack:
        module = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        above = found.parents.get(id(module), [])
        stack.extend(above)
        if not above:
            roots.append(module)
    modules = {id(m): m for root in roots for m in root.modules()}
    reason = "fully_shard: cockpit serves FSDP2 models without BackPACK"
    hooks.rewire(list(modules.values()), lambda module: (hooks.TAKEN_OFF, reason))


#: The engines that serve FSDP2 parameters. The ghost engine forms per-sample
#: results from a layer's input and output gradient inside FSDP's backward pass;
#: the autograd engine differentiates the per-sample losses before it (FSDP
#: unshards each unit for those passes too). BackPACK's hooks miss the last layer
#: of a unit wrapped with the root (measured: no results for it), and the replay
#: engine would run modules outside FSDP's forward, where their parameters are
#: resharded.
SHARDED_ENGINES = ("GhostEngine", "AutogradEngine")
