"""Running one planned step: the backward context, the checks after it, tracking.

:class:`StepRun` is what :meth:`Cockpit.begin <cockpit.Cockpit.begin>` opens and
:meth:`Cockpit.end <cockpit.Cockpit.end>` closes. Opening prepares the quantities
and enters the engine's context around the user's ``loss.backward()``; closing
checks the step (:class:`~cockpit.checks.Diagnostics`), shows parameters the engine
did not reach with exact zero results, tracks the quantities and hands their
values to the recorder. Buffers are freed whatever happens.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from types import MappingProxyType
from typing import Any

import torch
from torch import Tensor

from cockpit import distributed
from cockpit.checks import NONFINITE_KEY, Diagnostics
from cockpit.context import StepInfo
from cockpit.engines import autograd as autograd_engine
from cockpit.engines import backpack as engine
from cockpit.engines.coverage import (
    CURVATURE_NEEDS,
    ESTIMATED,
    MISSING,
    PER_SAMPLE_NEEDS,
    Coverage,
    CoverageError,
    ParamCoverage,
    Status,
    status_for,
)
from cockpit.engines.replay import Replayer
from cockpit.engines.routing import (
    AUTOCAST,
    AUTOGRAD,
    BEFORE_BATCHNORM,
    PER_SAMPLE_BACKWARD,
    REPLAY,
    Route,
    Router,
)
from cockpit.errors import quiet_warnings
from cockpit.log_format import ESTIMATE_SUFFIX
from cockpit.needs import Need
from cockpit.param_view import ParamResults, ParamView
from cockpit.per_sample import DenseGradients
from cockpit.planner import StepPlan
from cockpit.quantities.base import Missing, Quantity, TrackContext
from cockpit.quantities.utils_params import gradients
from cockpit.recorder import Recorder

#: PyTorch's warning about backward(create_graph=True), silenced on cockpit's steps.
_CREATE_GRAPH_WARNING = r"Using backward\(\) with create_graph=True"


#: Warnings BackPACK and PyTorch's module hooks give at every tracked step, ignored
#: inside cockpit's steps: PyTorch's "Full backward hook is firing ..." comes from
#: BackPACK's hooks on a layer whose input needs no gradient (expected, harmless);
#: BackPACK's "... does not have an extension for Module ..." is said better by the
#: routing, which sends such parameters to the autograd engine or records what is
#: missing (``Cockpit.coverage()``).
_ENGINE_MESSAGES = (
    "Full backward hook is firing",
    r"Extension saving to \w+ does not have an extension for Module",
)


def _batchnorm_autograd(labels: list[str], n: int | None) -> str:
    """The warning for parameters sent to autograd by a batch norm after them."""
    shown = ", ".join(labels[:4]) + (
        f" and {len(labels) - 4} more" if len(labels) > 4 else ""
    )
    passes = f"about {n} backward passes" if n else "one backward pass per sample"
    return (
        f"{len(labels)} parameter tensor(s) ({shown}) sit before batch norms that "
        "normalise with mini-batch statistics (BatchNorm in train mode), which mix "
        "the samples, so BackPACK's "
        "per-sample gradients of them would not be d l_i / d theta: cockpit "
        "computes them exactly with the autograd engine instead, which costs "
        f"{passes} per tracked step with per-sample quantities. Fix (for speed): "
        "track fewer steps (a sparser track_schedule), normalise per sample "
        "(GroupNorm, LayerNorm) instead, or give the Cockpit only the parameters "
        "after the last BatchNorm. cockpit.coverage() says who computes what."
    )


_REPEATED = (
    "several backward passes ran inside one tracked step, so the per-sample "
    "results and .grad describe different mini-batches"
)
_REPEATED_WARNING = (
    f"A tracked step had no values: {_REPEATED}. Fix: call loss.backward() once "
    "inside `with cockpit(step, ...)`; accumulate micro-batches outside tracked "
    "steps, or track one micro-batch per optimizer step. (Recorded under "
    "'missing'; warned once.)"
)


class _Guarded:
    """Runs a quantity's ``accumulate`` and keeps its first error for later.

    An error inside the backward pass would otherwise abort the user's
    ``loss.backward()``; after the backward the step decides whether to raise it
    (finite step: it is a bug) or to drop the quantity for the step (non-finite
    values, e.g. a histogram of NaNs).
    """

    __slots__ = ("quantity", "error")

    def __init__(self, quantity: Quantity):
        self.quantity = quantity
        self.error: Exception | None = None

    def accumulate(self, global_step: int, view) -> None:
        if self.error is not None:
            return
        try:
            self.quantity.accumulate(global_step, view)
        except Exception as error:  # re-raised after the backward
            self.error = error


_MISSING_LOSSES = (
    "the autograd engine needs info['individual_losses'] with its autograd graph "
    "for the parameters it computes (those BackPACK has no rule for, or whose "
    "BackPACK results would not be per-sample)",
    "pass the per-sample losses of this forward pass, computed with "
    "reduction='none' and not detached",
)
_CURVATURE_FIX = (
    "build the model from nn.Sequential with layers BackPACK supports, or drop the "
    "quantity"
)
_AUTOCAST_CURVATURE_FIX = (
    "run the forward pass of tracked steps outside torch.autocast, e.g. "
    "`torch.autocast(device_type, dtype=..., enabled=not "
    "cockpit.plan(step).active)` (those steps then compute in the parameters' "
    "dtype), or drop the quantity"
)


def _scaled_backward(scale: float) -> str:
    return (
        f"the backward pass differentiated {scale:.6g} times info['loss'] (a "
        "GradScaler's scaled loss, or a loss divided for gradient accumulation), so "
        f".grad and the per-sample gradients are {scale:.6g} times the gradients of "
        "the loss. Fix: on tracked steps call loss.backward() on the unscaled "
        "mean loss (instead of scaler.scale(loss).backward() and "
        "scaler.step(optimizer): loss.backward() and optimizer.step(); bfloat16 "
        "autocast needs no GradScaler), and accumulate micro-batches outside "
        "tracked steps"
    )


class StepRouting:
    """Which engine computes what at one step, and the quantities left out.

    Args:
        plan: The step's plan (before any quantity is left out).
        info: The step's info.
        router: The cockpit's router (module map and probe cache).
        user: The user's extra BackPACK extensions of the step.
    """

    def __init__(
        self, plan: StepPlan, info: StepInfo, router: Router, user: tuple = ()
    ):
        self.routes: list[Route] | None = None
        self._router = router
        self.autograd: list[int] = []
        self.losses: Tensor | None = None
        #: ``id(quantity)`` -> (quantity, why it has no value at the step, fix).
        self.dropped: dict[int, tuple[Quantity, str, str]] = {}
        self.curvature_problem: str | None = None
        #: ``id(quantity)`` -> quantity whose curvature is estimated (Hutchinson).
        self.estimated: dict[int, Quantity] = {}
        if not plan.consumers:
            return
        losses = (
            info.get("individual_losses") if info.has("individual_losses") else None
        )
        if isinstance(losses, Tensor) and losses.grad_fn is not None:
            self.losses = losses
        # the extensions that will run: the user's extra ones may replace ours
        first = engine.first_order(plan.backward_setup(user).extensions)
        first = first or engine.reference_first_order()
        loss = info.get("loss") if info.has("loss") else None
        self.routes = router.route(first, self.losses, loss)
        wanted = [i for i, r in enumerate(self.routes) if r.engine == AUTOGRAD]
        step = plan.global_step
        per_sample = [q for q in plan.consumers if q.needs_at(step) & PER_SAMPLE_NEEDS]
        if wanted and per_sample and self.losses is None:
            _refuse_unextended(self.routes, router, per_sample)
            for q in per_sample:
                self.dropped[id(q)] = (q, *_MISSING_LOSSES)
        elif per_sample:
            self.autograd = wanted
        curvature = engine.curvature(plan.requested)
        if curvature:
            problem = router.curvature_problem(self.routes, curvature)
            if problem is not None:
                self.curvature_problem = (
                    f"BackPACK cannot compute curvature diagonals for this model: "
                    f"{problem}"
                )
                for q in plan.consumers:
                    wanted = q.needs_at(step) & CURVATURE_NEEDS
                    if not wanted:
                        continue
                    if self.losses is not None and wanted <= q_estimable(q):
                        self.estimated[id(q)] = q
                        continue
                    reason = self.curvature_problem
                    fix = (
                        _AUTOCAST_CURVATURE_FIX
                        if AUTOCAST in problem
                        else _CURVATURE_FIX
                    )
                    why_not = getattr(q, "not_estimable", None)
                    if why_not is not None and Need.DIAG_H in wanted:
                        reason = f"{reason}; {why_not[0]}"
                        fix = f"{fix}, {why_not[1]}"
                    self.dropped[id(q)] = (q, reason, fix)

    def coverage(
        self,
        plan: StepPlan,
        params: list[Tensor],
        labels: list[str],
        probes: int = autograd_engine.DEFAULT_PROBES,
    ) -> Coverage | None:
        """The coverage report of the step (``None`` if nothing per-sample ran)."""
        if self.routes is None:
            return None
        step = plan.global_step
        # the same routes, statuses and labels as at the step before: the same
        # rows (built once, not per parameter and quantity at every step)
        key = (
            tuple(self.routes),
            tuple(
                (
                    q.key,
                    self.dropped[id(q)][1] if id(q) in self.dropped else None,
                    id(q) in self.estimated,
                    q.needs_at(step),
                )
                for q in plan.active
            ),
            self.curvature_problem,
            tuple(labels),
            probes,
        )
        cached = self._router.coverage_cache
        if cached is not None and cached[0] == key:
            return Coverage(step, cached[1].params)
        rows = []
        for index, route in enumerate(self.routes):
            statuses = {}
            for q in plan.active:
                if id(q) in self.dropped:
                    statuses[q.key] = Status(MISSING, self.dropped[id(q)][1])
                elif id(q) in self.estimated:
                    statuses[q.key] = Status(
                        ESTIMATED, f"Hutchinson, {probes} Hessian-vector products"
                    )
                else:
                    statuses[q.key] = status_for(
                        q.needs_at(step), route, self.curvature_problem
                    )
            # read-only: the rows are handed out again at later steps
            statuses = MappingProxyType(statuses)
            rows.append(ParamCoverage(index, labels[index], route, statuses))
        coverage = Coverage(step, tuple(rows))
        self._router.coverage_cache = (key, coverage)
        return coverage


class StepRun:
    """One tracked step, from before ``loss.backward()`` to the recorded values.

    Args:
        plan: What the quantities ask of the step.
        info: The step's ``info``.
        params: The cockpit's parameters.
        extensions: The user's extra BackPACK extensions.
        diagnostics: The cockpit's checks (and warn-once memory).
        recorder: Where values go.
        save_memory: BackPACK's low-memory convolution setting.
        debug: Print the step's plan and turn on BackPACK's debug output.
    """

    def __init__(
        self,
        plan: StepPlan,
        info: StepInfo,
        params: list[Tensor],
        extensions: tuple,
        diagnostics: Diagnostics,
        recorder: Recorder,
        save_memory: bool,
        debug: bool = False,
        router: Router | None = None,
        strict: bool = False,
        chunk: int = autograd_engine.DEFAULT_CHUNK,
        max_elements: int = autograd_engine.DEFAULT_MAX_ELEMENTS,
        probes: int = autograd_engine.DEFAULT_PROBES,
        communicator: distributed.Communicator | None = None,
        no_sync: bool = False,
        replayer: Replayer | None = None,
    ):
        self.plan, self.info, self.params = plan, info, params
        #: The replay engine (per-sample gradients from watched modules), if any.
        self._replayer = replayer
        #: cockpit's collectives in a data-parallel run (``None``: one process).
        self.communicator = communicator
        #: The backward pass runs inside DDP's ``no_sync()``: ``.grad`` is this
        #: process's own gradient, so the joined one is formed from the shards'.
        self.no_sync = bool(
            no_sync and communicator is not None and not communicator.local
        )
        #: The data-parallel step, once the header is exchanged in :meth:`open`.
        self.shared: distributed.StepComm | None = None
        self._captured: dict[int, Tensor] = {}
        self._capture_hooks: list = []
        #: Results (or the error) of quantities tracked before the backward pass.
        self._early: dict[int, tuple[list | None, Exception | None]] = {}
        self._probes = probes
        self._router = router
        self._skip: set[int] = set()
        #: Gradients that reached ``info["loss"]`` in the backward pass (1 unless
        #: the loss was scaled, e.g. by a GradScaler).
        self._seeds: list[Tensor] = []
        self.diagnostics, self.recorder = diagnostics, recorder
        diagnostics.before(plan, info)
        self.routing = (
            StepRouting(plan, info, router, extensions) if router is not None else None
        )
        self.coverage: Coverage | None = None
        #: Whether the report changed after the step opened (a quantity fell out).
        self.coverage_changed = False
        if self.routing is not None:
            plan = self._apply_routing(plan, strict)
            self.plan = plan
        self.setup = plan.backward_setup(extensions)
        self.guards = [_Guarded(q) for q in plan.consumers]
        autograd = self.routing.autograd if self.routing is not None else []
        self.hook = engine.ExtensionHook(
            index={id(p): i for i, p in enumerate(params)},
            consumers=self.guards,
            global_step=plan.global_step,
            needed=self.setup.needed,
            free=self.setup.free_in_hook,
            elsewhere=frozenset(autograd),
        )
        if autograd:
            engine.leave_to_autograd(
                self.setup.extensions, router.modules_only_in(autograd)
            )
        self._chunk, self._max_elements = chunk, max_elements
        self._strict = strict
        self.grads_before = [
            (p.grad, p.grad._version if p.grad is not None else None) for p in params
        ]
        if debug:  # cockpit-for-pytorch 1.0.2 prints the plan with debug=True
            print(
                f"[cockpit] step {plan.global_step}: quantities "
                f"{[q.key for q in plan.active]}, extensions "
                f"{list(self.setup.extensions)}, create_graph {plan.create_graph}, "
                f"protected {sorted(engine.savefields(extensions))}"
            )
        self._stack = contextlib.ExitStack()
        self._save_memory = save_memory
        self._debug = debug

    def _apply_routing(self, plan: StepPlan, strict: bool) -> StepPlan:
        """Report coverage, enforce ``strict``, leave out what cannot be computed."""
        routing = self.routing
        labels = [self.diagnostics.param_label(i) for i in range(len(self.params))]
        self.coverage = routing.coverage(plan, self.params, labels, self._probes)
        step = plan.global_step
        if strict and self.coverage is not None and self.coverage.problems():
            problems = self.coverage.problems()
            raise CoverageError(
                f"strict=True, but at step {step} {len(problems)} value(s) would not "
                f"be exact: {'; '.join(problems[:3])}"
                f"{' ...' if len(problems) > 3 else ''}. Fix: see "
                "cockpit.coverage() for who computes what, drop these quantities, "
                "or use Cockpit(..., strict=False) (estimates are then recorded "
                "with their standard error, values not covered as missing)."
            )
        slow = [
            labels[i]
            for i in routing.autograd
            if routing.routes[i].reason.startswith(BEFORE_BATCHNORM)
        ]
        if slow:
            n = routing.losses.shape[0] if routing.losses is not None else None
            self.diagnostics.warn_once(
                "batchnorm-autograd", _batchnorm_autograd(slow, n)
            )
        groups: dict[tuple[str, str], list[str]] = {}
        for quantity, reason, fix in routing.dropped.values():
            groups.setdefault((reason, fix), []).append(quantity.key)
        for (reason, fix), keys in groups.items():  # one warning per reason and step
            self.diagnostics.missing(
                self.recorder,
                [step],
                keys,
                f"{reason} (also at later steps like it). Fix: {fix}. "
                "cockpit.coverage() says who computes what",
                once=("not-covered", reason),
            )
        if routing.dropped:
            plan = plan.without(entry[0] for entry in routing.dropped.values())
        if routing.estimated:  # BackPACK computes no curvature; they read estimates
            plan = replace(  # (and per-sample results, e.g. TICTrace, from the engines)
                plan,
                requested=tuple(engine.first_order(plan.requested)),
                consumers=tuple(
                    q
                    for q in plan.consumers
                    if id(q) not in routing.estimated
                    or q.needs_at(step) & PER_SAMPLE_NEEDS
                ),
            )
        if not any(q.needs_at(step) & PER_SAMPLE_NEEDS for q in plan.consumers):
            routing.autograd = []
        return plan

    # --- opening and closing -------------------------------------------------------
    def open(self) -> None:
        """Prepare the quantities and enter the backward context.

        Parameters BackPACK has no rule for get their per-sample gradients from
        the autograd engine here, before the user's backward pass frees the
        graph, and are shown to the quantities right away.
        """
        if self.communicator is not None and self.plan.active:
            self.shared = self._exchange_header()
        for q in self.plan.active:
            q.begin_step(self.plan.global_step, self.info, self.shared)
        if self.routing is not None and self.routing.autograd:
            self._run_autograd(self.routing.autograd, self.routing.losses)
        self.estimates: dict[int, list[Tensor]] = {}
        self._probe_traces: dict[int, Tensor] = {}
        self.estimate_guards: list[_Guarded] = []
        if self.routing is not None and self.routing.estimated:
            self._run_hutchinson(list(self.routing.estimated.values()))
        if self.shared is not None:
            self._prepare_shared()
        loss = self.info.get("loss") if self.info.has("loss") else None
        if isinstance(loss, Tensor) and loss.requires_grad and self.plan.active:
            self._capture_hooks.append(loss.register_hook(self._seed_seen))
        stack = self._stack
        # BackPACK's and PyTorch's per-step hook warnings are noise here (see
        # _ENGINE_MESSAGES); every other warning of the backward pass is left alone
        stack.enter_context(quiet_warnings(*_ENGINE_MESSAGES))
        if self.plan.create_graph:
            # PyTorch warns that create_graph makes a parameter <-> .grad cycle;
            # the step breaks it when it closes (_release_graph).
            stack.enter_context(
                quiet_warnings(_CREATE_GRAPH_WARNING, category=UserWarning)
            )
        stack.enter_context(
            engine.backward_context(
                self.setup.extensions, self.hook, self._save_memory, self._debug
            )
        )

    # --- data-parallel runs ------------------------------------------------------
    def _exchange_header(self) -> distributed.StepComm:
        """Send the step, this shard's size and the plan to the other processes.

        The header travels during the backward pass; :meth:`_share` (or the first
        quantity that needs the counts earlier) waits for it and checks it.
        """
        info, step = self.info, self.plan.global_step
        if info.has("batch_size"):
            n_local = int(info.get("batch_size"))
        elif isinstance(info.get("individual_losses"), Tensor):
            n_local = int(info.get("individual_losses").shape[0])
        else:
            raise KeyError(
                f"In a data-parallel run cockpit needs info['batch_size'] (the "
                f"number of samples of this process) at step {step} to weight the "
                f"processes' shards. Fix: pass it as cockpit({step}, "
                "info={'batch_size': x.shape[0], ...}), or "
                "Cockpit(..., process_group=None) for rank-local values."
            )
        plan_text = ";".join(
            f"{q.key}:{sorted(n.name for n in q.needs_at(step))}"
            for q in self.plan.active
        )
        plan_text += f";no_sync={self.no_sync}"  # the joined gradient's collective
        return distributed.start_header(self.communicator, step, n_local, plan_text)

    def _prepare_shared(self) -> None:
        """Before the backward pass of a data-parallel step.

        Hessian-vector products need this shard's gradient with its graph, which
        DDP cannot give (``backward(create_graph=True)`` fails under DDP), and the
        forward graph, which the user's backward pass frees: the quantities that
        need them (HessMaxEV) are computed here, before it, from this shard's
        gradient with its graph (each product averaged over the processes). With
        shards of different sizes, or inside DDP's ``no_sync()`` (where ``.grad``
        stays this process's own), each parameter's local gradient is caught on
        its way to DDP, to join the shards' gradients (weighted by their sizes)
        afterwards.
        """
        shared, step = self.shared, self.plan.global_step
        last = [q for q in self.plan.last if id(q) not in self._skip]
        if self.plan.create_graph and last:
            loss = self.info.require("loss", "cockpit (Hessian-vector products)")
            ctx = TrackContext(step, self.params, self.info, comm=shared)
            with engine.quiet_backward():
                grads = torch.autograd.grad(
                    loss, self.params, create_graph=True, allow_unused=True
                )
                shared.graph_gradients = [
                    g if g is not None else torch.zeros_like(p)
                    for g, p in zip(grads, self.params, strict=True)
                ]
                for quantity in last:
                    try:
                        self._early[id(quantity)] = (
                            quantity.track_step(step, ctx),
                            None,
                        )
                    except Exception as error:  # handled where it is recorded
                        self._early[id(quantity)] = (None, error)
            shared.graph_gradients = None  # frees the double-backward graph
        if (
            self.communicator.local
            or self.no_sync
            or not shared.settled
            or shared.uneven
        ):
            for index, param in enumerate(self.params):
                self._capture_hooks.append(param.register_hook(self._catcher(index)))

    def _catcher(self, index: int):
        """A hook that keeps parameter ``index``'s local gradient where needed.

        Rank-local runs (``.grad`` becomes DDP's average) and steps inside DDP's
        ``no_sync()`` (``.grad`` stays this process's own) always need it; other
        data-parallel steps only with shards of different sizes. The hook never
        waits for the header (the backward pass goes on while it travels): until
        it has arrived with equal shard sizes, gradients are kept, and
        :meth:`_share` drops them if the shards turn out even.
        """
        shared = self.shared
        always = self.communicator.local or self.no_sync

        def catch(grad):
            if always or not shared.known_even():
                self._captured[index] = grad.detach().clone()

        return catch

    def _seed_seen(self, grad: Tensor) -> None:
        """Keep the gradient of ``info["loss"]`` (the backward pass's seed)."""
        self._seeds.append(grad.detach().reshape(-1)[:1].clone())

    def _loss_scale(self) -> float | None:
        """The factor the backward pass scaled ``info["loss"]`` by (``None``: 1)."""
        if not self._seeds:
            return None
        seeds = torch.cat([s.to(torch.float64) for s in self._seeds])
        if bool((seeds == 1).all()):
            return None
        return float(seeds[seeds != 1][0])

    def _drop_scaled(self, scale: float) -> None:
        """Leave out the quantities that read gradients of a scaled backward pass."""
        step = self.plan.global_step
        reason = _scaled_backward(scale)
        for q in self.plan.active:
            if q.needs_at(step) - {Need.PARAMETERS} or q.extensions(step):
                q.abort_step(step)
                self._skip.add(id(q))
                self.diagnostics.missing(
                    self.recorder, [step], q.key, reason, once=("scaled", q.key)
                )

    def _remove_capture_hooks(self) -> None:
        for handle in self._capture_hooks:
            handle.remove()
        self._capture_hooks = []

    def _share(self, ctx: TrackContext, quantities: list[Quantity]) -> TrackContext:
        """Combine the processes: the joined batch's gradient, info and sums.

        Returns:
            The context the quantities are tracked with: ``info`` of the joined
            batch (``loss``, ``batch_size``, ``individual_losses``), its gradient
            and the data-parallel step.
        """
        shared, info, step = self.shared, self.info, self.plan.global_step
        self._remove_capture_hooks()
        shared.settle()
        if shared.uneven:
            self.diagnostics.warn_once(
                "uneven-shards", distributed.uneven_message(shared.counts, step)
            )
        if self.communicator.local:  # .grad is DDP's average: the shard's own
            shared.gradients = [
                self._captured.get(i, torch.zeros_like(p))
                for i, p in enumerate(self.params)
            ]
            self._captured.clear()
        elif shared.uneven or self.no_sync:  # .grad is not the joined gradient
            local = [self._captured.get(i) for i in range(len(self.params))]
            shared.gradients = distributed.joined_gradients(shared, local, self.params)
            self._captured.clear()
        else:
            self._captured.clear()  # kept while the header travelled: not needed
            shared.gradients = gradients(self.params)
        if not (self.communicator.local or self.no_sync) and not getattr(
            self.communicator, "checked_gradients", False
        ):  # inside no_sync() the processes' .grad differ by design
            self._check_synchronised(shared)
        ctx = TrackContext(step, self.params, info, comm=shared, grads=shared.gradients)
        bucket = distributed.Bucket(shared)
        joined = dict(info.values)
        if info.has("loss"):
            loss = info.get("loss")
            loss = loss.detach() if isinstance(loss, Tensor) else torch.tensor(loss)
            n = shared.n_global
            bucket.sum(loss * shared.n_local, lambda v: joined.update(loss=v / n))
        losses = info.get("individual_losses")
        if isinstance(losses, Tensor) and losses.shape[:1] == (shared.n_local,):
            per_sample = autograd_engine.sample_losses(losses.detach())
            bucket.gather(per_sample, lambda v: joined.update(individual_losses=v))
        joined["batch_size"] = shared.n_global
        for quantity in quantities:
            if quantity.share(step, ctx, bucket) is NotImplemented:
                self.diagnostics.warn_once(
                    ("rank-local", quantity.key),
                    distributed.rank_local_message(quantity.key),
                )
        for id_, traces in self._probe_traces.items():

            def errors(total, id_=id_):
                self.estimates[id_] = (
                    autograd_engine.trace_errors(total),
                    autograd_engine.sum_error(total),
                )
                quantity = self.routing.estimated[id_]
                if hasattr(quantity, "probe_traces"):
                    quantity.probe_traces(total)

            bucket.sum(traces * shared.weight, errors)
        bucket.reduce()
        return replace(ctx, info=StepInfo(step, joined))

    def _check_synchronised(self, shared: distributed.StepComm) -> None:
        """At the first tracked step: are the gradients the same on every process?

        cockpit assumes the parameters are trained data-parallel (DDP averages
        ``.grad`` over processes). If they differ, the numbers would mix
        unrelated models.

        Raises:
            DistributedError: On every process, naming both fixes.
        """
        checksum = torch.stack(
            [g.detach().to(torch.float64).sum() for g in shared.gradients]
        ).sum()
        pair = torch.stack([checksum, -checksum])
        largest = self.communicator.all_reduce(
            pair, "comparing gradients", shared.global_step, op="max"
        )
        self.communicator.checked_gradients = True
        high, low = float(largest[0]), -float(largest[1])
        if abs(high - low) > 1e-6 * max(1.0, abs(high), abs(low)):
            raise distributed.DistributedError(
                f"cockpit at step {shared.global_step}: the gradients differ across "
                f"processes (checksums from {low:.6g} to {high:.6g}), so the "
                "parameters are not trained data-parallel. Fix: wrap the model in "
                "torch.nn.parallel.DistributedDataParallel (a step tracked inside "
                "its no_sync() needs `with cockpit(step, info=..., no_sync=True)`), "
                "or pass Cockpit(..., process_group=None) for values of each "
                "process's own shard."
            )

    def _run_autograd(self, indices: list[int], losses: Tensor) -> None:
        """Per-sample gradients of ``indices``: replayed modules, then autograd."""
        params = [self.params[i] for i in indices]
        methods: dict[int, str] = {}
        with engine.quiet_backward():
            if self._replayer is not None:
                self._replayer.watch_chains(params)  # from the next step on if new
                replayed = self._replayer.per_sample_gradients(
                    losses, params, self._max_elements
                )
                for position, grads in replayed:
                    who = self._replayer.module_of.get(position, "a module")
                    methods[indices[position]] = f"{REPLAY} {who}"
                    self._show_individual(indices[position], params[position], grads)
            rest = [k for k in range(len(params)) if indices[k] not in methods]
            for k in rest:
                methods[indices[k]] = PER_SAMPLE_BACKWARD
            if self.coverage is not None:
                self.coverage = self.coverage.with_methods(methods)
            results = autograd_engine.per_sample_gradients(
                losses, [params[k] for k in rest], self._chunk, self._max_elements
            )
            for position, grads in results:
                k = rest[position]
                self._show_individual(indices[k], params[k], grads)

    def _show_individual(self, index: int, param: Tensor, grads: Tensor) -> None:
        self.hook.visited.add(index)
        individual = DenseGradients(grads, scale=1)
        with torch.no_grad():
            self.hook.show(param, index, ParamResults(individual))

    def _run_hutchinson(self, quantities: list[Quantity]) -> None:
        """Show Hutchinson estimates of the Hessian diagonal to ``quantities``."""
        try:
            with engine.quiet_backward():
                diagonals, errors, traces = autograd_engine.hutchinson_diagonals(
                    self.routing.losses,
                    self.params,
                    self._probes,
                    self._router.generator,
                    return_traces=True,
                )
        except RuntimeError as error:
            if not _no_double_backward(error):
                raise
            for quantity in quantities:
                self._without_double_backward(quantity, error)
                self._skip.add(id(quantity))
            return
        self.estimate_guards = [_Guarded(q) for q in quantities]
        step = self.plan.global_step
        with torch.no_grad():
            for index, (param, diagonal) in enumerate(
                zip(self.params, diagonals, strict=True)
            ):
                view = ParamView(
                    param, index, ParamResults(curvatures={"diag_h": diagonal})
                )
                for guard in self.estimate_guards:
                    guard.accumulate(step, view)
                view.release()
        total = autograd_engine.sum_error(traces)
        for quantity in quantities:
            self.estimates[id(quantity)] = (errors, total)
            if hasattr(quantity, "probe_traces"):  # errors of its own (TICTrace)
                quantity.probe_traces(traces)
            if self.shared is not None:  # errors of the joined batch's estimate
                self._probe_traces[id(quantity)] = traces

    def fail(self, error: BaseException) -> Exception | None:
        """Abandon the step after ``error`` in the backward pass.

        Returns:
            A clearer error to raise instead, or ``None`` to re-raise ``error``.
        """
        try:
            self._stack.__exit__(type(error), error, error.__traceback__)
        finally:
            self._remove_capture_hooks()
            self._abort()
            self._free(self.setup.free_after)
            if self.plan.create_graph:
                self._release_graph()
            self.recorder.discard()  # nothing half-right of a failed step
        return self.diagnostics.explain(error, self.plan)

    def close(self) -> None:
        """Leave the backward context, check the step, track and record."""
        self._stack.close()
        try:
            if self.plan.active:
                self._after_backward()
        except BaseException:
            self._abort()
            self.recorder.discard()  # nothing half-right of a failed step
            raise
        finally:
            self._remove_capture_hooks()
            self._free(self.setup.free_after)
            if self.plan.create_graph:
                self._release_graph()
            self.recorder.flush()

    # --- after the backward pass ---------------------------------------------------
    def _after_backward(self) -> None:
        step = self.plan.global_step
        if self.hook.repeated:  # per-sample results of one backward, .grad of all
            for q in self.plan.active:
                q.abort_step(step)
                self.recorder.note_missing(step, q.key, _REPEATED)
            self.diagnostics.warn_once("repeated-backward", _REPEATED_WARNING)
            return
        nonfinite = self.diagnostics.nonfinite(self.info)
        if nonfinite:
            self.recorder.record(step, NONFINITE_KEY, nonfinite)
        scale = self._loss_scale()
        if scale is not None:
            self._drop_scaled(scale)
        self.diagnostics.modules(self.plan, self.hook)
        unused = self.diagnostics.unreached(self.plan, self.hook, self.grads_before)
        batch_size = self.hook.batch_size
        if batch_size is None and self.info.has("batch_size"):
            batch_size = int(self.info.get("batch_size"))
        for index in unused:
            param = self.params[index]
            fields = engine.savefields(self.plan.requested)
            self.hook.show(param, index, engine.zero_results(param, fields, batch_size))
        failed = [
            g
            for g in self.guards + self.estimate_guards
            if g.error is not None and id(g.quantity) not in self._skip
        ]
        if failed and not nonfinite:
            raise failed[0].error
        for guard in failed:
            self._drop(guard.quantity, guard.error)
        dropped = {id(g.quantity) for g in failed} | self._skip
        ctx = TrackContext(step, self.params, self.info)
        if self.shared is not None:
            ctx = self._share(
                ctx, [q for q in self.plan.active if id(q) not in dropped]
            )
        tolerant = bool(nonfinite)
        for q in self.plan.first:
            if id(q) not in dropped:
                self._track(q, ctx, tolerant)
        self._free(self.setup.free_after)
        last = [q for q in self.plan.last if id(q) not in dropped]
        if last:
            # the extra backward passes (HVPs) fire BackPACK's module hooks too
            with engine.disabled(), quiet_warnings("Full backward hook is firing"):
                for q in last:
                    self._track(q, ctx, tolerant)

    def _track(self, quantity: Quantity, ctx: TrackContext, tolerant: bool) -> None:
        is_end = getattr(quantity, "is_end", None)  # a two-step value finished here
        ends = bool(is_end(ctx.global_step)) if callable(is_end) else False
        try:
            if id(quantity) in self._early:  # computed before the backward pass
                results, error = self._early.pop(id(quantity))
                if error is not None:
                    raise error
            else:
                results = quantity.track_step(ctx.global_step, ctx)
        except Exception as error:
            if _no_double_backward(error):
                self._without_double_backward(quantity, error)
                return
            if not tolerant:
                raise
            self._drop(quantity, error, ends)  # a non-finite step must not crash
            return
        for save_step, value in results:
            if isinstance(value, Missing):
                self.diagnostics.missing(
                    self.recorder, [save_step], quantity.key, value.reason
                )
            elif value is not None:
                self.recorder.record(save_step, quantity.key, value)
                errors = self.estimates.get(id(quantity))
                if errors is not None and hasattr(quantity, "estimate_error"):
                    errors = quantity.estimate_error(save_step)  # propagated
                if errors is not None:
                    per_param, total = errors
                    self.recorder.record(
                        save_step,
                        f"{quantity.key}{ESTIMATE_SUFFIX}",
                        {
                            "method": "hutchinson",
                            "probes": self._probes,
                            "stderr": [float(e) for e in per_param],
                            "stderr_sum": float(total),
                        },
                    )

    def _without_double_backward(self, quantity: Quantity, error: Exception) -> None:
        """A quantity whose second derivatives PyTorch cannot compute: say the fix."""
        step = self.plan.global_step
        quantity.abort_step(step)
        message = (
            f"{quantity.key} needs second derivatives (Hessian-vector products), but "
            f"PyTorch has no double backward for an operation of the model "
            f"({error}). Fix: for fused attention (F.scaled_dot_product_attention, "
            "nn.MultiheadAttention, nn.TransformerEncoderLayer) run the forward "
            "pass of tracked steps inside `with torch.nn.attention.sdpa_kernel("
            "torch.nn.attention.SDPBackend.MATH):`; otherwise drop the quantity."
        )
        if self._strict:
            raise CoverageError(f"strict=True: {message}") from error
        self.diagnostics.missing(self.recorder, [step], quantity.key, message)
        if self.coverage is not None:  # the report said it would be computed
            self.coverage = self.coverage.with_status(
                quantity.key,
                Status(
                    MISSING,
                    "PyTorch has no double backward for an operation of the model "
                    "(fused attention: run tracked forward passes inside "
                    "sdpa_kernel(SDPBackend.MATH))",
                ),
            )
            self.coverage_changed = True

    def _drop(self, quantity: Quantity, error: Exception, ended: bool = False) -> None:
        """Record a quantity that failed on a non-finite step as missing there.

        A two-step value that this step was to finish (``ended``: Alpha of the step
        before) is missing at its own step too. Warned once per key.
        """
        step = self.plan.global_step
        quantity.abort_step(step)
        reason = (
            f"it failed on the non-finite step {step} ({type(error).__name__}: "
            f"{error}); training goes on. Fix: see the warning about non-finite "
            "values"
        )
        steps = [step - 1, step] if ended else [step]
        self.diagnostics.missing(
            self.recorder, steps, quantity.key, reason, once=("dropped", quantity.key)
        )

    # --- cleanup -------------------------------------------------------------------
    def _abort(self) -> None:
        for q in self.plan.active:
            q.abort_step(self.plan.global_step)

    def _free(self, fields) -> None:
        for p in self.params:
            engine.free_buffers(p, fields)

    def _release_graph(self) -> None:
        """Detach ``.grad`` after a ``create_graph`` backward.

        This breaks the parameter -> grad -> graph -> parameter cycle that would
        otherwise keep the double-backward graph alive; the values are unchanged.
        """
        for p in self.params:
            if p.grad is not None and p.grad.grad_fn is not None:
                p.grad = p.grad.detach()


def q_estimable(quantity: Quantity) -> frozenset:
    """Curvature needs for which ``quantity`` accepts an unbiased estimate."""
    return frozenset(getattr(quantity, "estimable", frozenset()))


def _refuse_unextended(routes: list[Route], router: Router, who) -> None:
    """Fail when a module that BackPACK could handle was not extended.

    Without the per-sample losses the autograd engine cannot step in, and a
    forgotten ``backpack.extend`` is the likelier mistake.

    Raises:
        RuntimeError: Naming the parameters and both fixes.
    """
    unextended = [
        i for i, r in enumerate(routes) if "is not backpack.extend-ed" in r.reason
    ]
    if unextended:
        names = ", ".join(q.key for q in who)
        shapes = ", ".join(
            f"#{i} (shape {tuple(router.params[i].shape)})" for i in unextended
        )
        raise RuntimeError(
            f"BackPACK produced no results for parameter(s) {shapes}, which {names} "
            "need: their modules are not extended. Fix: call backpack.extend() on "
            "the model and on the loss function before the forward pass, or pass "
            "info['individual_losses'] (reduction='none', with its graph) so that "
            "cockpit computes them with autograd."
        )


def _no_double_backward(error: Exception) -> bool:
    """Whether ``error`` is PyTorch's missing derivative of a backward operator."""
    text = str(error)
    return (
        isinstance(error, RuntimeError)
        and "derivative for" in text
        and "backward" in text
        and "not implemented" in text
    )


def as_info(global_step: int, info: dict[str, Any] | None) -> StepInfo:
    """Wrap the user's ``info`` for one step."""
    return StepInfo(global_step, dict(info or {}))
