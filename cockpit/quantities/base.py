"""Base classes for quantities.

A quantity *declares* what it reads, as data:

* ``needs``: the :class:`~cockpit.needs.Need` members it reads (per-sample
  gradients, their Gram matrix, a curvature diagonal, Hessian-vector products, ...);
* ``info_keys``: the ``info`` keys it reads;
* ``Accumulator``: a dataclass for the partial results it collects during the
  backward pass (a fresh one per step, as ``self.acc``).

and *writes* the maths:

* ``accumulate(global_step, view)``, if a need is read during the backward pass:
  called once per parameter with a :class:`~cockpit.param_view.ParamView`, as soon
  as the engine is done with the module that owns it;
* ``_compute(global_step, ctx)`` (:class:`SingleStepQuantity`), or
  ``_compute_start`` and ``_compute_end`` (:class:`TwoStepQuantity`);
* optionally ``prepare(global_step, info)`` to check or read ``info`` before the
  backward pass, and ``state_dict``/``load_state_dict`` for state kept across steps.

The base class applies the ``track_schedule`` (no subclass repeats the check), tells
the cockpit what the quantity needs at a step (:meth:`Quantity.needs_at`,
:meth:`Quantity.create_graph`) and resets the accumulator.

Quantities written for cockpit-for-pytorch 1.0.2 run unchanged:

* a subclass whose ``_compute`` (or ``_compute_start``/``_compute_end``) takes
  ``(global_step, params, batch_loss)`` is called that way;
* a subclass that overrides ``track(global_step, params, batch_loss)`` (or
  ``compute``) is tracked through it, as 1.0.2's cockpit did: ``track`` is called at
  every step, and what it writes into ``self.output[step]`` is recorded;
* the BackPACK extensions it returns from ``extensions(global_step)`` run in the
  same backward pass, their results left on the parameters until it has been
  computed; ``create_graph(global_step)`` is asked as in 1.0.2;
* while such a method runs, :mod:`cockpit.context`'s getters
  (``get_batch_size(global_step)``, ...) return the step's ``info``.

The pieces of 1.0.2's API this builds on are in :mod:`cockpit.quantities.compat`.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Sequence

from torch import Tensor

from cockpit import needs as _needs
from cockpit.context import StepInfo, tracked_info
from cockpit.log.keys import MISSING_KEY  # noqa: F401  (re-exported)
from cockpit.needs import Need
from cockpit.param_view import ParamView
from cockpit.quantities.compat import (
    Cache102,
    Protocol102,
    not_implemented,
    takes_params_and_loss,
    written_values,
)
from cockpit.quantities.utils_params import gradients
from cockpit.utils.host import to_host


@dataclass(frozen=True)
class Missing:
    """A value that cannot be right at this step, and why (recorded as missing).

    A quantity returns it instead of a number; the cockpit records the reason
    under :data:`MISSING_KEY` and warns once per quantity and reason.

    Attributes:
        reason: Why there is no value, with the fix where there is one.
    """

    reason: str


@dataclass(frozen=True)
class TrackContext:
    """Everything a quantity may read when it is tracked after the backward pass.

    Attributes:
        global_step: The current step.
        params: The cockpit's parameters, in order.
        info: What the user handed in as ``info``; in a data-parallel run the
            joined batch's (``loss``, ``batch_size`` and ``individual_losses`` of
            all processes).
        comm: The data-parallel step (:class:`cockpit.distributed.StepComm`), or
            ``None`` in a single process.
        grads: The mini-batch gradient per parameter where it is not ``.grad``
            (the joined batch's, when processes have shards of different sizes).
        rows: On a ``fully_shard`` model, this process's rows of the parameters
            and of the joined gradient (:class:`cockpit.distributed.rows.Rows`),
            which a quantity with ``shard_local = True`` reads instead of
            ``params`` and ``gradients()``; ``None`` elsewhere.
    """

    global_step: int
    params: Sequence[Tensor]
    info: StepInfo
    comm: Any = None
    grads: Sequence[Tensor] | None = None
    rows: Any = None

    def gradients(self) -> list[Tensor]:
        """The mini-batch gradient of every parameter (zeros where unused)."""
        if self.grads is not None:
            return list(self.grads)
        return gradients(self.params)


class Quantity(Protocol102, abc.ABC):
    """A number (or list, or histogram) about the training, tracked on a schedule.

    Args:
        track_schedule: Callable ``global_step -> bool`` saying when to track, e.g.
            :func:`cockpit.utils.schedules.linear`.
        verbose: Emit extra diagnostics (warnings) while tracking.
        key: Name under which results are stored in the history. Defaults to the
            class name, as in cockpit-for-pytorch. Give two quantities of one class
            distinct keys, e.g. ``HessTrace(s, curvature="diag_ggn_exact",
            key="GGNTrace")``.

    Raises:
        TypeError: If ``track_schedule`` is not callable.
    """

    #: What the quantity reads (see :data:`cockpit.needs.NEEDS`).
    needs: ClassVar[frozenset[Need]] = frozenset()
    #: ``info`` keys read on every step at which the quantity is active.
    info_keys: ClassVar[tuple[str, ...]] = ()
    #: Dataclass of the partial results of one step (``None``: nothing to collect).
    Accumulator: ClassVar[type | None] = None
    #: Curvature needs for which an unbiased estimate (with its standard error) is
    #: accepted where no engine forms them exactly (e.g. ``{Need.DIAG_H}``).
    estimable: frozenset[Need] = frozenset()
    #: ``(why, fix)``: why no estimate serves a curvature need (``None``: none said).
    not_estimable: tuple[str, str] | None = None
    #: Set per subclass: it overrides 1.0.2's ``track`` (tracked at every step
    #: through it) or ``compute`` (see ``__init_subclass__``).
    _own_track: ClassVar[bool] = False
    _tracks_itself: ClassVar[bool] = False
    #: Whether the quantity computes from ``ctx.rows`` on a ``fully_shard`` model
    #: (partial sums over this process's rows, added to the bucket in
    #: :meth:`share`; :mod:`cockpit.distributed.rows`). Where a quantity of the
    #: step does not, the cockpit joins the full parameters and gradient on every
    #: process for it. A subclass that overrides the maths (``_compute``,
    #: ``share``, ...) is not shard-local unless it says so itself.
    shard_local: ClassVar[bool] = False
    #: FSDP2, for a shard-local quantity: the names of its per-parameter
    #: elementwise sums that are reduce-scattered unit by unit during the
    #: backward pass (:class:`cockpit.distributed.unit_sums.UnitSums`), each a
    #: channel ``"<key>/<name>"``; ``()``: none.
    sums_in_backward: ClassVar[tuple[str, ...]] = ()
    #: Those of ``sums_in_backward`` that every quantity naming them forms alike
    #: from the step's per-sample gradients (MeanGSNR's and EarlyStopping's
    #: ``sum_i g_i^2``): one channel ``"<name>"`` for all, sent once.
    common_sums: ClassVar[tuple[str, ...]] = ()

    def channel(self, name: str) -> str:
        """The :class:`~cockpit.distributed.unit_sums.UnitSums` channel of a sum."""
        return name if name in self.common_sums else f"{self.key}/{name}"

    @property
    def unit_sums(self):
        """The step's ``UnitSums`` where they carry this quantity's sums.

        (:class:`~cockpit.distributed.unit_sums.UnitSums`, FSDP2, for the names
        in ``sums_in_backward``); else ``None``.
        """
        units = getattr(self.shared, "unit_sums", None)
        names = self.sums_in_backward
        if units is None or not names or not units.carries(self.channel(names[0])):
            return None
        return units

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        maths = ("_compute", "_compute_start", "_compute_end", "share", "track")
        maths += ("compute", "accumulate", "track_step")
        # maths defined before (in the MRO) the class that says shard_local, by
        # the subclass or a mixin it puts first, voids the claim
        for klass in cls.__mro__:
            if "shard_local" in klass.__dict__:
                break
            if any(m in klass.__dict__ for m in maths):
                cls.shard_local = False
                break
        if callable(cls.__dict__.get("needs")):
            raise TypeError(
                f"{cls.__name__}.needs must be data, not a method: declare "
                "`needs = frozenset({Need.BATCH_L2, ...})` (the base class applies "
                "the schedule). A quantity whose needs depend on its arguments sets "
                "`self.needs` in __init__."
            )
        # 1.0.2's protocol: the quantity is tracked through its own ``track``
        # (every step, as 1.0.2's cockpit did) or ``compute`` (scheduled steps)
        cls._own_track = cls.track is not Quantity.track
        cls._tracks_itself = cls._own_track or cls.compute is not Quantity.compute
        if cls._tracks_itself:
            if "track_step" not in cls.__dict__:
                cls.track_step = Quantity.track_step
            if cls._own_track and "is_active" not in cls.__dict__:
                cls.is_active = Quantity._every_step
            for name in ("_compute", "_compute_start", "_compute_end"):
                method = getattr(cls, name, None)
                if getattr(method, "__isabstractmethod__", False):
                    setattr(cls, name, not_implemented(name))

    def __init__(
        self,
        track_schedule: Callable[[int], bool],
        verbose: bool = False,
        key: str | None = None,
    ):
        if not callable(track_schedule):
            raise TypeError(
                f"track_schedule must be a callable step -> bool, got "
                f"{track_schedule!r}. Use cockpit.utils.schedules.linear(1) to track "
                "every step."
            )
        if key is not None and not isinstance(key, str):
            raise TypeError(f"key must be a str, got {key!r}.")
        self.track_schedule = track_schedule
        self.verbose = verbose
        self._key = key
        #: The partial results of the step being tracked (an ``Accumulator``).
        self.acc: Any = None
        #: The data-parallel step being tracked (``StepComm``), or ``None``.
        self.shared: Any = None
        self._history = None

    @property
    def key(self) -> str:
        """The name of this quantity's entries in the history."""
        return self._key if self._key is not None else type(self).__name__

    def __repr__(self) -> str:
        return f"{type(self).__name__}(key={self.key!r})"

    # --- what the quantity needs at a step (applied by the base class) ------------
    def should_compute(self, global_step: int) -> bool:
        """Return whether the schedule asks for a value at ``global_step``.

        The schedule is asked once per step (the answer is kept until another
        step is asked about): the plan, the engines and the tracking share it.
        """
        asked = self.__dict__.get("_asked")
        if (
            asked is None
            or asked[0] != global_step
            or asked[2] is not self.track_schedule
        ):
            asked = (
                global_step,
                bool(self.track_schedule(global_step)),
                self.track_schedule,
            )
            self.__dict__["_asked"] = asked
        return asked[1]

    def is_active(self, global_step: int) -> bool:
        """Return whether the quantity does any work at ``global_step``."""
        return self.should_compute(global_step)

    def needs_at(self, global_step: int) -> frozenset[Need]:
        """Return what the quantity reads at ``global_step`` (nothing if inactive)."""
        return frozenset(self.needs) if self.is_active(global_step) else frozenset()

    def create_graph(self, global_step: int) -> bool:
        """Return whether ``backward`` must keep the graph (``create_graph=True``)."""
        return _needs.create_graph(self.needs_at(global_step))

    def required_info(self, global_step: int) -> tuple[str, ...]:
        """Return the ``info`` keys this quantity reads at ``global_step``."""
        return self.info_keys if self.is_active(global_step) else ()

    @property
    def after_cleanup(self) -> bool:
        """Whether it is tracked after the engine's buffers are freed, engine off."""
        known = self.__dict__.get("_after_cleanup")  # (needs, answer)
        if known is None or known[0] is not self.needs:
            known = (self.needs, _needs.after_cleanup(self.needs))
            self.__dict__["_after_cleanup"] = known
        return known[1]

    # --- per-step work (called by the cockpit) ------------------------------------
    def begin_step(
        self, global_step: int, info: StepInfo | None = None, shared: Any = None
    ) -> None:
        """Start the step: a fresh accumulator, then :meth:`prepare`.

        ``shared`` is the data-parallel step (``StepComm``) in a run over several
        processes: :meth:`accumulate` then keeps what :meth:`share` needs.
        """
        if self._has_hooks and self.extension_hooks(global_step):
            raise NotImplementedError(
                f"{self.key}.extension_hooks({global_step}) returned hooks: 1.0.2's "
                "BackPACK extension hooks (cockpit.quantities.utils_transforms) do "
                "not run here. Fix: declare `needs` and read the per-sample "
                "statistics in `accumulate`, or return BackPACK extensions from "
                "`extensions(global_step)` and read their results in `_compute` "
                "(docs/migrating_from_1_0_2.md, '1.0.2's private names')."
            )
        accumulator = type(self).Accumulator
        self.acc = accumulator() if accumulator is not None else None
        self.shared = shared
        self.prepare(global_step, info)

    def prepare(self, global_step: int, info: StepInfo | None) -> None:  # noqa: B027
        """Check or read the step's ``info`` before the backward pass (optional).

        A quantity can fail here, before any work, or keep what it needs during
        the backward pass (such as the optimizer).
        """

    def accumulate(self, global_step: int, view: ParamView) -> None:  # noqa: B027
        """Read results for one parameter while the engine's buffers are alive.

        Called once per parameter, as soon as the module that owns it is done in
        the backward pass; the buffers are freed right after. Store small
        per-parameter summaries in ``self.acc`` (sums that could be all-reduced),
        not the buffers.
        """

    def share(self, global_step: int, ctx: TrackContext, bucket) -> Any:
        """Put the step's partial sums into ``bucket`` (data-parallel runs only).

        Called after the backward pass on every process, before tracking, with
        ``ctx.info`` of the local shard and ``ctx.gradients()`` of the joined
        batch. A quantity adds the sums over its local samples
        (``bucket.sum(tensor, then)``, ``bucket.gather(per_sample, then)``,
        ``bucket.max``) and, in ``then``, replaces them in ``self.acc`` by the sums
        over all processes, so that :meth:`track_step` computes the joined batch's
        value. See ``docs/distributed.md``.

        Returns:
            ``NotImplemented`` (the default) if the quantity cannot combine
            processes: its values then describe the local shard, and the cockpit
            warns once.
        """
        return NotImplemented

    def rows_of(self, ctx: TrackContext):
        """``ctx.rows`` for a shard-local quantity, else ``None`` (FSDP2).

        A quantity that is not shard-local (a subclass that changed the maths)
        computes on the full tensors joined for it, never on rows.
        """
        return ctx.rows if self.shard_local else None

    def abort_step(self, global_step: int) -> None:
        """Forget the partial results of a step that failed."""
        self.acc = None
        self.shared = None

    # --- estimates and two-step values (asked by the cockpit) ---------------------
    def probe_traces(self, traces: Tensor) -> None:  # noqa: B027
        """See the per-probe traces ``[probes, params]`` of this step's estimate."""

    def companions(self, global_step: int) -> dict[str, Any]:
        """Entries recorded beside the value stored under ``global_step``.

        E.g. HessMaxEV's largest eigenvalue where it differs from the value.

        Returns:
            ``{history key: value}`` (default: none).
        """
        return {}

    def estimate_error(self, global_step: int, errors):
        """The standard errors of an estimated value stored under ``global_step``.

        Args:
            global_step: The step the value is stored under.
            errors: ``(per-parameter standard errors, standard error of the sum)``
                of the curvature estimate the value was computed from.

        Returns:
            The errors to record with the value (default: ``errors``), or ``None``.
        """
        return errors

    def finishes(self, global_step: int) -> bool:
        """Whether tracking ``global_step`` finishes a value started earlier.

        Two-step quantities; decided by what is pending, not by the schedule.
        """
        return False

    def discard_start(self, global_step: int) -> bool:
        """Drop a value started at ``global_step``; return whether there was one."""
        return False

    def compute(self, global_step: int, params, batch_loss) -> list[tuple[int, Any]]:
        """Return the results due at ``global_step`` (1.0.2's signature).

        Args:
            global_step: The step.
            params: The parameters (with whatever BackPACK left on them).
            batch_loss: The mini-batch loss.

        Returns:
            ``(step_to_store_under, value)`` pairs.

        Raises:
            NotImplementedError: For a subclass of :class:`Quantity` itself that
                implements neither ``compute`` nor ``track`` (as in 1.0.2).
        """
        native = self._native_track_step()
        if native is None:
            raise NotImplementedError(
                f"{type(self).__name__} implements neither compute() nor track(). "
                "Fix: subclass SingleStepQuantity and implement _compute, or "
                "implement track(global_step, params, batch_loss)."
            )
        running = self.__dict__.get("_step_102")
        if running is not None and running[0].global_step == global_step:
            ctx = running[0]
        else:  # by hand: the info stored with CockpitCTX.set, or just the loss
            info = tracked_info(global_step) or StepInfo(
                global_step, {} if batch_loss is None else {"loss": batch_loss}
            )
            ctx = TrackContext(global_step, list(params), info)
        return to_host(native(global_step, ctx))  # numbers, as 1.0.2 returns them

    # --- checkpointing -------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Return the state that must survive a restart (default: none)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:  # noqa: B027
        """Restore the state returned by :meth:`state_dict`."""

    # --- results (1.0.2's API) -----------------------------------------------------
    def bind(self, history) -> None:
        """Let :attr:`output` read this quantity's results from ``history``.

        Values written into :attr:`output` before are recorded there now.
        """
        self._history = history
        unsent = self.__dict__.pop("_unsent", {})
        for step, value in unsent.items():
            self._record_written(step, value)

    def _record_written(self, step, value) -> None:
        if self._history is None:
            self.__dict__.setdefault("_unsent", {})[step] = value
        elif written_values({step: value}) and not isinstance(
            value, (Missing, type(None))
        ):
            self._history.add(step, self.key, value)


class SingleStepQuantity(Quantity):
    """A quantity that gives one value per tracked step, stored under that step.

    Subclasses implement ``_compute(global_step, ctx) -> value``.
    """

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls._legacy = takes_params_and_loss(cls._compute)

    def track_step(self, global_step: int, ctx: TrackContext) -> list[tuple[int, Any]]:
        """Compute and return the value for ``global_step`` if it is scheduled."""
        try:
            if not self.should_compute(global_step):
                return []
            if not self._legacy:
                return [(global_step, self._compute(global_step, ctx))]
            with self._tracked_as_102(ctx) as written:
                loss = ctx.info.get("loss")
                value = self._compute(global_step, list(ctx.params), loss)
            return [*written_values(written), (global_step, value)]
        finally:
            self.acc = None

    @abc.abstractmethod
    def _compute(self, global_step: int, ctx: TrackContext) -> Any:
        """Implemented by each subclass."""


class ByproductQuantity(SingleStepQuantity):
    """A single-step quantity that needs nothing from the backward pass.

    The name is kept for compatibility with cockpit-for-pytorch.
    """


class NothingToShare:
    """Mixin: the quantity reads only what every process already agrees on.

    Parameters, the joined batch's gradient and the joined ``info``: nothing to
    send in a data-parallel run.
    """

    def share(self, global_step: int, ctx: TrackContext, bucket) -> None:
        """Nothing to add: the values are the same on every process."""
        return None


class TwoStepQuantity(Cache102, Quantity):
    """A quantity that starts at a scheduled step ``t`` and ends at step ``t + 1``.

    The value is stored under the start step ``t``: it appears in the history only
    once step ``t + 1`` has been tracked. Subclasses implement
    ``_compute_start(global_step, ctx) -> state`` and
    ``_compute_end(global_step, ctx, state) -> value``. A start whose step ``t + 1``
    never comes through the cockpit is dropped.

    In 1.0.2's terms (which its subclasses and code reading these attributes use):
    ``SAVE_SHIFT`` is 1 for every such subclass (a value computed at step ``t + 1``
    is stored under ``t``), ``is_start(t)`` is the schedule and ``is_end(t)`` is
    ``is_start(t - SAVE_SHIFT)``. Whether a tracked step actually finishes a value
    (its start was tracked) is :meth:`finishes`.
    """

    #: 1.0.2's API: the value computed at step ``t`` is stored under
    #: ``t - SAVE_SHIFT``. 0 is 1.0.2's default, for its subclasses that compute in
    #: ``_compute_start(global_step, params, batch_loss)``/``_compute_end``; a
    #: subclass of this package's protocol always has 1.
    SAVE_SHIFT = 0

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls._legacy = takes_params_and_loss(cls._compute_start)
        if not cls._legacy and not cls._tracks_itself:
            if cls.__dict__.get("SAVE_SHIFT", 1) != 1:
                raise TypeError(
                    f"{cls.__name__}.SAVE_SHIFT must be 1: a value started at step "
                    "t is finished at step t + 1 and stored under t. SAVE_SHIFT "
                    "can only be chosen by subclasses written for 1.0.2 "
                    "(_compute_start(global_step, params, batch_loss))."
                )
            cls.SAVE_SHIFT = 1

    def __init__(self, track_schedule, verbose=False, key=None):
        super().__init__(track_schedule, verbose=verbose, key=key)
        self._pending: dict[int, Any] = {}
        self._cache: dict[int, dict[str, tuple[Any, Callable[[int], bool]]]] = {}

    def is_start(self, global_step: int) -> bool:
        """Return whether a value starts at ``global_step`` (its schedule)."""
        return self.should_compute(global_step)

    def is_end(self, global_step: int) -> bool:
        """Return whether ``global_step`` is an end point (1.0.2's meaning).

        That is, whether the schedule started a value at ``global_step -
        SAVE_SHIFT``, whatever the run did; :meth:`finishes` says whether tracking
        the step finishes a value.
        """
        return self.is_start(global_step - self.SAVE_SHIFT)

    def finishes(self, global_step: int) -> bool:
        """Return whether tracking ``global_step`` completes a pending start."""
        if self._legacy or self._tracks_itself:  # 1.0.2 subclasses keep no record
            return self.is_end(global_step)
        return global_step - 1 in self._pending

    def discard_start(self, global_step: int) -> bool:
        """Drop the value started at ``global_step``; return whether there was one."""
        return self._pending.pop(global_step, None) is not None

    def is_active(self, global_step: int) -> bool:
        """Active on start steps and on the step after each of them."""
        return self.is_start(global_step) or self.finishes(global_step)

    def track_step(self, global_step: int, ctx: TrackContext) -> list[tuple[int, Any]]:
        """Finish the pending start of the previous step, then start anew."""
        if self._legacy:
            try:
                return self._track_legacy(global_step, ctx)
            finally:
                self.acc = None
        try:
            results = []
            if self.finishes(global_step):
                state = self._pending.pop(global_step - 1)
                results.append(
                    (global_step - 1, self._compute_end(global_step, ctx, state))
                )
            for stale in [s for s in self._pending if s < global_step]:
                del self._pending[stale]
            if self.should_compute(global_step):
                state = self._compute_start(global_step, ctx)
                if isinstance(state, Missing):  # undefined from the start: say why
                    results.append((global_step, state))
                elif state is not None:  # a start without a usable state is dropped
                    self._pending[global_step] = state
            return results
        finally:
            self.acc = None

    @abc.abstractmethod
    def _compute_start(self, global_step: int, ctx: TrackContext) -> Any:
        """Implemented by each subclass."""

    @abc.abstractmethod
    def _compute_end(self, global_step: int, ctx: TrackContext, state: Any) -> Any:
        """Implemented by each subclass."""

    def state_dict(self) -> dict[str, Any]:
        """Return the pending starts (parameter snapshots and the like)."""
        if self._legacy:  # 1.0.2 caches hold callables: not resumable
            return {}
        return {"pending": dict(self._pending)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore pending starts saved by :meth:`state_dict`."""
        self._pending = dict(state.get("pending", {}))
