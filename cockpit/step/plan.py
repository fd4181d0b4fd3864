"""What one step does, decided once per step from the quantities' declarations.

:func:`plan_step` is pure: it reads what each quantity declares for the step (is it
active, what it needs, which ``info`` keys it reads) and returns a :class:`StepPlan`:
the union of the needs, whether ``loss.backward`` must keep the graph, who reads
inside the backward pass and who runs after the engines' cleanup. The cockpit
computes it once per step (``create_graph`` and the step itself share it); the
engines turn the needs into their own work.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Iterable, Mapping

from cockpit import needs as N
from cockpit.needs import Need
from cockpit.quantities.base import Quantity


@dataclass(frozen=True)
class StepPlan:
    """What the quantities ask of one step.

    Attributes:
        global_step: The step.
        active: Quantities doing any work at the step, in order.
        needs: The union of their needs.
        create_graph: Whether ``loss.backward`` needs ``create_graph=True``.
        consumers: Active quantities that read inside the backward pass.
        legacy: What 1.0.2-style quantities return from ``extensions()`` (BackPACK
            extensions, run by the BackPACK engine).
        low_precision: Some parameters are half precision.
        estimated: The curvature is estimated at this step (no engine forms it).
        wants: ``id(quantity)`` -> what it needs at the step (read with
            :meth:`needs_of`; asked of each quantity once).
    """

    global_step: int
    active: tuple[Quantity, ...]
    needs: frozenset[Need]
    create_graph: bool
    consumers: tuple[Quantity, ...]
    legacy: tuple
    low_precision: bool = False
    estimated: bool = False
    wants: Mapping[int, frozenset[Need]] = field(default_factory=dict)

    def needs_of(self, quantity: Quantity) -> frozenset[Need]:
        """What an active ``quantity`` needs at the step (nothing if inactive)."""
        return self.wants.get(id(quantity), frozenset())

    @property
    def first(self) -> tuple[Quantity, ...]:
        """Active quantities tracked before the engines' cleanup."""
        return tuple(q for q in self.active if not q.after_cleanup)

    @property
    def last(self) -> tuple[Quantity, ...]:
        """Active quantities tracked after the cleanup, engines off (e.g. HVPs)."""
        return tuple(q for q in self.active if q.after_cleanup)

    @cached_property
    def requested(self) -> tuple:
        """The BackPACK extensions that serve the needs (asked of its engine)."""
        from cockpit.engines.backpack.api import extensions_for, first_order

        extensions = extensions_for(self.needs, self.low_precision)
        return tuple(first_order(extensions) if self.estimated else extensions)

    def required_info(self) -> list[tuple[str, str]]:
        """Return ``(info key, quantity key)`` for every key an active one reads."""
        return [
            (key, q.key)
            for q in self.active
            for key in q.required_info(self.global_step)
        ]

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


def plan_step(
    quantities: Iterable[Quantity], global_step: int, low_precision: bool = False
) -> StepPlan:
    """Return the plan of ``global_step`` for ``quantities`` (no side effects).

    ``low_precision``: some parameters are bfloat16 or float16.
    """
    active = tuple(q for q in quantities if q.is_active(global_step))
    wants = {id(q): q.needs_at(global_step) for q in active}
    return StepPlan(
        global_step=global_step,
        active=active,
        needs=frozenset().union(*wants.values()),
        create_graph=any(q.create_graph(global_step) for q in active),
        consumers=tuple(q for q in active if N.in_backward(wants[id(q)])),
        legacy=tuple(ext for q in active for ext in q.extensions(global_step)),
        low_precision=low_precision,
        wants=wants,
    )
