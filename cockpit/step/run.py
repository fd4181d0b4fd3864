"""One tracked step: open, the user's backward pass, close, track.

:class:`StepRun` is what :meth:`Cockpit.begin <cockpit.Cockpit.begin>` opens and
:meth:`Cockpit.end <cockpit.Cockpit.end>` closes. It is a template:

1. **route** (when made): the router asks the engines who serves which parameter;
   what cannot be served goes into the step's :class:`~cockpit.step.ledger.Ledger`;
2. **open**: the quantities begin the step, the engines that need the forward graph
   run, the step features (:mod:`cockpit.step.features`) run their
   ``before_backward``, and the engines' contexts are entered;
3. **close**: the contexts are left, the features run ``after_backward`` (checks,
   data-parallel joining), and the quantities are tracked; the ledger records the
   values, their standard errors and what is missing. Buffers are freed whatever
   happens.
"""

from __future__ import annotations

import contextlib
from typing import Any

from cockpit.context import StepInfo
from cockpit.curvature.hutchinson import no_double_backward
from cockpit.engines.coverage import CoverageError
from cockpit.errors import quiet_warnings
from cockpit.param_view import Dispatcher
from cockpit.quantities.base import Quantity, TrackContext
from cockpit.step.features import features_for
from cockpit.step.features.backward_checks import Guarded, failed_reason
from cockpit.step.ledger import Ledger
from cockpit.step.routing import StepRouting, double_backward_reason
from cockpit.step.state import Produced, StepState

#: PyTorch's warning about backward(create_graph=True), silenced on cockpit's steps.
_CREATE_GRAPH_WARNING = r"Using backward\(\) with create_graph=True"
#: Engine warnings at every tracked step, said better by the coverage report:
#: PyTorch's "Full backward hook is firing ..." (BackPACK's hooks on a layer whose
#: input needs no gradient) and BackPACK's "... does not have an extension ...".
_ENGINE_MESSAGES = (
    "Full backward hook is firing",
    r"Extension saving to \w+ does not have an extension for Module",
)


class StepRun:
    """One tracked step, from before ``loss.backward()`` to the recorded values.

    Args:
        plan: What the quantities ask of the step.
        info: The step's ``info``.
        cockpit: The cockpit (its parameters, router, recorder, checks, settings).
        extensions: The user's extra BackPACK extensions.
        debug: Print the step's plan and turn on BackPACK's debug output.
        no_sync: The backward pass runs inside DDP's ``no_sync()``.
    """

    def __init__(self, plan, info: StepInfo, cockpit, extensions=(), debug=False,
                 no_sync=False):  # fmt: skip
        checks, recorder = cockpit._checks, cockpit.recorder
        self.strict = cockpit.strict
        self.coverage_changed = False
        self.features: list = []
        checks.before(plan, info)
        ledger = Ledger(plan, recorder, checks)
        options = {
            "chunk": cockpit.PER_SAMPLE_CHUNK,
            "max_elements": cockpit.PER_SAMPLE_MAX_ELEMENTS,
            "save_memory": cockpit.BACKPACK_CONV_SAVE_MEMORY,
            "debug": debug,
        }
        settings = {
            "user": extensions,
            "options": options,
            "probes": cockpit.HUTCHINSON_PROBES,
            "parallel": cockpit._communicator is not None,
            "strict": self.strict,
        }
        self.routing = routing = StepRouting(
            cockpit._router, plan, info, ledger, checks, settings
        )
        plan = routing.adjusted(ledger.plan())
        self.coverage = routing.coverage(plan)
        guards = tuple(Guarded(q) for q in plan.consumers)
        #: What the features produced so far (the quantities' own guards first).
        self.produced = Produced(guards=guards)
        dispatcher = Dispatcher(list(guards), plan.global_step)
        engine_step = routing.engine_step
        params = cockpit.params
        # the engines' tensor: FSDP2's unsharded parameter (else the same)
        shown = cockpit._router.params
        engine_step.show = lambda index, results: dispatcher.show(
            index, shown[index], results
        )
        routing.prepare(plan, dispatcher)
        # the batch size of unused parameters' zeros, from the first per-sample view
        dispatcher.sized = engine_step.per_sample or bool(plan.legacy)
        self.state = StepState(
            step=plan.global_step,
            params=params,
            info=info,
            plan=plan,
            probes=cockpit.HUTCHINSON_PROBES,
            generator=cockpit._router.generator,
            communicator=cockpit._communicator,
            no_sync=no_sync,
            ledger=ledger,
            engine=engine_step,
            engines=tuple(routing.engines),
            dispatcher=dispatcher,
            checks=checks,
            recorder=recorder,
        )
        self._stack = contextlib.ExitStack()

    @property
    def plan(self):
        """The step's plan (after the routing)."""
        return self.state.plan

    @property
    def step(self) -> int:
        """The global step."""
        return self.state.step

    @property
    def info(self) -> StepInfo:
        """The step's ``info``."""
        return self.state.info

    @property
    def ledger(self) -> Ledger:
        """The step's ledger."""
        return self.state.ledger

    def _take(self, produced: Produced) -> None:
        """Fold a feature's result into the step's (see :mod:`cockpit.step.state`)."""
        self.produced = self.produced.then(produced)
        for quantity, error in produced.undifferentiable:
            self.without_double_backward(quantity, error)

    # --- opening and closing -------------------------------------------------------
    def open(self) -> None:
        """Begin the quantities, run the engines before the backward, enter contexts.

        Parameters served before the backward pass (replay, autograd) get their
        per-sample results here, before the user's backward pass frees the graph,
        and are shown to the quantities right away.
        """
        state = self.state
        features = features_for(state)
        for feature in features:
            if "begin" in feature._phases:
                produced = feature.begin()
                if produced is not None:
                    self._take(produced)
        self.features = features
        for q in state.plan.active:
            q.begin_step(state.step, state.info, self.produced.comm)
        methods = self.routing.run_before_backward(self.routing.quiet)
        if methods and self.coverage is not None:
            self.coverage = self.coverage.with_methods(methods)
        for feature in self.features:
            if "before_backward" in feature._phases:
                produced = feature.before_backward()
                if produced is not None:
                    self._take(produced)
        stack = self._stack
        stack.enter_context(quiet_warnings(*_ENGINE_MESSAGES))
        if state.plan.create_graph:  # the step breaks the cycle when it closes
            stack.enter_context(
                quiet_warnings(_CREATE_GRAPH_WARNING, category=UserWarning)
            )
        for engine, indices in self.routing.served.items():
            stack.enter_context(engine.backward_context(state.engine, indices))

    def fail(self, error: BaseException) -> Exception | None:
        """Abandon the step after ``error`` in the backward pass.

        Returns:
            A clearer error to raise instead, or ``None`` to re-raise ``error``.
        """
        try:
            self._stack.__exit__(type(error), error, error.__traceback__)
        finally:
            self._abort()
        for engine in self.state.engines:
            clearer = engine.explain(error, self.state.engine)
            if clearer is not None:
                return clearer
        return None

    def close(self) -> None:
        """Leave the backward contexts, check the step, track and record."""
        self._stack.close()
        try:
            if self.state.plan.active:
                self._after_backward()
            self.state.ledger.settle()
        except BaseException:
            self._abort()
            raise
        finally:
            self._cleanup()
            self.state.recorder.flush()

    # --- after the backward pass ---------------------------------------------------
    def _after_backward(self) -> None:
        for feature in self.features:
            if "after_backward" in feature._phases:
                produced = feature.after_backward(self.produced)
                if produced is not None:
                    self._take(produced)
                    if produced.stop:
                        return
        state = self.state
        ctx = self.produced.context or TrackContext(
            state.step, state.params, state.info
        )
        early = dict(self.produced.early)
        for q in state.plan.first:
            if not self.state.ledger.out(q):
                self._track(q, ctx, early)
        self.routing.free(late=True)
        last = [q for q in state.plan.last if not self.state.ledger.out(q)]
        if last:  # the extra backward passes (HVPs) must not fire the engines' hooks
            with self.routing.idle():
                for q in last:
                    self._track(q, ctx, early)

    def _track(self, quantity: Quantity, ctx: TrackContext, early: dict) -> None:
        ends = quantity.finishes(ctx.global_step)  # a two-step value finished here
        step = self.state.step
        try:
            if id(quantity) in early:  # computed before the backward pass
                results, error = early.pop(id(quantity))
                if error is not None:
                    raise error
            else:
                results = quantity.track_step(ctx.global_step, ctx)
        except Exception as error:
            if no_double_backward(error):
                self.without_double_backward(quantity, error)
                return
            if not self.produced.tolerant:
                raise
            steps = [step - 1, step] if ends else [step]
            reason = failed_reason(step, error)
            self.state.ledger.leave_out(
                quantity, reason, steps, once=("dropped", quantity.key)
            )
            return
        for save_step, value in results:
            self.state.ledger.record(quantity, save_step, value)

    def without_double_backward(self, quantity: Quantity, error: Exception) -> None:
        """A quantity whose second derivatives PyTorch cannot compute: say the fix."""
        reason, status = double_backward_reason(quantity.key, error)
        if self.strict:
            raise CoverageError(f"strict=True: {reason}") from error
        self.state.ledger.leave_out(quantity, reason)
        if self.coverage is not None:  # the report said it would be computed
            self.coverage = self.coverage.with_status(quantity.key, status)
            self.coverage_changed = True

    # --- cleanup -------------------------------------------------------------------
    def _abort(self) -> None:
        for q in self.state.plan.active:
            q.abort_step(self.state.step)
        self._cleanup()
        self.state.recorder.discard()  # nothing half-right of a failed step

    def _cleanup(self) -> None:
        for feature in self.features:
            if "close" in feature._phases:
                feature.close()
        self.routing.free(late=True)
        if self.state.plan.create_graph:
            self._release_graph()
        # the engines (kept by the cockpit) may hold the engines' step: without its
        # show, which reaches the quantities' guards, a finished step is freed at once
        self.features = []
        self.state.engine.show = None

    def _release_graph(self) -> None:
        """Detach ``.grad`` after a ``create_graph`` backward.

        This breaks the parameter -> grad -> graph -> parameter cycle that would
        otherwise keep the double-backward graph alive; the values are unchanged.
        """
        for p in self.state.params:
            if p.grad is not None and p.grad.grad_fn is not None:
                p.grad = p.grad.detach()


def as_info(global_step: int, info: dict[str, Any] | None) -> StepInfo:
    """Wrap the user's ``info`` for one step."""
    return StepInfo(global_step, dict(info or {}))
