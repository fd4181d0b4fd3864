"""The Cockpit: holds the quantities and runs each tracked step's backward pass.

The hub is small on purpose. Per step it asks the planner what the quantities need
(:func:`cockpit.planner.plan_step`, once per step), opens a
:class:`~cockpit.step_run.StepRun` around the user's ``loss.backward()`` (the engine's
context, the checks after it, the tracking), and hands the values to a
:class:`~cockpit.recorder.Recorder`, to which the history, the streamed log and any
other consumer subscribe.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import operator
import sys
import warnings
from typing import Any, Iterable, Mapping

from torch import Tensor

from cockpit import distributed
from cockpit.checkpoint import STATE_VERSION, cockpit_state, load_cockpit_state
from cockpit.checks import NONFINITE_KEY, Diagnostics
from cockpit.engines import autograd as autograd_engine
from cockpit.engines import backpack as backpack_engine
from cockpit.engines.coverage import Coverage, static_coverage
from cockpit.engines.replay import Replayer
from cockpit.engines.routing import Router
from cockpit.errors import CockpitWarning
from cockpit.history import History, json_path
from cockpit.log_stream import LogStream
from cockpit.loop_checks import LoopChecks
from cockpit.planner import StepPlan, plan_step
from cockpit.precision import is_low_precision
from cockpit.quantities.base import Quantity
from cockpit.recorder import MISSING_KEY, HistoryWriter, Recorder, StreamWriter
from cockpit.step_run import StepRun, as_info

__all__ = ["Cockpit", "LOG_KEYS", "NONFINITE_KEY", "STATE_VERSION"]

_LOG = logging.getLogger("cockpit")


class _StderrHandler(logging.StreamHandler):
    """A stream handler writing to whatever ``sys.stderr`` is when a line comes."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler.__init__ sets it
        pass


def _shown_by_default(record: logging.LogRecord) -> bool:
    """Whether cockpit's own stderr handler prints ``record``.

    Only while no other handler would receive it: none on the ``cockpit`` logger or
    on the loggers it propagates to (a handler that took this filter over, such as
    a progress bar's redirect, counts as cockpit's own).
    """
    logger: logging.Logger | None = _LOG
    while logger is not None:
        for handler in logger.handlers:
            if _shown_by_default not in handler.filters:
                return False
        logger = logger.parent if logger.propagate else None
    return True


_DEFAULT_HANDLER: logging.Handler | None = None


def default_handler() -> None:
    """Give the ``cockpit`` logger a stderr handler of its own, once per process.

    The coverage line is an INFO record, which a program that configured no logging
    would never show; like Lightning's set-up lines, cockpit's handler prints it,
    but only while no other handler would (:func:`_shown_by_default`), and the
    logger's level becomes INFO unless the user set one. Configured logging
    (``logging.basicConfig``, pytest, ...) receives the line as usual, once.
    Silence it with ``logging.getLogger("cockpit").setLevel(logging.WARNING)``. A
    cockpit that writes the log calls this when it is made, so that a progress bar
    can redirect the handler (``tqdm.contrib.logging.logging_redirect_tqdm``).
    """
    global _DEFAULT_HANDLER
    if _DEFAULT_HANDLER is None:  # once per process: a progress bar may swap it
        _DEFAULT_HANDLER = _StderrHandler()  # for a handler of its own meanwhile
        _DEFAULT_HANDLER.addFilter(_shown_by_default)
        _LOG.addHandler(_DEFAULT_HANDLER)
        if _LOG.level == logging.NOTSET:
            _LOG.setLevel(logging.INFO)


#: The keys written by :meth:`Cockpit.log`, in argument order.
LOG_KEYS = (
    "epoch_count",
    "train_loss",
    "valid_loss",
    "test_loss",
    "train_accuracy",
    "valid_accuracy",
    "test_accuracy",
    "learning_rate",
)


class Cockpit:
    """Track quantities about the training during a single backward pass per step.

    Typical use (the loss and model must be ``backpack.extend``-ed)::

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
    ``with`` block. Inputs are checked early with errors that name the fix;
    non-finite steps are recorded under :data:`NONFINITE_KEY` and never stop the
    training; unused parameters count as having zero gradient (warned once);
    ``logpath`` streams the history to a crash-safe file; :meth:`state_dict` and
    :meth:`load_state_dict` resume a run.

    Args:
        params: The parameters to observe (all must require gradients), e.g.
            ``model.parameters()``. ``model.named_parameters()`` works too and
            lets messages name parameters and layers.
        quantities: Quantities to track; more can be added with :meth:`add`.
        logpath: If given, stream the history to this file while training (one
            JSON record per tracked step, flushed when the step is done). Without
            a ``.json``/``.jsonl`` suffix, ``.jsonl`` is appended. A new run
            replaces the file; a run resumed with :meth:`load_state_dict` appends.
        diagnose: Read the instruments while training and warn once per problem
            found (a :class:`~cockpit.errors.CockpitWarning` naming the evidence
            and the fix; see :mod:`cockpit.diagnosis`, ``cockpit report``).
        strict: Raise :class:`~cockpit.engines.coverage.CoverageError` at a step
            where a value would be estimated or missing instead of exact (by
            default such values are recorded as missing, warned once; see
            :meth:`coverage`).
        process_group: Data-parallel runs (DDP): ``"auto"`` (default) computes
            every quantity over the joined batch of all processes when
            ``torch.distributed`` is initialised (before the Cockpit is created)
            with more than one process; a process group restricts that to its
            processes; ``None`` gives each process the values of its own shard.
            ``info`` always describes the local shard. See
            ``docs/distributed.md``. (With ``None`` under DDP, each process
            should stream to a log path of its own.)
        timeout: Seconds a process waits for the others at cockpit's
            collectives before it raises
            :class:`~cockpit.distributed.DistributedError` (instead of hanging
            when another process failed).
        log_rank: In a data-parallel run, the process that streams the log,
            writes it (:meth:`write`) and warns about diagnoses, by its rank within
            the process group; every process holds the same values.

    Raises:
        ValueError: If a parameter does not require gradients or is given twice,
            if there are no parameters, an item of ``quantities`` is not a
            quantity instance, ``log_rank`` is not a rank of the data-parallel
            group, or this process is not a member of ``process_group``.
        TypeError: If a parameter is not a tensor, ``quantities`` is a single
            quantity instead of a list, or ``log_rank`` is not an int.
        OSError: If ``logpath`` cannot be written.
    """

    #: Use BackPACK's low-memory algorithm for convolution weight Jacobians.
    BACKPACK_CONV_SAVE_MEMORY = True
    #: Samples per batched backward pass of the autograd engine (memory vs. speed).
    PER_SAMPLE_CHUNK = autograd_engine.DEFAULT_CHUNK
    #: Per-sample gradient numbers the autograd engine holds at once.
    PER_SAMPLE_MAX_ELEMENTS = autograd_engine.DEFAULT_MAX_ELEMENTS
    #: Hessian-vector products per Hutchinson estimate (where BackPACK has none).
    HUTCHINSON_PROBES = autograd_engine.DEFAULT_PROBES

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
        group = distributed.resolve_group(process_group)
        self._communicator = (
            distributed.Communicator(group, timeout)
            if group is not None
            else distributed.local_communicator()
            if process_group is None
            else None
        )
        self._setup_checked = False
        #: This process's rank in the data-parallel group (0 in a single process).
        self.rank = self._communicator.rank if self._communicator is not None else 0
        if isinstance(log_rank, bool) or not hasattr(type(log_rank), "__index__"):
            raise TypeError(f"log_rank must be an int, got {log_rank!r}.")
        log_rank = operator.index(log_rank)
        if self.data_parallel:
            size = self._communicator.size
            if not 0 <= log_rank < size:
                raise ValueError(
                    f"log_rank={log_rank} names no process of this data-parallel "
                    f"group of {size} (ranks 0 to {size - 1}, within the group), so "
                    "no process would write the log. Fix: pass a rank of the group, "
                    "e.g. log_rank=0."
                )
        #: Whether this process writes the log and shows diagnoses.
        self.is_writer = not self.data_parallel or self.rank == log_rank
        if self.is_writer:
            default_handler()  # where the coverage line goes
        self.params: list[Tensor] = []
        #: Parameter names where known (``named_parameters()``), else ``None``.
        self.param_names: list[str | None] = []
        frozen: list[str] = []
        for i, item in enumerate(params):
            name = None
            if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
                name, item = item
            label = f"Parameter #{i}" + (f" ({name!r})" if name else "")
            if self._check_param(label, item):
                self.params.append(item)
                self.param_names.append(name)
            else:
                frozen.append(f"{label} (shape {tuple(item.shape)})")
        if not self.params:
            what = (
                f"none of its {len(frozen)} parameters requires gradients (e.g. "
                f"{frozen[0]} does not require gradients)"
                if frozen
                else "no parameters"
            )
            raise ValueError(
                f"The Cockpit got {what}, so it can never track anything. Fix: pass "
                "the model's trainable parameters, e.g. "
                "Cockpit(model.parameters(), quantities=...)."
            )
        if frozen:
            warnings.warn(
                f"The Cockpit skips {len(frozen)} frozen parameter(s) (they do not "
                f"require gradients): {', '.join(frozen[:3])}"
                f"{', ...' if len(frozen) > 3 else ''}. It tracks the "
                f"{len(self.params)} trainable one(s). Nothing to fix if that is "
                "intended.",
                CockpitWarning,
                stacklevel=2,
            )
        if isinstance(quantities, Quantity):
            raise TypeError(
                f"quantities must be a list of Quantity instances, got the single "
                f"quantity {quantities!r}. Fix: Cockpit(params, quantities=[...])."
            )
        self.quantities: list[Quantity] = []
        self.history = History()
        self.optimizer_name: str | None = None
        self.recorder = Recorder(sent_missing=self._recorded_missing)
        self.recorder.subscribe(HistoryWriter(self.history))
        self._stream = (
            LogStream(logpath) if logpath is not None and self.is_writer else None
        )
        if self._stream is not None:
            self.recorder.subscribe(StreamWriter(self._stream))
        #: The live diagnosis (:class:`cockpit.diagnosis.LiveDiagnosis`) or ``None``.
        self.diagnosis = None
        if diagnose and self.is_writer:
            from cockpit.diagnosis import LiveDiagnosis

            self.diagnosis = LiveDiagnosis(silent=(NONFINITE_KEY,))
            self.recorder.subscribe(self.diagnosis)
        self._diagnostics = Diagnostics(self.params, self.param_names)
        self._loop = LoopChecks(self.params, self.recorder, self._diagnostics)
        self._router = Router(
            self.params, backpack_engine.rule_problem, backpack_engine.quiet_backward
        )
        self._turn_off_in_place()
        #: Per-sample gradients of layers without a BackPACK rule, by re-running
        #: the module that uses them (the autograd engine where that cannot work).
        self._replayer = Replayer(self._router.chain)
        self._replayer.watch_chains(
            self._router.replay_candidates(backpack_engine.reference_first_order())
        )
        self._coverage: Coverage | None = None
        self._plan: StepPlan | None = None
        self._open: tuple[StepRun, contextlib.AbstractContextManager] | None = None
        self.last_step: int | None = None
        if quantities is not None:
            quantities = list(quantities)
            if not quantities:
                raise ValueError(
                    "The Cockpit got an empty list of quantities, so it would track "
                    "nothing. Fix: pass some, e.g. quantities=configuration('economy') "
                    "(from cockpit.utils.configuration), or leave quantities out and "
                    "call cockpit.add(quantity) later."
                )
        for quantity in quantities or []:
            self.add(quantity)

    def _check_param(self, label: str, param) -> bool:
        """Return whether ``param`` is trainable; raise if it cannot be tracked."""
        if not isinstance(param, Tensor):
            raise TypeError(
                f"{label} is a {type(param).__name__}, not a tensor. Fix: pass "
                "model.parameters() or model.named_parameters()."
            )
        seen = [j for j, other in enumerate(self.params) if other is param]
        if seen:
            raise ValueError(
                f"{label} is the same tensor as parameter #{seen[0]}. Fix: pass each "
                "parameter once (model.parameters() already skips tied weights)."
            )
        return param.requires_grad

    # --- configuration -------------------------------------------------------------
    def add(self, quantity: Quantity) -> None:
        """Add a quantity (order is kept).

        Raises:
            ValueError: If it is not a :class:`Quantity` instance, or its key is
                already taken by another quantity.
        """
        if not isinstance(quantity, Quantity):
            hint = (
                " (a class was passed: instantiate it, e.g. GradNorm(linear(1)))"
                if isinstance(quantity, type)
                else ""
            )
            raise ValueError(
                f"Only cockpit.quantities.Quantity instances can be added, got "
                f"{quantity!r}{hint}."
            )
        for other in self.quantities:
            if other.key == quantity.key:
                raise ValueError(
                    f"Two quantities share the key {quantity.key!r}: {other!r} and "
                    f"{quantity!r}. Give one a distinct key, e.g. "
                    f"{type(quantity).__name__}(..., key='{quantity.key}2')."
                )
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
        """Say, for every parameter, which engine computes which quantity, and how.

        After tracked steps with per-sample work, the latest status of every
        quantity (from the last step it was active at); before, one from the
        model's structure (weight tying, batch layouts and the per-sample losses
        are checked at every step). ``str()`` of it is a readable table;
        ``.problems()`` lists what is estimated or not covered. See
        ``docs/any_model.md``.
        """
        if self._coverage is not None:
            return self._coverage
        labels = [self._diagnostics.param_label(i) for i in range(len(self.params))]
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
        return self.plan(_as_step(global_step)).create_graph

    @property
    def data_parallel(self) -> bool:
        """Whether values are computed over the joined batch of several processes."""
        return self._communicator is not None and not self._communicator.local

    # --- the step --------------------------------------------------------------------
    @contextlib.contextmanager
    def __call__(
        self, global_step: int, *extensions, info=None, debug=False, no_sync=False
    ):
        """Context manager around ``loss.backward()`` of step ``global_step``.

        Args:
            global_step: The training step (an int).
            *extensions: Extra BackPACK extensions to run in the same backward pass;
                their results stay on the parameters for you.
            info: The step's ``batch_size``, ``individual_losses``, ``loss`` and
                ``optimizer`` (each quantity reads only what it needs).
            debug: Print the step's plan and turn on BackPACK's debug output.
            no_sync: Data-parallel runs: the backward pass runs inside DDP's
                ``no_sync()`` (gradient accumulation), so ``.grad`` holds this
                process's own gradient. The cockpit then catches each process's
                gradient and joins them itself (one all-reduce of the gradient's
                size). Pass the same value on every process; ``True`` outside
                ``no_sync()`` is still right (only costs the all-reduce); ignored
                in a single process.

        Yields:
            Nothing; run the backward pass inside the ``with`` block.

        Raises:
            KeyError: If an active quantity needs an ``info`` key that is missing.
            ValueError: On conflicting BackPACK extensions, a sum-reduced loss, or
                ``batch_size`` disagreeing with ``individual_losses``.
            NotImplementedError: If BackPACK cannot handle a layer (named) for the
                quantities due at this step, e.g. BatchNorm in train mode.
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

        ``cockpit.begin(step, info=...)``, ``loss.backward(...)``,
        ``cockpit.end()`` does what the ``with cockpit(step, info=...)`` block
        does; the arguments are those of :meth:`__call__`.

        Raises:
            RuntimeError: If a step is already open.
        """
        if self._open is not None:
            raise RuntimeError(
                "Cockpit.begin() was called twice without Cockpit.end() in between. "
                "Fix: call cockpit.end() after the backward pass of each step."
            )
        step_info = as_info(_as_step(global_step), info)
        if self.data_parallel and not self._setup_checked:
            distributed.check_setup(
                self._communicator, self.quantities, self.params, step_info.global_step
            )
            self._setup_checked = True
        if step_info.has("optimizer"):
            self.optimizer_name = type(step_info.get("optimizer")).__name__
        try:
            run = StepRun(
                self._loop.before(self.plan(step_info.global_step), step_info),
                step_info,
                self.params,
                extensions,
                self._diagnostics,
                self.recorder,
                save_memory=self.BACKPACK_CONV_SAVE_MEMORY,
                debug=debug,
                router=self._router,
                strict=self.strict,
                chunk=self.PER_SAMPLE_CHUNK,
                max_elements=self.PER_SAMPLE_MAX_ELEMENTS,
                probes=self.HUTCHINSON_PROBES,
                communicator=self._communicator,
                no_sync=no_sync,
                replayer=self._replayer,
            )
        except BaseException:  # e.g. a missing info key: nothing of the step stays
            self.recorder.discard()
            self._replayer.forget()
            raise
        try:
            run.open()
        except BaseException as error:  # nothing half-open stays behind
            self._plan = None
            self._replayer.forget()
            self._merge_coverage(run)
            clearer = run.fail(error)
            if clearer is not None:
                raise clearer from error
            raise
        self._merge_coverage(run)  # after open: it says how autograd ran
        self._open = run

    def _turn_off_in_place(self) -> None:
        """Set ``inplace=False`` on the in-place modules among extended layers.

        With BackPACK's hooks their forward pass would stop (see
        :meth:`Router.in_place_modules`); out of place they compute the same
        values (unless forward code reads their input again afterwards), with a
        little more memory. Said once, with a warning.
        """
        found = self._router.in_place_modules()
        if not found:
            return
        for _, module in found:
            module.inplace = False
        labels = ", ".join(label for label, _ in found[:4])
        more = f" and {len(found) - 4} more" if len(found) > 4 else ""
        warnings.warn(
            f"Cockpit set inplace=False on {len(found)} module(s) of the extended "
            f"model ({labels}{more}): BackPACK's backward hooks make module outputs "
            "views that PyTorch forbids changing in place (the forward pass would "
            "stop with 'Output 0 of BackwardHookFunction is a view and is being "
            "modified inplace'). The values are the same unless forward code "
            "reads a module's input again after such a module changed it (it now "
            "reads the unchanged input); memory use grows a little. In-place calls "
            "in your own forward code cannot be seen from here. Fix for those: "
            "torch.relu(x) instead of x.relu_() or F.relu(x, inplace=True) on "
            "outputs of extended modules.",
            CockpitWarning,
            stacklevel=3,
        )

    def _merge_coverage(self, run: StepRun) -> None:
        if run.coverage is None:
            return
        if self._coverage is None:
            if self.is_writer:  # one line per run, not one per process
                _LOG.info(run.coverage.summary())
            self._coverage = run.coverage
        else:
            self._coverage = self._coverage.merged(run.coverage)

    def end(self, error: BaseException | None = None) -> None:
        """Close the step opened by :meth:`begin`: check it, track, record.

        Args:
            error: The exception that interrupted the backward pass, if any: the
                step is abandoned (nothing tracked, buffers freed) and a clearer
                error is raised from it where cockpit knows one.

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
        finally:
            self._replayer.forget()  # the step's recorded module calls
        self.last_step = run.plan.global_step
        self._loop.after(run.plan, run.info)

    def missing(
        self,
        global_step: int,
        quantities: Quantity | str | Iterable[Quantity | str],
        reason: str,
        cause: Any = None,
    ) -> None:
        """Record that ``quantities`` have no value at ``global_step``, and why.

        For integrations and training loops that know a value would be wrong, e.g.
        ``Alpha`` when the optimizer's step is not the update it replays::

            cockpit.missing(step, ["Alpha"], "the step used the gradients of "
                            "several micro-batches. Fix: ...", cause="accumulation")

        The reason goes under the step's ``missing`` entry (``{key: reason}``, next
        to reasons recorded there before; a quantity's later reason replaces its
        earlier one), into :meth:`get_output`, the history and the streamed log,
        which is flushed at once (crash-safe). A
        :class:`~cockpit.errors.CockpitWarning` says ``"<key> has no value at step
        <step>: <reason>"`` once per key and ``cause``. A value of a two-step
        quantity started at ``global_step`` and not yet finished (``Alpha``) is
        dropped, so it does not arrive later.

        Args:
            global_step: The step without the values (an int).
            quantities: This cockpit's quantities, or their keys, or one of either
                (an empty list records nothing).
            reason: Why the values are missing; end it with the fix where there
                is one.
            cause: What makes the warning new (any hashable, e.g. ``"clipping"``):
                one warning per key and cause. Default: the reason itself, for
                reasons whose text does not change from step to step.

        Raises:
            ValueError: If a key or quantity is not one of this cockpit's, a
                quantity already has a value at ``global_step``, or ``reason``
                is empty.
            TypeError: If ``global_step`` is not an int, ``reason`` not a string,
                or an item of ``quantities`` neither a quantity nor a string.
            RuntimeError: If a step is open (call it before :meth:`begin` or after
                :meth:`end`).
        """
        step = _as_step(global_step)
        if not isinstance(reason, str):
            raise TypeError(
                f"reason must be a string, got {reason!r}. Fix: say why the values "
                "are missing, e.g. cockpit.missing(step, ['Alpha'], 'the update was "
                "clipped. Fix: ...')."
            )
        if not reason.strip():
            raise ValueError(
                "reason is empty. Fix: say why the values are missing (and the fix), "
                "it is what the log and the warning show."
            )
        if self._open is not None:
            raise RuntimeError(
                f"Cockpit.missing() was called while step "
                f"{self._open.plan.global_step} is open. Fix: call it before "
                "cockpit.begin() or after cockpit.end()."
            )
        chosen = self._quantities_of(quantities)
        if step in self.history:
            recorded = self.history.view(step)
            taken = [q.key for q in chosen if q.key in recorded]
            if taken:
                raise ValueError(
                    f"{', '.join(taken)} already has a value at step {step}, so it "
                    "cannot be missing there. Fix: call cockpit.missing() for values "
                    "that were not recorded (e.g. right after cockpit.end() for a "
                    "value that a later step would finish, such as Alpha)."
                )
        for q in chosen:
            discard = getattr(q, "discard_start", None)
            if discard is not None:
                discard(step)
            self._diagnostics.missing(
                self.recorder,
                [step],
                q.key,
                reason,
                once=("missing", q.key, reason if cause is None else cause),
            )
        self.recorder.flush()

    def _quantities_of(self, quantities) -> list[Quantity]:
        """This cockpit's quantities named by ``quantities`` (objects or keys)."""
        if isinstance(quantities, (Quantity, str)):
            quantities = [quantities]
        by_key = {q.key: q for q in self.quantities}
        chosen: list[Quantity] = []
        for item in quantities:
            if isinstance(item, str):
                quantity = by_key.get(item)
                what = f"key {item!r}"
            elif isinstance(item, Quantity):
                quantity = item if any(q is item for q in self.quantities) else None
                what = f"quantity {item!r}"
            else:
                raise TypeError(
                    f"Cockpit.missing() takes quantities or their keys, got {item!r}. "
                    "Fix: pass e.g. [quantity] or ['Alpha']."
                )
            if quantity is None:
                raise ValueError(
                    f"Cockpit.missing() got the {what}, which is not one of this "
                    f"cockpit's quantities (keys: {sorted(by_key)}). Fix: pass one "
                    "of those keys or quantities (cockpit.quantities)."
                )
            if all(q is not quantity for q in chosen):
                chosen.append(quantity)
        return chosen

    def _recorded_missing(self, global_step: int) -> Mapping[str, str] | None:
        """The ``missing`` entries the history holds for ``global_step``."""
        if global_step not in self.history:
            return None
        return self.history.view(global_step).get(MISSING_KEY)

    def track(self, global_step: int, protected_savefields=()) -> None:
        """cockpit-for-pytorch 1.0.2's tracking entry point, kept for old scripts.

        cockpit tracks when the step's context closes, so there is nothing left
        to do here; 1.0.2 called this itself on leaving the context.
        """

    # --- output --------------------------------------------------------------------
    def log(
        self,
        global_step,
        epoch_count,
        train_loss,
        valid_loss,
        test_loss,
        train_accuracy,
        valid_accuracy,
        test_accuracy,
        learning_rate,
    ) -> None:
        """Record evaluation metrics (shown in the dashboard's bottom row)."""
        values = (
            epoch_count,
            train_loss,
            valid_loss,
            test_loss,
            train_accuracy,
            valid_accuracy,
            test_accuracy,
            learning_rate,
        )
        for key, value in zip(LOG_KEYS, values, strict=True):
            self.recorder.record(global_step, key, value)
        self.recorder.flush()

    def get_output(self) -> collections.defaultdict:
        """Return everything recorded so far as ``{step: {key: value}}``.

        A ``defaultdict(dict)`` as in cockpit-for-pytorch 1.0.2: histogram counts
        and edges are numpy arrays, everything else plain Python. ``history``
        holds the same values as plain Python (``cockpit.history.to_dict()``).
        """
        return self.history.to_output()

    @property
    def output(self) -> collections.defaultdict:
        """Everything recorded so far (cockpit-for-pytorch 1.0.2's attribute)."""
        return self.get_output()

    def write(self, logpath, legacy: bool = False, packed: bool = True) -> str:
        """Write the history to ``logpath + ".json"`` (standard JSON).

        A path without the suffix means ``<path>.json``, also next to a folder of
        that name; missing parent directories are created; the file is replaced
        atomically.

        Args:
            logpath: Where to write.
            legacy: Write the json_tricks layout of cockpit-for-pytorch 1.0.2
                (its plotter reads only that).
            packed: Pack histograms (edges as a range, sparse counts); ``False``
                writes plain arrays. Every reader of cockpit reads both.

        Returns:
            The path written (``None`` on the processes of a data-parallel run
            other than ``log_rank``, which write nothing).

        Raises:
            OSError: If the path cannot be written (the message names it and the
                fix); the history stays in memory, so call ``write`` again.
        """
        if not self.is_writer:
            return None
        path = self.history.write_json(json_path(logpath), legacy=legacy, packed=packed)
        _LOG.debug("Cockpit log written to %s", path)
        return path

    @property
    def logpath(self) -> str | None:
        """The file the history is streamed to, or ``None``."""
        return self._stream.path if self._stream is not None else None

    def close(self) -> None:
        """Close the streamed log and other subscribers (all is on disk already)."""
        self._loop.close()
        self.recorder.close()
        self._replayer.close()

    # --- checkpoints -----------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Return what a restarted run needs to continue exactly where this one is.

        See :func:`cockpit.checkpoint.cockpit_state`; save it with ``torch.save``
        with the model and optimizer state, after ``optimizer.step()``.
        """
        return cockpit_state(self)

    def load_state_dict(self, state: Mapping[str, Any], strict: bool = True) -> None:
        """Restore a state from :meth:`state_dict`; the run continues after it.

        See :func:`cockpit.checkpoint.load_cockpit_state`.
        """
        load_cockpit_state(self, state, strict)
        self._plan = None
        self._loop.close()
        if self._stream is not None:  # records after the checkpoint are superseded
            self._stream.resume(self.last_step)


def _as_step(global_step) -> int:
    """Return ``global_step`` as an int, or say how to pass it."""
    try:
        return operator.index(global_step)
    except TypeError:
        raise TypeError(
            f"global_step must be an int, got {global_step!r}. Fix: pass the "
            "iteration counter, e.g. cockpit(step, info=...) with step an int."
        ) from None
