"""The engine interface: who computes each parameter's per-sample results.

An *engine* computes what the quantities read for the parameters it serves
(per-sample gradients, their norms, curvature diagonals) and hands it to them as
:class:`~cockpit.param_view.ParamView` s through :meth:`EngineStep.show`. At every
step the router (:class:`cockpit.engines.routing.Router`) asks the registered
engines in their declared order which parameters they can serve; the first that
claims a parameter gets it, and the reasons of those that declined are kept as
:class:`Decline` values (shown by ``Cockpit.coverage()``, never matched as text).

An engine works in one of two places (or both):

* before the user's ``loss.backward()`` (:meth:`Engine.before_backward`), from the
  graph of the per-sample losses, which that backward pass frees (the replay and
  the batched autograd engines);
* inside it (:meth:`Engine.backward_context`), e.g. with module hooks (BackPACK).

A new engine is a new file: subclass :class:`Engine` and decorate it with
:func:`register_engine`; ``docs/architecture.md`` shows one in twenty lines.
"""

from __future__ import annotations

import contextlib
import enum
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Iterable, Sequence

from torch import Tensor

#: Engine names as shown in the coverage report.
BACKPACK = "backpack"
AUTOGRAD = "autograd"
UNUSED = "unused"
#: Method of a parameter replayed within a module (``"replay of <class>"``).
REPLAY = "replay of"
#: Method of a parameter differentiated through the whole graph, sample by sample.
PER_SAMPLE_BACKWARD = "one batched backward pass per sample"
#: Numbers of per-sample gradients (``N * sum numel``) an engine holds at once
#: where the step's options do not say (``EngineStep.options["max_elements"]``,
#: which :class:`~cockpit.Cockpit` sets from ``PER_SAMPLE_MAX_ELEMENTS``).
DEFAULT_MAX_ELEMENTS = 1 << 26


class Why(enum.Enum):
    """Why an engine declines a parameter (the kinds of :class:`Decline`)."""

    FREE_TENSOR = "not owned by any module"
    TIED = "owned by several modules"
    NOT_EXTENDED = "module not extended"
    NO_RULE = "no rule for the module"
    SHARED_USE = "used more than once"
    NOT_RUN = "module did not run"
    AUTOCAST = "ran under torch.autocast"
    MIXED_BY_BATCHNORM = "samples mix through a batch norm after it"
    SAMPLE_AXIS = "first axis is not the sample axis"
    NO_LOSSES = "no per-sample losses with their graph"
    UNUSED = "the losses do not depend on it"
    OTHER = "other"


@dataclass(frozen=True)
class Decline:
    """Why an engine cannot serve a parameter (or a step's curvature).

    Attributes:
        why: The kind, for code to act on.
        message: The reason, for people (shown in the coverage report).
        fix: What the user can do about it (empty if nothing).
        passive: The engine serves only some kinds of modules and this is not
            one (e.g. the ghost engine and a convolution): said only when no
            other engine gave a reason (:attr:`Route.reason`).
    """

    why: Why
    message: str
    fix: str = ""
    passive: bool = False

    def __str__(self) -> str:
        return self.message


@dataclass(frozen=True)
class Route:
    """Which engine computes one parameter's per-sample results, and why.

    Attributes:
        engine: The engine's name (:data:`BACKPACK`, :data:`AUTOGRAD`, :data:`UNUSED`
            for a parameter the per-sample losses do not depend on, or the name of
            an engine registered by the user).
        declines: The reasons of the engines tried before, in order.
        module: A description of the owning module (class and attribute).
        method: How the engine got them at the step (empty before the step ran),
            e.g. ``"replay of MultiheadAttention"``.
    """

    engine: str
    declines: tuple[Decline, ...] = ()
    module: str = ""
    method: str = ""

    @property
    def reason(self) -> str:
        """The reason of the last engine that declined (empty if none did).

        Passive declines (:attr:`Decline.passive`) count only when every
        decline is passive.
        """
        active = [d for d in self.declines if not d.passive]
        chosen = active or self.declines
        return chosen[-1].message if chosen else ""

    def declined(self, why: Why) -> bool:
        """Whether an engine declined the parameter for reason ``why``."""
        return any(d.why is why for d in self.declines)


@dataclass
class EngineStep:
    """What the engines of one step may read, and where they put results.

    Attributes:
        global_step: The step.
        params: The tensors the modules compute with, in the cockpit's order:
            its parameters (FSDP2: the unsharded ones, what derivatives of the
            loss are taken with respect to).
        per_sample: Whether a quantity reads per-sample results at this step.
        losses: The per-sample losses with their autograd graph, or ``None``.
        loss: The mini-batch loss (``info["loss"]``), or ``None``.
        nodes: The autograd nodes of the losses' graph (empty without a graph).
        uses: ``id(leaf)`` -> how often the graph uses it.
        show: ``(index, ParamResults) -> None``: hand one parameter's results to
            the quantities (as a :class:`~cockpit.param_view.ParamView`).
        options: Engine settings of the cockpit (``chunk``, ``max_elements``,
            ``save_memory``, ``debug``).
        needs: What the quantities of the step need (all of them: before a step).
        plan: The step's plan (``None`` for routes from the structure alone).
        user: The user's extra extensions of the step.
        quiet: ``() -> context`` for an engine's own extra backward passes before
            the user's (the other engines' hooks keep still), or ``None``.
        label: ``module -> str``, a module's name in messages (class and the
            names of its parameters).
    """

    global_step: int
    params: Sequence[Tensor]
    per_sample: bool = False
    losses: Tensor | None = None
    loss: Tensor | None = None
    nodes: set = field(default_factory=set)
    uses: dict = field(default_factory=dict)
    show: Callable[[int, Any], None] | None = None
    options: dict = field(default_factory=dict)
    needs: frozenset = frozenset()
    plan: Any = None
    user: tuple = ()
    quiet: Callable[[], Any] | None = None
    label: Callable[[Any], str] = repr


class Engine:
    """Computes per-sample results for the parameters it claims.

    Args:
        params: The cockpit's parameters.
        modules: The router's module map (``owners``: ``id(param)`` -> ``[(module,
            attribute)]``), found once from the parameters.
    """

    #: The name in the coverage report.
    name: ClassVar[str] = ""
    #: Whether it needs the per-sample losses' graph (runs before the backward).
    needs_losses: ClassVar[bool] = False

    def __init__(self, params: Sequence[Tensor], modules: Any):
        self.params = params
        self.modules = modules

    def owner(self, index: int):
        """``(module, attribute)`` owning parameter ``index``, if exactly one does."""
        owners = self.modules.owners.get(id(self.params[index]), [])
        return owners[0] if len(owners) == 1 else None

    def static_claim(self, index: int, step: EngineStep) -> Decline | None:
        """Whether the model's structure lets it serve ``index`` (``None``: yes)."""
        return None

    def claim(self, step: EngineStep, indices: Sequence[int]) -> dict[int, Decline]:
        """The parameters among ``indices`` it cannot serve at ``step``, with why."""
        found = {i: self.static_claim(i, step) for i in indices}
        return {i: d for i, d in found.items() if d is not None}

    def curvature_decline(self, routes: Sequence[Route], step: EngineStep):
        """Why it cannot form the step's curvature diagonals (``None``: it can).

        ``NotImplemented`` (the default): it forms no curvature at all.
        """
        return NotImplemented

    def prepare(self, step: EngineStep, dispatcher, others: Sequence[int]) -> None:
        """Get ready for the step (``others``: indices other engines serve)."""

    def zero_results(self, index: int, batch_size: int | None):
        """Exact zero results of an unused parameter (``None``: not its concern)."""
        return None

    def free(self, late: bool = False) -> None:
        """Free the step's buffers (``late``: also those kept for tracking)."""

    def before_backward(self, step: EngineStep, indices: Sequence[int]) -> dict:
        """Compute and show results before the backward pass.

        Returns:
            ``index -> method`` of the parameters served (the others go to the
            next engine that claims them).
        """
        return {}

    def backward_context(
        self, step: EngineStep, indices: Sequence[int]
    ) -> contextlib.AbstractContextManager:
        """A context around the user's backward pass (default: none)."""
        return contextlib.nullcontext()

    def after_backward(self, step: EngineStep) -> None:  # noqa: B027
        """Check its own work after the user's backward pass (default: nothing).

        E.g. BackPACK names a layer it skipped although the quantities need it.
        """

    def explain(self, error: BaseException, step: EngineStep) -> Exception | None:
        """A clearer error for ``error`` in the backward pass (``None``: none)."""
        return None

    def quiet(self) -> contextlib.AbstractContextManager:
        """A context for extra backward passes before the user's (default: none)."""
        return contextlib.nullcontext()

    def idle(self) -> contextlib.AbstractContextManager:
        """A context in which the engine's hooks do nothing (default: none)."""
        return contextlib.nullcontext()

    def watch(self, routes: Sequence[Route]) -> None:  # noqa: B027
        """Called once with the routes from the model's structure (cockpit made)."""

    def forget(self) -> None:  # noqa: B027
        """Drop what the step's forward pass left (called after every step)."""

    def close(self) -> None:  # noqa: B027
        """Remove hooks and free memory (the cockpit is closed)."""


_REGISTRY: list[tuple[float, type[Engine]]] = []


def register_engine(order: float) -> Callable[[type[Engine]], type[Engine]]:
    """Class decorator: try this engine at position ``order`` (lower first).

    The built-in engines are BackPACK (``order=100``), replay (``200``) and the
    batched autograd engine (``300``), which serves every parameter. Engines of
    cockpits made after the call include it.
    """

    def add(cls: type[Engine]) -> type[Engine]:
        unregister_engine(cls)
        _REGISTRY.append((order, cls))
        _REGISTRY.sort(key=lambda entry: entry[0])
        return cls

    return add


def unregister_engine(cls: type[Engine]) -> None:
    """Stop offering ``cls`` to cockpits made from now on."""
    _REGISTRY[:] = [entry for entry in _REGISTRY if entry[1] is not cls]


def engine_classes() -> list[type[Engine]]:
    """The registered engines, in the order they are tried."""
    return [cls for _, cls in _REGISTRY]


def zero_results(engines: Iterable[Engine], index: int, batch_size: int | None):
    """Exact zero results of an unused parameter (from the first engine that has)."""
    for engine in engines:
        results = engine.zero_results(index, batch_size)
        if results is not None:
            return results
    from cockpit.param_view import ParamResults

    return ParamResults()


def first_claims(
    engines: Iterable[Engine], step: EngineStep, indices: Sequence[int]
) -> dict[int, tuple[Engine | None, tuple[Decline, ...]]]:
    """Ask ``engines`` in order; each index -> (the first that claims it, declines)."""
    declines: dict[int, list[Decline]] = {i: [] for i in indices}
    chosen: dict[int, Engine | None] = {}
    pending = list(indices)
    for engine in engines:
        if not pending:
            break
        refused = engine.claim(step, pending)
        for index in pending:
            if index in refused:
                declines[index].append(refused[index])
            else:
                chosen[index] = engine
        pending = [i for i in pending if i in refused]
    for index in pending:
        chosen[index] = None
    return {i: (chosen[i], tuple(declines[i])) for i in indices}
