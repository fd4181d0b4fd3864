"""Which engine computes each parameter's per-sample results, step by step.

Like opacus' grad samplers (a registry of fast per-layer rules and a generic
fallback), the :class:`Router` asks the registered engines
(:func:`cockpit.engines.base.engine_classes`, in their declared order) which
parameters they serve: BackPACK where its layer rules are known to be right
(:mod:`cockpit.engines.backpack.routing`), then the replay engine, then the batched
autograd engine, which serves any parameter. A parameter the per-sample losses do
not depend on is :data:`UNUSED` (exact zeros). Each route keeps the reasons of the
engines that declined (:class:`~cockpit.engines.base.Decline`), for
:meth:`Cockpit.coverage <cockpit.Cockpit.coverage>`.
"""

from __future__ import annotations

from typing import Sequence

from torch import Tensor
from torch.nn import Module

from cockpit.curvature.hutchinson import seeded_generator
from cockpit.engines.base import (
    AUTOGRAD,
    BACKPACK,
    PER_SAMPLE_BACKWARD,
    REPLAY,
    UNUSED,
    Decline,
    Engine,
    EngineStep,
    Route,
    Why,
    engine_classes,
    first_claims,
)
from cockpit.engines.modules import ModuleMap, ancestors, describe, discover, graph_uses

__all__ = [
    "AUTOGRAD",
    "BACKPACK",
    "PER_SAMPLE_BACKWARD",
    "REPLAY",
    "UNUSED",
    "Route",
    "Router",
]

_UNUSED = Decline(Why.UNUSED, "the per-sample losses do not depend on it")


class Router:
    """Decides, per step, which engine computes each parameter's results.

    Args:
        params: The cockpit's parameters.
        engines: Engine classes to try, in order (default: the registered ones).
        modules: The module map, where it cannot be discovered from ``params``
            (FSDP2's unsharded parameters sit in their modules only inside a
            unit's forward and backward pass; see ``cockpit.distributed.sharded``).
    """

    def __init__(self, params: Sequence[Tensor], engines=None, modules=None):
        self.params = params
        self._map: ModuleMap | None = modules
        self._engine_classes = list(engines or engine_classes())
        self._engines: list[Engine] | None = None
        #: Random source of estimates (seeded: runs are reproducible), on the
        #: parameters' device: probes and labels are drawn where they are used.
        self.generator = seeded_generator(params[0].device if params else None, 0)
        #: ``(key, report)`` of the latest step's coverage (rebuilt when it changes).
        self.coverage_cache: tuple | None = None

    @property
    def modules(self) -> ModuleMap:
        """The module map (discovered on first use)."""
        if self._map is None:
            self._map = discover(self.params)
        return self._map

    @property
    def engines(self) -> list[Engine]:
        """The engines of this cockpit, in the order they are tried."""
        if self._engines is None:
            self._engines = [
                cls(self.params, self.modules) for cls in self._engine_classes
            ]
        return self._engines

    def engine(self, name_or_class) -> Engine | None:
        """The first engine of a class (or with a name), if this cockpit has one."""
        for engine in self.engines:
            if isinstance(name_or_class, str):
                if engine.name == name_or_class:
                    return engine
            elif isinstance(engine, name_or_class):
                return engine
        return None

    def label(self, index: int) -> str:
        """The owning module and attribute of parameter ``index`` (first owner)."""
        owners = self.modules.owners.get(id(self.params[index]), [])
        return describe(*owners[0]) if owners else ""

    # --- routes ----------------------------------------------------------------------
    def static_routes(self, needs: frozenset = frozenset()) -> list[Route]:
        """Routes from the model's structure alone (before a step, for the report)."""
        step = EngineStep(-1, self.params, needs=frozenset(needs))
        return self._claims(step, range(len(self.params)), [None] * len(self.params))

    def route(self, step: EngineStep) -> list[Route]:
        """Route every parameter at ``step`` (fills ``step.nodes``/``step.uses``).

        The graph of the per-sample losses decides which parameters are unused;
        the mini-batch loss's graph stands in where the per-sample losses have
        none (uses are still counted; the sample axis cannot be checked then).
        """
        root = None
        if step.losses is not None:
            root = step.losses
        elif isinstance(step.loss, Tensor) and step.loss.grad_fn is not None:
            root = step.loss
        routes: list[Route | None] = [None] * len(self.params)
        if root is not None:
            step.nodes, step.uses = graph_uses([root.grad_fn])
            for index, param in enumerate(self.params):
                if step.uses.get(id(param), 0) == 0:
                    routes[index] = Route(UNUSED, (_UNUSED,), self.label(index))
        pending = [i for i, r in enumerate(routes) if r is None]
        return self._claims(step, pending, routes)

    def _claims(self, step, pending, routes) -> list[Route]:
        for index, (engine, declines) in first_claims(
            self.engines, step, list(pending)
        ).items():
            name = engine.name if engine is not None else "none"
            routes[index] = Route(name, declines, self.label(index))
        return routes

    def curvature_decline(self, routes: Sequence[Route], step) -> Decline | None:
        """Why no engine can give the step's curvature diagonals (``None``: one can).

        The decline of the first engine that forms curvature at all.
        """
        declines = []
        for engine in self.engines:
            decline = engine.curvature_decline(routes, step)
            if decline is None:
                return None
            if decline is not NotImplemented:
                declines.append(decline)
        if declines:
            return declines[0]
        return Decline(Why.NO_RULE, "no engine forms curvature diagonals")

    def start(self) -> None:
        """Show the engines the routes from the model's structure (cockpit made)."""
        routes = self.static_routes()
        for engine in self.engines:
            engine.watch(routes)

    def chain(self, param: Tensor) -> list[Module]:
        """``param``'s (first) owner and the modules containing it, innermost first."""
        owners = self.modules.owners.get(id(param), [])
        return ancestors(owners[0][0], self.modules.parents) if owners else []

    def forget(self) -> None:
        """Let every engine drop what the step's forward pass left."""
        for engine in self._engines or []:
            engine.forget()

    def close(self) -> None:
        """Remove the engines' hooks."""
        for engine in self._engines or []:
            engine.close()
