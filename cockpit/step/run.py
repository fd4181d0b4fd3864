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
from cockpit.engines.base import EngineStep
from cockpit.engines.coverage import CoverageError
from cockpit.errors import quiet_warnings
from cockpit.param_view import Dispatcher
from cockpit.quantities.base import Quantity, TrackContext
from cockpit.step.features import STOP, feature_classes
from cockpit.step.features.estimators import no_double_backward
from cockpit.step.features.failures import Guarded
from cockpit.step.ledger import Ledger
from cockpit.step.routing import StepRouting, double_backward_reason

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
        self.info, self.params, self.step = info, cockpit.params, plan.global_step
        self.router, self.recorder = cockpit._router, cockpit.recorder
        self.diagnostics, self.probes = cockpit._diagnostics, cockpit.HUTCHINSON_PROBES
        self.communicator, self.no_sync = cockpit._communicator, no_sync
        self.strict, self.debug = cockpit.strict, debug
        self.shared = self.probe_traces = self.ctx = None
        self.tolerant, self.coverage_changed = False, False
        self.early: dict[int, tuple[list | None, Exception | None]] = {}
        self.features: list = []
        self.diagnostics.before(plan, info)
        self.ledger = Ledger(plan, self.recorder, self.diagnostics)
        options = {
            "chunk": cockpit.PER_SAMPLE_CHUNK,
            "max_elements": cockpit.PER_SAMPLE_MAX_ELEMENTS,
            "save_memory": cockpit.BACKPACK_CONV_SAVE_MEMORY,
        }
        self.routing = StepRouting(self, plan, extensions, options)
        self.plan = self.routing.adjusted(self.ledger.plan())
        self.coverage = self.routing.coverage(self.plan)
        self.guards = [Guarded(q) for q in self.plan.consumers]
        self.dispatcher = Dispatcher(list(self.guards), self.step)
        self.engine_step: EngineStep = self.routing.engine_step
        self.engine_step.show = self._show
        self.engines = self.routing.engines
        self.routing.prepare(self.plan, self.dispatcher)
        # the batch size of unused parameters' zeros, from the first per-sample view
        self.dispatcher.sized = self.routing.engine_step.per_sample or bool(
            self.plan.legacy
        )
        self._stack = contextlib.ExitStack()

    def _show(self, index: int, results) -> None:
        self.dispatcher.show(index, self.params[index], results)

    def quiet(self) -> contextlib.AbstractContextManager:
        """A context for extra backward passes before the user's."""
        stack = contextlib.ExitStack()
        for engine in self.engines:
            stack.enter_context(engine.quiet())
        return stack

    def zero_results(self, index: int, batch_size: int | None):
        """Exact zero results of an unused parameter (from the step's engines)."""
        return self.routing.zero_results(index, batch_size)

    # --- opening and closing -------------------------------------------------------
    def open(self) -> None:
        """Begin the quantities, run the engines before the backward, enter contexts.

        Parameters served before the backward pass (replay, autograd) get their
        per-sample results here, before the user's backward pass frees the graph,
        and are shown to the quantities right away.
        """
        self.features = [cls(self) for cls in feature_classes() if cls.applies(self)]
        for q in self.plan.active:
            q.begin_step(self.step, self.info, self.shared)
        methods = self.routing.run_before_backward(self.quiet)
        if methods and self.coverage is not None:
            self.coverage = self.coverage.with_methods(methods)
        for feature in self.features:
            feature.before_backward()
        stack = self._stack
        stack.enter_context(quiet_warnings(*_ENGINE_MESSAGES))
        if self.plan.create_graph:  # the step breaks the cycle when it closes
            stack.enter_context(
                quiet_warnings(_CREATE_GRAPH_WARNING, category=UserWarning)
            )
        for engine, indices in self.routing.served.items():
            stack.enter_context(engine.backward_context(self.engine_step, indices))

    def fail(self, error: BaseException) -> Exception | None:
        """Abandon the step after ``error`` in the backward pass.

        Returns:
            A clearer error to raise instead, or ``None`` to re-raise ``error``.
        """
        try:
            self._stack.__exit__(type(error), error, error.__traceback__)
        finally:
            self._abort()
        for engine in self.engines:
            explain = getattr(engine, "explain", None)
            clearer = explain and explain(
                error, self.plan, self.diagnostics.module_label
            )
            if clearer is not None:
                return clearer
        return None

    def close(self) -> None:
        """Leave the backward contexts, check the step, track and record."""
        self._stack.close()
        try:
            if self.plan.active:
                self._after_backward()
            self.ledger.settle()
        except BaseException:
            self._abort()
            raise
        finally:
            self._cleanup()
            self.recorder.flush()

    # --- after the backward pass ---------------------------------------------------
    def _after_backward(self) -> None:
        for feature in self.features:
            if feature.after_backward() == STOP:
                return
        ctx = self.ctx or TrackContext(self.step, self.params, self.info)
        for q in self.plan.first:
            if not self.ledger.out(q):
                self._track(q, ctx)
        self.routing.free(late=True)
        last = [q for q in self.plan.last if not self.ledger.out(q)]
        if last:  # the extra backward passes (HVPs) must not fire the engines' hooks
            with self.routing.idle():
                for q in last:
                    self._track(q, ctx)

    def _track(self, quantity: Quantity, ctx: TrackContext) -> None:
        ends = quantity.finishes(ctx.global_step)  # a two-step value finished here
        try:
            if id(quantity) in self.early:  # computed before the backward pass
                results, error = self.early.pop(id(quantity))
                if error is not None:
                    raise error
            else:
                results = quantity.track_step(ctx.global_step, ctx)
        except Exception as error:
            if no_double_backward(error):
                self.without_double_backward(quantity, error)
                return
            if not self.tolerant:
                raise
            from cockpit.step.features.nonfinite import failed_reason

            steps = [self.step - 1, self.step] if ends else [self.step]
            reason = failed_reason(self.step, error)
            self.ledger.leave_out(
                quantity, reason, steps, once=("dropped", quantity.key)
            )
            return
        for save_step, value in results:
            self.ledger.record(quantity, save_step, value)

    def without_double_backward(self, quantity: Quantity, error: Exception) -> None:
        """A quantity whose second derivatives PyTorch cannot compute: say the fix."""
        reason, status = double_backward_reason(quantity.key, error)
        if self.strict:
            raise CoverageError(f"strict=True: {reason}") from error
        self.ledger.leave_out(quantity, reason)
        if self.coverage is not None:  # the report said it would be computed
            self.coverage = self.coverage.with_status(quantity.key, status)
            self.coverage_changed = True

    # --- cleanup -------------------------------------------------------------------
    def _abort(self) -> None:
        for q in self.plan.active:
            q.abort_step(self.step)
        self._cleanup()
        self.recorder.discard()  # nothing half-right of a failed step

    def _cleanup(self) -> None:
        for feature in self.features:
            feature.close()
        self.routing.free(late=True)
        if self.plan.create_graph:
            self._release_graph()
        # the features, the routing and the engines' step point back at this run:
        # without these cycles a finished step is freed at once, not by the cycle
        # collector (it holds the recorder, and with it the log and its lock)
        self.features = []
        self.engine_step.show = None
        self.routing.release()

    def _release_graph(self) -> None:
        """Detach ``.grad`` after a ``create_graph`` backward.

        This breaks the parameter -> grad -> graph -> parameter cycle that would
        otherwise keep the double-backward graph alive; the values are unchanged.
        """
        for p in self.params:
            if p.grad is not None and p.grad.grad_fn is not None:
                p.grad = p.grad.detach()


def as_info(global_step: int, info: dict[str, Any] | None) -> StepInfo:
    """Wrap the user's ``info`` for one step."""
    return StepInfo(global_step, dict(info or {}))
