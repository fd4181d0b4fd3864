"""The Cockpit: holds the quantities and runs each tracked step's backward pass.

The hub is small on purpose. Per step it asks the planner what the quantities need
(:func:`cockpit.step.plan.plan_step`, once per step), opens a
:class:`~cockpit.step.run.StepRun` around the user's ``loss.backward()`` (the
engines, the step features, the tracking), and hands the values to a
:class:`~cockpit.step.recorder.Recorder`, to which the history, the streamed log and any
other consumer subscribe. ``docs/architecture.md`` draws the picture.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Iterable

from torch import Tensor

from cockpit import distributed
from cockpit.cockpit_args import (
    as_step,
    check_log_rank,
    check_new_quantity,
    check_quantities,
    check_step_order,
    collect_params,
    make_router,
    manual_missing,
    sharded_layout,
)
from cockpit.cockpit_output import CockpitOutput
from cockpit.curvature import hutchinson
from cockpit.engines import autograd as autograd_engine
from cockpit.engines import base as engines_base
from cockpit.engines.coverage import Coverage, static_coverage
from cockpit.engines.routing import Router
from cockpit.history import History
from cockpit.log.checkpoint import STATE_VERSION
from cockpit.log.keys import LOG_KEYS, NONFINITE_KEY
from cockpit.log.stream import LogStream
from cockpit.precision import is_low_precision
from cockpit.quantities.base import Quantity
from cockpit.step.checks import StepChecks
from cockpit.step.console import LOG, default_handler
from cockpit.step.loop_checks import LoopChecks
from cockpit.step.plan import StepPlan, plan_step
from cockpit.step.recorder import HistoryWriter, Recorder, StreamWriter
from cockpit.step.run import StepRun, as_info

__all__ = ["Cockpit", "LOG_KEYS", "NONFINITE_KEY", "STATE_VERSION"]


def _let_go(loop: LoopChecks, router: Router) -> None:
    """Remove what a cockpit hooked into the model and the optimizer.

    Run by :meth:`Cockpit.close`, or when a cockpit that was never closed is
    garbage-collected: the optimizer's step pre-hook and every engine's module
    and tensor hooks go, BackPACK's ``extend`` hooks are the user's again.
    """
    loop.close()
    router.close()


def live_diagnosis(recorder: Recorder):
    """The live diagnosis, subscribed to ``recorder`` (non-finite steps silent)."""
    from cockpit.diagnosis import LiveDiagnosis

    diagnosis = LiveDiagnosis(silent=(NONFINITE_KEY,))
    recorder.subscribe(diagnosis)
    return diagnosis


class Cockpit(CockpitOutput):
    """Track quantities about the training during a single backward pass per step.

    Typical use (model and loss ``backpack.extend``-ed, as in 1.0.2)::

        cockpit = Cockpit(model.parameters(), quantities=configuration("economy"))
        for step, (x, y) in enumerate(loader):
            opt.zero_grad()
            outputs = model(x)
            losses = individual_loss_fn(outputs, y)     # reduction="none"
            loss = loss_fn(outputs, y)                  # reduction="mean"
            with cockpit(step, info={"batch_size": x.shape[0],
                                     "individual_losses": losses,
                                     "loss": loss, "optimizer": opt}):
                loss.backward(create_graph=cockpit.create_graph(step))
            opt.step()

    A framework callback can call :meth:`begin` and :meth:`end` instead of the
    ``with`` block. Non-finite steps are recorded under :data:`NONFINITE_KEY` and
    never stop the training; :meth:`state_dict`/:meth:`load_state_dict` resume.

    Args:
        params: ``model.parameters()`` (or ``named_parameters()``, whose names
            messages use); frozen ones are skipped, warned once.
        quantities: Quantities to track; more can be added with :meth:`add`.
        logpath: Stream the history to this file, one crash-safe JSON record per
            tracked step (``.jsonl`` added without a suffix); a resumed run appends.
        diagnose: Warn once per problem the live diagnosis finds
            (:mod:`cockpit.diagnosis`).
        strict: Raise :class:`~cockpit.engines.coverage.CoverageError` where a
            value would be estimated or missing instead of exact (default: record
            it as missing, warned once; see :meth:`coverage`).
        process_group: ``"auto"``: join the batches of all DDP processes; a group:
            of its processes; ``None``: each its own shard (``docs/distributed.md``).
        timeout: Seconds to wait for the other processes before a
            :class:`~cockpit.distributed.DistributedError`.
        log_rank: The rank (within the group) that writes the log and warns.

    Raises:
        ValueError: No trainable parameter, one given twice, an empty list of
            quantities or a ``log_rank`` outside the group.
        TypeError: A parameter that is not a tensor, a single quantity instead of
            a list, or a ``log_rank`` that is not an int.
        OSError: If ``logpath`` cannot be written.
    """

    #: Use BackPACK's low-memory algorithm for convolution weight Jacobians.
    BACKPACK_CONV_SAVE_MEMORY = True
    #: Samples per batched backward pass of the autograd engine (memory vs. speed).
    PER_SAMPLE_CHUNK = autograd_engine.DEFAULT_CHUNK
    #: Per-sample gradient numbers an engine holds at once (the autograd and replay
    #: engines' groups, the most the ghost engine forms at once).
    PER_SAMPLE_MAX_ELEMENTS = engines_base.DEFAULT_MAX_ELEMENTS
    #: Hessian-vector products per Hutchinson estimate (where BackPACK has none).
    HUTCHINSON_PROBES = hutchinson.DEFAULT_PROBES

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[tuple[str, Tensor]],
        quantities: Iterable[Quantity] | None = None,
        logpath: str | None = None,
        diagnose: bool = True,
        strict: bool = False,
        process_group: Any = distributed.AUTO,
        timeout: float = distributed.DEFAULT_TIMEOUT,
        log_rank: int = 0,
    ):
        self.strict = bool(strict)
        self._communicator = distributed.communicator(process_group, timeout)
        #: This process's rank in the data-parallel group (0 in a single process).
        self.rank = self._communicator.rank if self._communicator is not None else 0
        size = self._communicator.size if self.data_parallel else None
        log_rank = check_log_rank(log_rank, size)
        #: Whether this process writes the log and shows diagnoses.
        self.is_writer = not self.data_parallel or self.rank == log_rank
        if self.is_writer:
            default_handler()  # where the coverage line goes
        self.params, self.param_names = collect_params(params)
        quantities = check_quantities(quantities)
        self.quantities: list[Quantity] = []
        self.history = History()
        self.optimizer_name: str | None = None
        self.recorder = Recorder(sent_missing=self.history.missing_at)
        self.recorder.subscribe(HistoryWriter(self.history))
        writer = self.is_writer
        stream = logpath is not None and writer
        self._stream = LogStream(logpath, self.history.items) if stream else None
        if self._stream is not None:
            self.recorder.subscribe(StreamWriter(self._stream))
        #: The live diagnosis (:class:`cockpit.diagnosis.LiveDiagnosis`) or ``None``.
        self.diagnosis = live_diagnosis(self.recorder) if diagnose and writer else None
        self._checks = StepChecks(self.params, self.param_names)
        self._loop = LoopChecks(self.params, self.recorder, self._checks)
        # FSDP2's DTensors (or None); other layouts are refused here, on every rank
        self._sharding = sharded_layout(self.params, self.param_names, self)
        self._router = make_router(self.params, self._sharding)
        self._router.start()  # e.g. in-place modules off, replay watches on
        # dropped without close(): the hooks go with the cockpit (neither holds it)
        self._let_go = weakref.finalize(self, _let_go, self._loop, self._router)
        self._let_go.atexit = False
        self._coverage: Coverage | None = None
        self._said = False  # the coverage line
        self._plan: StepPlan | None = None
        self._open: StepRun | None = None
        self.last_step: int | None = None
        for quantity in quantities:
            self.add(quantity)

    def close(self) -> None:
        """Close the streamed log; remove every hook from the model and optimizer.

        The model is then as it was before the cockpit (a cockpit dropped
        without ``close()`` does the same when it is garbage-collected).
        """
        super().close()
        self._let_go()

    # --- configuration -------------------------------------------------------------
    def add(self, quantity: Quantity) -> None:
        """Add a quantity (order is kept).

        Raises:
            ValueError: If it is not a :class:`Quantity` instance, or its key is
                already taken by another quantity.
        """
        check_new_quantity(quantity, self.quantities)
        self.quantities.append(quantity)
        quantity.bind(self.history)
        self._plan = None

    def plan(self, global_step: int) -> StepPlan:
        """Return what the quantities ask of ``global_step`` (once per step)."""
        if self._plan is None or self._plan.global_step != global_step:
            # bfloat16/float16 parameters (also after model.to(...)): squared norms
            # from per-sample gradients in float32 (see cockpit.precision)
            low = is_low_precision(self.params)
            self._plan = plan_step(self.quantities, global_step, low)
        return self._plan

    def coverage(self) -> Coverage:
        """Which engine computes which quantity for every parameter, and how.

        The latest status of every quantity (before any step: from the model's
        structure). ``str()`` is a table; ``.problems()`` lists what is estimated
        or not covered. See ``docs/any_model.md``.
        """
        if self._coverage is not None:
            return self._coverage
        labels = [self._checks.param_label(i) for i in range(len(self.params))]
        return static_coverage(
            self._router, self.quantities, labels, self.HUTCHINSON_PROBES
        )

    def create_graph(self, global_step: int) -> bool:
        """Return whether ``loss.backward`` needs ``create_graph=True`` at this step.

        Always ``False`` in a data-parallel run: DDP cannot run such a backward
        pass, so the cockpit differentiates the local loss itself.
        """
        if self._communicator is not None:
            return False
        return self.plan(as_step(global_step)).create_graph

    @property
    def data_parallel(self) -> bool:
        """Whether values are computed over the joined batch of several processes."""
        return self._communicator is not None and not self._communicator.local

    @property
    def open_step(self) -> int | None:
        """The step opened by :meth:`begin` and not yet ended (``None``: none)."""
        return self._open.step if self._open is not None else None

    # --- the step --------------------------------------------------------------------
    @contextlib.contextmanager
    def __call__(
        self, global_step: int, *extensions, info=None, debug=False, no_sync=False
    ):
        """Context manager around ``loss.backward()`` of step ``global_step`` (an int).

        Args:
            global_step: The training step.
            *extensions: Extra BackPACK extensions for the same backward pass
                (their results stay on the parameters).
            info: The step's ``batch_size``, ``individual_losses``, ``loss`` and
                ``optimizer`` (each quantity reads only what it needs).
            debug: Print the step's plan and turn on BackPACK's debug output.
            no_sync: The backward pass runs inside DDP's ``no_sync()`` (the same
                value on every process); the cockpit joins the gradients itself.

        Raises:
            KeyError: If an active quantity needs an ``info`` key that is missing.
            ValueError: On conflicting BackPACK extensions, a sum-reduced loss, or
                ``batch_size`` disagreeing with ``individual_losses``.
            NotImplementedError: If no engine can handle a layer (named).
            RuntimeError: If the model or the loss function is not extended.
        """
        self.begin(global_step, *extensions, info=info, debug=debug, no_sync=no_sync)
        try:
            yield
        except BaseException as error:
            self.end(error)
            raise
        self.end()

    def begin(
        self, global_step: int, *extensions, info=None, debug=False, no_sync=False
    ) -> None:
        """Open step ``global_step`` without a ``with`` block (for callbacks).

        Raises:
            RuntimeError: If a step is already open.
            ValueError: If ``global_step`` is not after the last tracked step.
        """
        if self._open is not None:
            raise RuntimeError(
                "Cockpit.begin() was called twice without Cockpit.end() in between. "
                "Fix: call cockpit.end() after the backward pass of each step."
            )
        step_info = as_info(as_step(global_step), info)
        check_step_order(step_info.global_step, self.last_step)
        if self.data_parallel:  # a broken run raises; the set-up is compared once
            self._communicator.begin(
                self.quantities, self.params, step_info.global_step
            )
        if step_info.has("optimizer"):
            self.optimizer_name = type(step_info.get("optimizer")).__name__
        plan = self._loop.before(self.plan(step_info.global_step), step_info)
        try:
            run = StepRun(plan, step_info, self, extensions, debug, no_sync)
        except BaseException:  # e.g. a missing info key: nothing of the step stays
            self.recorder.discard()
            self._router.forget()
            raise
        try:
            run.open()
        except BaseException as error:  # nothing half-open stays behind
            self._plan = None
            self._router.forget()
            self._merge_coverage(run)
            clearer = run.fail(error)
            if clearer is not None:
                raise clearer from error
            raise
        self._merge_coverage(run)  # after open: it says how autograd ran
        self._open = run

    def _merge_coverage(self, run: StepRun) -> None:
        if run.coverage is None:
            return
        if self._coverage is None:
            self._coverage = run.coverage
        else:
            self._coverage = self._coverage.merged(run.coverage)

    def end(self, error: BaseException | None = None) -> None:
        """Close the step opened by :meth:`begin`: check it, track, record.

        Args:
            error: The exception that interrupted the backward pass, if any: the
                step is abandoned and a clearer error is raised where known.

        Raises:
            RuntimeError: If no step is open.
        """
        run, self._open = self._open, None
        if run is None:
            raise RuntimeError(
                "Cockpit.end() was called without Cockpit.begin(). Fix: call "
                "cockpit.begin(step, info=...) before the backward pass."
            )
        self._plan = None  # quantities' state changes when they are tracked
        try:
            if error is not None:
                clearer = run.fail(error)
                if clearer is not None:
                    raise clearer from error
                return
            run.close()
            if run.coverage_changed:  # e.g. no double backward: now missing
                self._merge_coverage(run)
            if run.coverage is not None and self.is_writer and not self._said:
                self._said = True  # once the first step is known in full
                LOG.info(self._coverage.summary())  # one line per run
        finally:
            self._router.forget()  # the step's recorded module calls
        if self.data_parallel and not run.plan.active:  # did another track it?
            self._communicator.after_untracked(run.step)
        self.last_step = run.step
        self._loop.after(run.plan, run.info)

    def missing(self, global_step: int, quantities, reason: str, cause=None) -> None:
        """Record that ``quantities`` (or their keys) have no value at a step, and why.

        For loops that know a value would be wrong, e.g. ``cockpit.missing(step,
        ["Alpha"], "the update was clipped. Fix: ...", cause="clipping")``: the
        reason goes under the step's ``missing`` entry (flushed at once), a
        :class:`~cockpit.errors.CockpitWarning` says it once per key and ``cause``
        (default: the reason), and a two-step value started there is dropped.
        Call it outside a step, for values not recorded; see
        :func:`cockpit.cockpit_args.manual_missing` for the errors.
        """
        manual_missing(self, as_step(global_step), quantities, reason, cause)

    def track(self, global_step: int, protected_savefields=()) -> None:
        """cockpit-for-pytorch 1.0.2's tracking entry point, kept for old scripts.

        cockpit tracks when the step's context closes, so there is nothing left
        to do here; 1.0.2 called this itself on leaving the context.
        """
