"""The BackPACK engine: per-sample results and curvature inside the backward pass.

It claims the parameters whose owner BackPACK's rules handle exactly
(:mod:`cockpit.engines.backpack.routing`), turns the step's needs into BackPACK
extensions (merged with the user's extra ones and those of 1.0.2-style quantities),
and enters BackPACK's context around the user's ``loss.backward()`` with an
:class:`~cockpit.engines.backpack.api.ExtensionHook` that shows each parameter to the
quantities and frees the buffers at once. After the backward pass it names layers
BackPACK skipped and shows unused parameters as exact zeros.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from typing import Sequence

from cockpit.engines.backpack import api as bp
from cockpit.engines.backpack import hooks
from cockpit.engines.backpack import routing as rules
from cockpit.engines.base import (
    BACKPACK,
    Decline,
    Engine,
    EngineStep,
    Route,
    Why,
    register_engine,
)
from cockpit.engines.modules import describe
from cockpit.errors import CockpitWarning, quiet_warnings
from cockpit.step.checks import (
    batchnorm_message,
    in_place_message,
    repeated_backward_message,
    unextended_loss_message,
    unsupported_message,
)

#: Use BackPACK's low-memory algorithm for convolution weight Jacobians.
SAVE_MEMORY = True


@dataclass(frozen=True)
class BackwardSetup:
    """BackPACK's part of a step, once the user's extra extensions are known.

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


def backward_setup(plan, user: Sequence = ()) -> BackwardSetup:
    """Merge the user's extra extensions with the plan's and say what to free.

    Raises:
        TypeError: If a user extension is not a BackPACK extension.
        ValueError: On conflicting extensions.
    """
    requested = list(plan.requested) + list(plan.legacy)
    merged = bp.merge_extensions(list(user), requested)
    protected = set(bp.savefields(user))
    late = set(bp.savefields(plan.legacy)) - protected
    owned = [f for f in bp.savefields(merged) if f not in protected]
    return BackwardSetup(
        extensions=tuple(merged),
        free_in_hook=tuple(f for f in owned if f not in late),
        free_after=tuple(owned),
        needed=tuple(sorted(set(bp.savefields(requested)))),
    )


def who_needs(plan, savefields) -> str:
    """Name the active quantities that read any of ``savefields`` (messages)."""
    savefields = set(savefields)
    if savefields & bp.FIRST_ORDER_SAVEFIELDS:
        savefields |= bp.FIRST_ORDER_SAVEFIELDS
    wanted = set().union(*(bp.SAVEFIELD_NEEDS.get(f, ()) for f in savefields))
    names = []
    for q in plan.active:
        legacy = set(bp.savefields(q.extensions(plan.global_step)))
        if plan.needs_of(q) & wanted or legacy & savefields:
            names.append(q.key)
    return ", ".join(names) if names else "your extra extensions"


@register_engine(order=100)
class BackpackEngine(Engine):
    """Per-sample results and curvature diagonals from BackPACK's layer rules."""

    name = BACKPACK

    def __init__(self, params, modules):
        super().__init__(params, modules)
        self._probe = rules.SampleAxisProbe(bp.quiet_backward)
        self._batchnorms: list | None = None
        self.setup: BackwardSetup | None = None
        self.hook: bp.ExtensionHook | None = None
        self._fields: list[str] = []
        self._setup_cache: tuple | None = None
        self._rewired: list = []

    # --- which parameters ------------------------------------------------------------
    def setup_for(self, plan, user=()) -> BackwardSetup:
        """The extensions of ``plan`` merged with the user's (kept for the step)."""
        cached = self._setup_cache
        if cached is None or cached[0] is not plan or cached[1] != tuple(user):
            cached = (plan, tuple(user), backward_setup(plan, user))
            self._setup_cache = cached
        return cached[2]

    def first_order(self, plan, user=()) -> list:
        """The per-sample extensions that will run (the user's may replace ours).

        A step without any is routed as the reference extension would be.
        """
        extensions = self.setup_for(plan, user).extensions
        return bp.first_order(extensions) or bp.reference_first_order()

    def _first_order_of(self, step: EngineStep) -> list:
        """The step's per-sample extensions (before a step: for all its needs)."""
        if step.plan is not None:
            return self.first_order(step.plan, step.user)
        return self.requested_for(step.needs)[0]

    def static_claim(self, index: int, step: EngineStep) -> Decline | None:
        """Rules 1 and 2: one owner, extended, with a rule (see the rules module)."""
        owners = self.modules.owners.get(id(self.params[index]), [])
        if not owners:
            return Decline(Why.FREE_TENSOR, "not owned by any module (a free tensor)")
        if len(owners) > 1:
            names = " and ".join(describe(m, a) for m, a in owners)
            return Decline(Why.TIED, f"tied: owned by {names}")
        module, attribute = owners[0]
        requested = self._first_order_of(step)
        for check in rules.STATIC_RULES:
            decline = check(module, attribute, requested, bp.rule_problem)
            if decline is not None:
                return decline
        return None

    def claim(self, step: EngineStep, indices: Sequence[int]) -> dict[int, Decline]:
        """Rules 1-5 at ``step``."""
        refused = super().claim(step, indices)
        if not step.nodes:
            return refused
        mixed = rules.batch_mixing(self.params, step.nodes, self.batchnorms())
        candidates = {}
        for index in indices:
            if index in refused:
                continue
            module, _ = self.owner(index)
            count = step.uses.get(id(self.params[index]), 0)
            for check in rules.STEP_RULES:
                decline = check(step, index, module, count)
                if decline is not None:
                    refused[index] = decline
                    break
            else:
                if index in mixed:
                    refused[index] = rules.mixing_decline(mixed[index])
                else:
                    candidates[index] = module
        losses = step.losses
        if losses is not None and losses.shape[0] >= 2:
            unique = {id(m): m for m in candidates.values()}
            failed = self._probe.failed(losses, list(unique.values()))
            n = losses.shape[0]
            for index, module in candidates.items():
                if id(module) in failed:
                    refused[index] = rules.sample_axis_decline(module, n)
        return refused

    def batchnorms(self) -> list:
        """The BatchNorm layers around the parameters (found once)."""
        if self._batchnorms is None:
            roots = rules.roots_of(self.modules.owners, self.modules.parents)
            self._batchnorms = rules.batchnorms(roots)
        return self._batchnorms

    def curvature_decline(self, routes: Sequence[Route], step) -> Decline | None:
        """Why BackPACK cannot give the step's curvature diagonals (``None``: can)."""
        requested = (
            step.plan.requested
            if step.plan is not None
            else self.requested_for(step.needs)[1]
        )
        curvature = bp.curvature(requested)
        if not curvature:
            return None
        owners = [
            self.modules.owners[id(p)][0][0]
            for p in self.params
            if self.modules.owners.get(id(p))
        ]
        return rules.curvature_decline(
            routes, owners, self.modules.parents, curvature, bp.rule_problem
        )

    def watch(self, routes) -> None:
        """Make BackPACK's hooks harmless to the models (the cockpit is made).

        Models BackPACK has no curvature for get their hooks rewired
        (:mod:`cockpit.engines.backpack.hooks`: containers and parameter-free
        layers lose them, layers with rules run them from their output's
        gradient), so child modules named ``output`` and in-place changes of
        layer outputs work. In the others (``nn.Sequential`` models, whose hooks
        serve BackPACK's curvature) in-place modules among extended layers get
        ``inplace=False``: with BackPACK's hooks their forward pass would stop
        (:func:`~cockpit.engines.backpack.routing.in_place_modules`); out of place
        they compute the same values (unless forward code reads their input again
        afterwards), with a little more memory. Said once, with a warning.
        """
        roots = rules.roots_of(self.modules.owners, self.modules.parents)
        curvature = [make() for make in bp.CURVATURE_EXTENSIONS]
        first_order = bp.first_order_references()
        common = rules.common_container(
            [found[0][0] for found in self.modules.owners.values() if found],
            self.modules.parents,
        )
        possible = common is not None and rules.curvature_possible(
            common, curvature, bp.rule_problem
        )

        def rule(module) -> bool:
            return any(bp.rule_problem(module, e) is None for e in first_order)

        def any_rule(module) -> bool:
            return rule(module) or any(
                bp.rule_problem(module, e) is None for e in curvature
            )

        owners = self.modules.owners

        def never_served(module) -> str | None:
            own = [p for p in module.parameters(recurse=False) if p.requires_grad]
            if own and all(len(owners.get(id(p), ())) > 1 for p in own):
                return (
                    f"{type(module).__name__}'s parameters are tied to another "
                    "module's (BackPACK serves no tied parameter)"
                )
            return None

        for root in roots:
            self._rewired += hooks.rewire(
                list(root.modules()),
                lambda m: hooks.plan_module(m, rule, any_rule, possible, never_served),
            )
        sequential = roots if possible else []
        found = rules.in_place_modules(sequential)
        for _, module in found:
            module.inplace = False
        if found:
            labels = [label for label, _ in found]
            warnings.warn(in_place_message(labels), CockpitWarning, stacklevel=5)

    # --- the backward pass -----------------------------------------------------------
    #: BackPACK's low-memory convolution setting and debug output (set per step).
    save_memory = SAVE_MEMORY
    debug = False

    def prepare(self, step: EngineStep, dispatcher, others: Sequence[int]) -> None:
        """Build the step's extensions and hook (before any engine shows results).

        Args:
            step: The step (its plan, the user's extra extensions, the options).
            dispatcher: Shows results to the quantities.
            others: Indices another engine serves (BackPACK skips their modules).
        """
        plan, user = step.plan, step.user
        self.save_memory = step.options.get("save_memory", SAVE_MEMORY)
        self.debug = step.options.get("debug", False)
        self.setup = self.setup_for(plan, user)
        self._fields = bp.savefields(plan.requested)
        self.hook = bp.ExtensionHook(
            index={id(p): i for i, p in enumerate(self.params)},
            dispatcher=dispatcher,
            needed=self.setup.needed,
            free=self.setup.free_in_hook,
            elsewhere=frozenset(others),
        )
        if others:
            bp.leave_to_autograd(self.setup.extensions, self._only_in(others))
        if self.debug:  # cockpit-for-pytorch 1.0.2 prints the plan with debug=True
            self.print_plan(plan, user)

    def _only_in(self, indices: Sequence[int]) -> list:
        """Modules owning parameters ``indices`` and no other cockpit parameter."""
        chosen = {id(self.params[i]) for i in indices}
        found = {}
        for key in chosen:
            for module, _ in self.modules.owners.get(key, []):
                found[id(module)] = module
        return [
            module
            for module in found.values()
            if all(
                id(p) in chosen
                for p in module.parameters(recurse=False)
                if id(p) in self.modules.owners
            )
        ]

    def backward_context(self, step, indices):
        """BackPACK's context with the step's extensions and hook."""
        return bp.backward_context(
            self.setup.extensions, self.hook, self.save_memory, self.debug
        )

    def check_modules(self, plan, label) -> None:
        """Fail on a layer BackPACK skipped although the quantities need it.

        Raises:
            NotImplementedError: Naming the layer, the quantities and the fix.
        """
        if self.hook is None or not self.hook.unsupported:
            return
        first = self.hook.unsupported[0]
        names = bp.extension_names(
            list(plan.requested) + list(plan.legacy), first.missing
        )
        raise NotImplementedError(
            unsupported_message(
                label(first.module),
                names or ", ".join(first.missing),
                who_needs(plan, first.missing),
                plan.global_step,
                first_order=set(first.missing) <= bp.FIRST_ORDER_SAVEFIELDS,
            )
        )

    def after_backward(self, run) -> None:
        """Name a layer BackPACK skipped although the quantities need it."""
        self.check_modules(run.plan, run.diagnostics.module_label)

    def explain(self, error: BaseException, plan, label) -> Exception | None:
        """A clearer error for a BackPACK failure inside the backward pass."""
        failure = bp.explain_failure(error)
        if failure is None:
            return None
        step = plan.global_step
        who = who_needs(plan, {failure.savefield} if failure.savefield else set())
        if failure.kind == "loss_not_extended":
            return RuntimeError(unextended_loss_message(who, step))
        if failure.kind == "repeated_backward":
            module_class = type(failure.module).__name__
            return RuntimeError(repeated_backward_message(step, module_class))
        module = failure.module
        name = label(module) if module is not None else "a layer"
        if module is not None and rules.is_training_batchnorm(module):
            return NotImplementedError(batchnorm_message(name, who, step))
        return NotImplementedError(
            unsupported_message(
                name,
                failure.extension or "an extension",
                who,
                step,
                first_order=failure.savefield in bp.FIRST_ORDER_SAVEFIELDS,
                container=module is not None and any(True for _ in module.children()),
            )
        )

    def zero_results(self, index: int, batch_size: int | None):
        """Exact zero results of an unused parameter, for the step's savefields."""
        return bp.zero_results(self.params[index], self._fields, batch_size)

    @staticmethod
    def requested_for(needs) -> tuple[list, list]:
        """The per-sample extensions (or a reference one) and all, for ``needs``."""
        extensions = bp.extensions_for(needs)
        return bp.first_order(extensions) or bp.reference_first_order(), extensions

    def print_plan(self, plan, user) -> None:
        """cockpit-for-pytorch 1.0.2's ``debug=True`` line."""
        print(
            f"[cockpit] step {plan.global_step}: quantities "
            f"{[q.key for q in plan.active]}, extensions "
            f"{list(self.setup.extensions)}, create_graph {plan.create_graph}, "
            f"protected {sorted(bp.savefields(user))}"
        )

    def quiet(self):
        """Extra backward passes keep BackPACK's stored inputs (and stay quiet)."""
        return bp.quiet_backward()

    def idle(self):
        """BackPACK's hooks do nothing (extra backward passes after the step).

        PyTorch still warns that a full backward hook fires on a layer whose input
        needs no gradient: expected here, and kept quiet.
        """
        stack = contextlib.ExitStack()
        stack.enter_context(bp.disabled())
        stack.enter_context(quiet_warnings("Full backward hook is firing"))
        return stack

    def free(self, late: bool = False) -> None:
        """Delete the step's buffers from the parameters (``late``: all of them)."""
        if self.setup is None:
            return
        fields = self.setup.free_after if late else self.setup.free_in_hook
        for param in self.params:
            bp.free_buffers(param, fields)

    def forget(self) -> None:
        """Drop the step's hook, extensions, hooked nodes and BackPACK's stored io.

        The inputs and outputs BackPACK's forward hook stored are still there when
        the step stopped before its backward pass (:func:`bp.drop_stored_io`).
        """
        self.hook = None
        self._setup_cache = None
        hooks.forget(self._rewired)
        for root in rules.roots_of(self.modules.owners, self.modules.parents):
            bp.drop_stored_io(root.modules())

    def close(self) -> None:
        """Give BackPACK its hooks back (once no other cockpit holds the modules)."""
        rewired, self._rewired = self._rewired, []
        hooks.release(rewired)
