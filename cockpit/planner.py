"""What one step does, decided once per step from the quantities' declarations.

:func:`plan_step` is pure: it reads what each quantity declares for the step (is it
active, what it needs, which ``info`` keys it reads) and returns a :class:`StepPlan`:
the union of the needs, whether ``loss.backward`` must keep the graph, who reads
inside the backward pass, who runs after the engine's cleanup, and which engine
extensions serve it all. The cockpit computes it once per step (``create_graph`` and
the step itself share it).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterable, Sequence

from cockpit import needs as N
from cockpit.engines import backpack as engine
from cockpit.needs import Need
from cockpit.quantities.base import Quantity


@dataclass(frozen=True)
class BackwardSetup:
    """The engine's part of a step, once the user's extra extensions are known.

    Attributes:
        extensions: The merged extensions (the user's first).
        free_in_hook: Savefields deleted as soon as a parameter has been read.
        free_after: Savefields deleted after the quantities were tracked (those of
            1.0.2-style quantities, which read them when tracked).
        needed: Savefields the quantities read (a module without them is unsupported).
    """

    extensions: tuple
    free_in_hook: tuple[str, ...]
    free_after: tuple[str, ...]
    needed: tuple[str, ...]


@dataclass(frozen=True)
class StepPlan:
    """What the quantities ask of one step.

    Attributes:
        global_step: The step.
        active: Quantities doing any work at the step, in order.
        needs: The union of their needs.
        create_graph: Whether ``loss.backward`` needs ``create_graph=True``.
        consumers: Active quantities that read inside the backward pass.
        requested: Engine extensions the quantities' needs ask for.
        legacy: Extensions 1.0.2-style quantities return from ``extensions()``.
        low_precision: Some parameters are half precision (see
            :func:`cockpit.engines.backpack.extensions_for`).
    """

    global_step: int
    active: tuple[Quantity, ...]
    needs: frozenset[Need]
    create_graph: bool
    consumers: tuple[Quantity, ...]
    requested: tuple
    legacy: tuple
    low_precision: bool = False

    @property
    def first(self) -> tuple[Quantity, ...]:
        """Active quantities tracked before the engine's cleanup."""
        return tuple(q for q in self.active if not q.after_cleanup)

    @property
    def last(self) -> tuple[Quantity, ...]:
        """Active quantities tracked after the cleanup, engine off (e.g. HVPs)."""
        return tuple(q for q in self.active if q.after_cleanup)

    def required_info(self) -> list[tuple[str, str]]:
        """Return ``(info key, quantity key)`` for every key an active one reads."""
        return [
            (key, q.key)
            for q in self.active
            for key in q.required_info(self.global_step)
        ]

    def backward_setup(self, user: Sequence = ()) -> BackwardSetup:
        """Merge the user's extra extensions with the step's and say what to free.

        Raises:
            TypeError: If a user extension is not a BackPACK extension.
            ValueError: On conflicting extensions.
        """
        requested = list(self.requested) + list(self.legacy)
        merged = engine.merge_extensions(list(user), requested)
        protected = set(engine.savefields(user))
        late = set(engine.savefields(self.legacy)) - protected
        owned = [f for f in engine.savefields(merged) if f not in protected]
        return BackwardSetup(
            extensions=tuple(merged),
            free_in_hook=tuple(f for f in owned if f not in late),
            free_after=tuple(owned),
            needed=tuple(sorted(set(engine.savefields(requested)))),
        )

    def without(self, dropped: Iterable[Quantity]) -> StepPlan:
        """Return the plan with ``dropped`` quantities left out of the step.

        ``create_graph`` is kept: the user's backward pass already asked for it.
        """
        gone = {id(q) for q in dropped}
        kept = [q for q in self.active if id(q) not in gone]
        return replace(
            plan_step(kept, self.global_step, self.low_precision),
            create_graph=self.create_graph,
        )

    def who_needs(self, savefields: Iterable[str]) -> str:
        """Name the active quantities that read any of ``savefields`` (messages)."""
        savefields = set(savefields)
        if savefields & engine.FIRST_ORDER_SAVEFIELDS:
            savefields |= engine.FIRST_ORDER_SAVEFIELDS
        wanted = set().union(*(engine.SAVEFIELD_NEEDS.get(f, ()) for f in savefields))
        names = []
        for q in self.active:
            legacy = set(engine.savefields(q.extensions(self.global_step)))
            if q.needs_at(self.global_step) & wanted or legacy & savefields:
                names.append(q.key)
        return ", ".join(names) if names else "your extra extensions"


def plan_step(
    quantities: Iterable[Quantity], global_step: int, low_precision: bool = False
) -> StepPlan:
    """Return the plan of ``global_step`` for ``quantities`` (no side effects).

    ``low_precision``: some parameters are bfloat16 or float16.
    """
    active = tuple(q for q in quantities if q.is_active(global_step))
    needs = frozenset().union(*(q.needs_at(global_step) for q in active))
    legacy = tuple(ext for q in active for ext in q.extensions(global_step))
    return StepPlan(
        global_step=global_step,
        active=active,
        needs=needs,
        create_graph=any(q.create_graph(global_step) for q in active),
        consumers=tuple(q for q in active if N.in_backward(q.needs_at(global_step))),
        requested=tuple(engine.extensions_for(needs, low_precision)),
        legacy=legacy,
        low_precision=low_precision,
    )
