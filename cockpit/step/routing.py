"""Which engine serves what at one step, and what that leaves out (in the ledger).

:class:`StepRouting` routes the parameters (the engines in their order), writes to
the step's ledger what no engine can serve (per-sample values without the
per-sample losses, curvature no engine can form), marks estimates, builds the
coverage report, and runs the engines around the user's backward pass.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import replace
from types import MappingProxyType

from torch import Tensor

from cockpit.curvature.source import estimate_method
from cockpit.engines.base import AUTOGRAD, Engine, EngineStep, Why
from cockpit.engines.coverage import (
    CURVATURE_NEEDS,
    MISSING,
    PER_SAMPLE_NEEDS,
    Coverage,
    CoverageError,
    ParamCoverage,
    Status,
    status_for,
    with_fix,
)
from cockpit.needs import Need
from cockpit.step.checks import no_results_message

MISSING_LOSSES = (
    "the autograd engine needs info['individual_losses'] with its autograd graph "
    "for the parameters it computes (those BackPACK has no rule for, or whose "
    "BackPACK results would not be per-sample)",
    "pass the per-sample losses of this forward pass, computed with "
    "reduction='none' and not detached",
)


def _refuse_unextended(routes, params, who) -> None:
    """Fail when a module an engine could serve was not extended.

    Without the per-sample losses the engines that need them cannot step in, and
    a forgotten ``backpack.extend`` is the likelier mistake.

    Raises:
        RuntimeError: Naming the parameters and both fixes.
    """
    unextended = [i for i, r in enumerate(routes) if r.declined(Why.NOT_EXTENDED)]
    if unextended:
        names = ", ".join(q.key for q in who)
        shapes = ", ".join(f"#{i} (shape {tuple(params[i].shape)})" for i in unextended)
        raise RuntimeError(no_results_message(shapes, names))


def double_backward_reason(key: str, error: Exception) -> tuple[str, Status]:
    """Why a quantity without double backward is missing (and its status)."""
    reason = (
        f"{key} needs second derivatives (Hessian-vector products), but "
        f"PyTorch has no double backward for an operation of the model "
        f"({error}). Fix: for fused attention that cockpit cannot differentiate "
        "twice itself (it wraps torch.nn.functional.scaled_dot_product_attention, "
        "see cockpit.curvature.attention; not a reference bound before the cockpit "
        "was made, "
        "nor a fused kernel with attention dropout) run the forward pass of "
        "tracked steps inside `with torch.nn.attention.sdpa_kernel("
        "torch.nn.attention.SDPBackend.MATH):`; otherwise drop the quantity."
    )
    status = Status(
        MISSING,
        "PyTorch has no double backward for an operation of the model "
        "(fused attention: run tracked forward passes inside "
        "sdpa_kernel(SDPBackend.MATH))",
    )
    return reason, status


def _slow_message(labels: list[str], n: int | None, fix: str) -> str:
    """The warning for parameters sent to autograd by a batch norm after them."""
    shown = ", ".join(labels[:4]) + (
        f" and {len(labels) - 4} more" if len(labels) > 4 else ""
    )
    passes = f"about {n} backward passes" if n else "one backward pass per sample"
    return (
        f"{len(labels)} parameter tensor(s) ({shown}) sit before batch norms that "
        "normalise with mini-batch statistics (BatchNorm in train mode), which mix "
        "the samples, so BackPACK's per-sample gradients of them would not be "
        "d l_i / d theta: cockpit computes them exactly with the autograd engine "
        f"instead, which costs {passes} per tracked step with per-sample "
        f"quantities. Fix (for speed): {fix}. cockpit.coverage() says who "
        "computes what."
    )


def _strict_message(step: int, problems: list[str]) -> str:
    return (
        f"strict=True, but at step {step} {len(problems)} value(s) would not "
        f"be exact: {'; '.join(problems[:3])}"
        f"{' ...' if len(problems) > 3 else ''}. Fix: see "
        "cockpit.coverage() for who computes what, drop these quantities, "
        "or use Cockpit(..., strict=False) (estimates are then recorded "
        "with their standard error, values not covered as missing)."
    )


def quiet_engines(engines) -> contextlib.AbstractContextManager:
    """A context in which ``engines`` keep still for an extra backward pass."""
    stack = contextlib.ExitStack()
    for engine in engines:
        stack.enter_context(engine.quiet())
    return stack


class StepRouting:
    """The engines' part of one step (see the module's docstring).

    Args:
        router: The cockpit's router (its engines, in order).
        plan: The step's plan (before anything is left out).
        info: The step's ``info``.
        ledger: The step's ledger (what is estimated or left out).
        checks: The cockpit's step checks (labels, warnings said once).
        settings: ``user`` (the user's extra extensions), ``options`` (the
            cockpit's engine settings), ``probes`` (of a Hutchinson estimate),
            ``parallel`` (a data-parallel run), ``strict``.
    """

    def __init__(self, router, plan, info, ledger, checks, settings):
        self.router, self.ledger, self.checks = router, ledger, checks
        self.params = router.params
        self.probes, self.parallel = settings["probes"], settings["parallel"]
        self.strict = settings["strict"]
        losses = info.get("individual_losses")
        losses = losses if isinstance(losses, Tensor) and losses.grad_fn else None
        user = tuple(settings["user"])
        self.engine_step = EngineStep(
            plan.global_step,
            self.params,
            losses=losses,
            loss=info.get("loss"),
            options=settings["options"],
            needs=plan.needs,
            plan=plan,
            user=user,
            # not a bound method: the engine step must not hold the routing (a
            # cycle through the ledger would keep a dropped cockpit's parts alive)
            quiet=functools.partial(quiet_engines, tuple(self.router.engines)),
            label=checks.module_label,
        )
        self.routes = None
        self.curvature = None
        self.engines = self.router.engines
        self.served: dict = {}
        self.before: dict = {}
        if plan.consumers:
            self._route(plan, user)

    def _route(self, plan, user) -> None:
        self.routes = self.router.route(self.engine_step)
        per_sample = [q for q in plan.consumers if plan.needs_of(q) & PER_SAMPLE_NEEDS]
        with_losses = set()  # names of engines that need the per-sample losses
        for engine in self.engines:
            if engine.needs_losses:
                with_losses.add(engine.name)
        needy = False
        for route in self.routes:
            if route.engine in with_losses:
                needy = True
                break
        if needy and per_sample and self.engine_step.losses is None:
            _refuse_unextended(self.routes, self.params, per_sample)
            reason, fix = MISSING_LOSSES
            self._leave_out(per_sample, reason, fix)
        if plan.needs & CURVATURE_NEEDS:
            step = self.engine_step
            self.curvature = self.router.curvature_decline(self.routes, step)
        if self.curvature is not None:
            self._curvature_fallback(plan)
        slow = [
            self.checks.param_label(i)
            for i, r in enumerate(self.routes)
            if r.engine == AUTOGRAD and r.declined(Why.MIXED_BY_BATCHNORM)
        ]
        if slow and per_sample and self.engine_step.losses is not None:
            losses = self.engine_step.losses
            n = losses.shape[0] if losses is not None else None
            fix = next(
                d.fix
                for r in self.routes
                for d in r.declines
                if d.why is Why.MIXED_BY_BATCHNORM
            )
            self.checks.warn_once("batchnorm-autograd", _slow_message(slow, n, fix))

    def _curvature_fallback(self, plan) -> None:
        """Estimate the curvature where a quantity accepts it; else leave it out."""
        ledger, decline = self.ledger, self.curvature
        groups: dict[tuple[str, str], list] = {}
        for q in plan.consumers:
            wanted = plan.needs_of(q) & CURVATURE_NEEDS
            if not wanted or ledger.out(q):
                continue
            losses = self.engine_step.losses
            how = None
            if losses is not None and wanted <= q.estimable:
                how = estimate_method(
                    plan, q, losses, self.params, self.probes, self.parallel
                )
            if how is not None:
                ledger.estimate(q, how)
                continue
            reason, fix = decline.message, decline.fix
            if q.not_estimable is not None and (
                Need.DIAG_H in wanted or wanted <= q.estimable
            ):
                reason = f"{reason}; {q.not_estimable[0]}"
                other = q.not_estimable[1]  # "or ...": an alternative to the fix
                fix = f"{fix}, {other}" if fix else other.removeprefix("or ")
            groups.setdefault((reason, fix), []).append(q)
        for (reason, fix), quantities in groups.items():
            self._leave_out(quantities, reason, fix)

    def _leave_out(self, quantities, reason: str, fix: str) -> None:
        """One warning per reason: the quantities are not covered at this step."""
        self.ledger.leave_out(
            list(quantities),
            f"{reason} (also at later steps like it). Fix: {fix}. "
            "cockpit.coverage() says who computes what",
            once=("not-covered", reason),
            short=with_fix(reason, fix),
        )

    def adjusted(self, plan):
        """The plan of a step whose curvature is estimated (no curvature extension)."""
        estimated = {id(q) for q in self.ledger.estimated()}
        if not estimated:
            return plan
        return replace(
            plan,
            estimated=True,
            consumers=tuple(
                q
                for q in plan.consumers
                if id(q) not in estimated or plan.needs_of(q) & PER_SAMPLE_NEEDS
            ),
        )

    # --- the coverage report ---------------------------------------------------------
    def coverage(self, plan) -> Coverage | None:
        """The coverage report of the step (``None`` if nothing per-sample ran)."""
        if self.routes is None:
            return None
        step, ledger = plan.global_step, self.ledger
        decline = self.curvature
        problem = with_fix(decline.message, decline.fix) if decline else None
        entries = [(q, ledger.entries[id(q)]) for q in ledger.planned.active]
        key = (
            tuple(self.routes),
            tuple((q.key, e.status, e.reason, plan.needs_of(q)) for q, e in entries),
            problem,
            tuple([p.shape for p in self.params]),  # the labels' shapes
        )
        cached = self.router.coverage_cache
        if cached is not None and cached[0] == key:
            coverage = Coverage(step, cached[1].params)
        else:
            labels = [self.checks.param_label(i) for i in range(len(self.params))]
            rows = []
            for index, route in enumerate(self.routes):
                statuses = {}
                for q, entry in entries:
                    if entry.status == "missing":
                        statuses[q.key] = Status(MISSING, entry.reason)
                    elif entry.status == "estimated":
                        statuses[q.key] = Status("estimated", entry.reason)
                    else:
                        statuses[q.key] = status_for(plan.needs_of(q), route, problem)
                rows.append(
                    ParamCoverage(
                        index, labels[index], route, MappingProxyType(statuses)
                    )
                )
            coverage = Coverage(step, tuple(rows))
            self.router.coverage_cache = (key, coverage)
        if self.strict and coverage.problems():
            raise CoverageError(_strict_message(step, coverage.problems()))
        return coverage

    # --- around the backward pass ----------------------------------------------------
    def prepare(self, plan, dispatcher) -> None:
        """Decide which engine runs where; let each get ready for the step."""
        served: dict = {}
        self.engine_step.plan = plan
        self.engine_step.per_sample = any(
            plan.needs_of(q) & PER_SAMPLE_NEEDS for q in plan.consumers
        )
        if self.routes is not None and self.engine_step.per_sample:
            with_losses = self.engine_step.losses is not None
            for index, route in enumerate(self.routes):
                for engine in self.engines:
                    if engine.name == route.engine:
                        if with_losses or not engine.needs_losses:
                            served.setdefault(engine, []).append(index)
                        break
        self.before = {e: ix for e, ix in served.items() if e.needs_losses}
        for engine in self.engines:  # each skips what the others serve
            others = []
            for other, indices in served.items():
                if other is not engine:
                    others.extend(indices)
            if type(engine).prepare is not Engine.prepare:  # (no call where none)
                engine.prepare(self.engine_step, dispatcher, sorted(others))
        self.served = {e: served.get(e, []) for e in self.engines if not e.needs_losses}

    def run_before_backward(self, quiet) -> dict[int, str]:
        """Run the engines that need the forward graph; return their methods.

        Each engine gets the parameters routed to it and those an engine before it
        could not serve at the step (if it claims them).
        """
        methods: dict[int, str] = {}
        if not self.before:
            return methods
        left: list[int] = []
        with quiet():
            for engine in (e for e in self.engines if e.needs_losses):
                mine = list(self.before.get(engine, []))
                if left:
                    refused = engine.claim(self.engine_step, left)
                    mine += [i for i in left if i not in refused]
                    left = [i for i in left if i in refused]
                if not mine:
                    continue
                done = engine.before_backward(self.engine_step, sorted(mine))
                methods.update(done)
                left += [i for i in mine if i not in done]
        return methods

    def free(self, late: bool = False) -> None:
        """Free the engines' buffers on the parameters."""
        for engine in self.engines:
            if type(engine).free is not Engine.free:
                engine.free(late)

    def quiet(self) -> contextlib.AbstractContextManager:
        """A context for extra backward passes before the user's (hooks keep still)."""
        return quiet_engines(self.engines)

    def idle(self) -> contextlib.AbstractContextManager:
        """A context in which the engines' hooks do nothing (extra backward passes)."""
        stack = contextlib.ExitStack()
        for engine in self.engines:
            stack.enter_context(engine.idle())
        return stack
