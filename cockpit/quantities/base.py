"""Base classes for quantities.

A quantity declares, for each global step, whether it is tracked, which per-parameter
results it needs during the backward pass (:class:`~cockpit.needs.Need`), which
``info`` keys it reads and whether it needs ``create_graph``. The cockpit merges these
declarations over all quantities, runs one backward pass, shows every parameter to
:meth:`Quantity.accumulate` as soon as BackPACK is done with its module, and finally
calls :meth:`Quantity.track`, whose results go into the history.

Subclasses usually derive from :class:`SingleStepQuantity` (one value per tracked
step, implement ``_compute``) or :class:`TwoStepQuantity` (a value that needs the next
step as well, implement ``_compute_start`` and ``_compute_end``).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from backpack.extensions.backprop_extension import BackpropExtension
from torch import Tensor

from cockpit.context import StepInfo
from cockpit.needs import Need
from cockpit.param_view import ParamView


@dataclass(frozen=True)
class TrackContext:
    """Everything a quantity may read when it is tracked after the backward pass.

    Attributes:
        global_step: The current step.
        params: The cockpit's parameters, in order.
        info: What the user handed in as ``info``.
    """

    global_step: int
    params: Sequence[Tensor]
    info: StepInfo


class Quantity(abc.ABC):
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

    #: ``info`` keys read on every step at which the quantity is active.
    info_keys: tuple[str, ...] = ()
    #: Track after BackPACK buffers are freed and with BackPACK disabled (e.g. for
    #: extra Hessian-vector products).
    after_cleanup: bool = False

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

    @property
    def key(self) -> str:
        """The name of this quantity's entries in the history."""
        return self._key if self._key is not None else type(self).__name__

    def __repr__(self) -> str:
        return f"{type(self).__name__}(key={self.key!r})"

    # --- declarations ------------------------------------------------------------
    def should_compute(self, global_step: int) -> bool:
        """Return whether the schedule asks for a value at ``global_step``."""
        return bool(self.track_schedule(global_step))

    def is_active(self, global_step: int) -> bool:
        """Return whether the quantity does any work at ``global_step``."""
        return self.should_compute(global_step)

    def needs(self, global_step: int) -> set[Need]:
        """Return the per-parameter results read in :meth:`accumulate` at this step."""
        return set()

    def extensions(self, global_step: int) -> list[BackpropExtension]:
        """Return extra BackPACK extensions to run at this step (rarely needed).

        Prefer :meth:`needs`: the cockpit then picks the cheapest extensions.
        Results of extensions listed here are readable in :meth:`accumulate` via
        ``view.param.<savefield>`` and are freed right after.
        """
        return []

    def create_graph(self, global_step: int) -> bool:
        """Return whether ``backward`` must keep the graph (``create_graph=True``)."""
        return False

    def required_info(self, global_step: int) -> tuple[str, ...]:
        """Return the ``info`` keys this quantity reads at ``global_step``."""
        return self.info_keys if self.is_active(global_step) else ()

    # --- per-step work -----------------------------------------------------------
    def begin_step(self, global_step: int, info: StepInfo | None = None) -> None:
        """Prepare for the backward pass of ``global_step`` (reset accumulators).

        Called before the backward pass with the step's ``info``, so a quantity can
        validate it (and fail before any work) or read what it needs during the
        backward pass, such as the optimizer. Overrides must call ``super()``.
        """
        self._acc: dict[int, Any] = {}

    def accumulate(self, global_step: int, view: ParamView) -> None:  # noqa: B027
        """Read results for one parameter while BackPACK's buffers are alive.

        Called once per parameter, as soon as the module that owns it is done in
        the backward pass; the buffers are freed right after. Store small
        per-parameter summaries (sums that could be all-reduced), not the buffers.
        """

    def abort_step(self, global_step: int) -> None:
        """Forget the partial results of a backward pass that raised."""
        self._acc = {}

    @abc.abstractmethod
    def track(self, global_step: int, ctx: TrackContext) -> list[tuple[int, Any]]:
        """Compute the results due at ``global_step``.

        Returns:
            A list of ``(step_to_store_under, value)``; ``None`` values are skipped.
        """

    # --- checkpointing -----------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Return the state that must survive a restart (default: none)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:  # noqa: B027
        """Restore the state returned by :meth:`state_dict`."""


class SingleStepQuantity(Quantity):
    """A quantity that gives one value per tracked step, stored under that step.

    Subclasses implement ``_compute(global_step, ctx) -> value``.
    """

    def track(self, global_step: int, ctx: TrackContext) -> list[tuple[int, Any]]:
        """Compute and return the value for ``global_step`` if it is scheduled."""
        if not self.should_compute(global_step):
            return []
        return [(global_step, self._compute(global_step, ctx))]

    @abc.abstractmethod
    def _compute(self, global_step: int, ctx: TrackContext) -> Any:
        """Implemented by each subclass."""


class ByproductQuantity(SingleStepQuantity):
    """A single-step quantity that needs no BackPACK extension.

    The name is kept for compatibility with cockpit-for-pytorch.
    """


class TwoStepQuantity(Quantity):
    """A quantity that starts at a scheduled step ``t`` and ends at step ``t + 1``.

    The value is stored under the start step ``t``: it appears in the history only
    once step ``t + 1`` has been tracked. Subclasses implement
    ``_compute_start(global_step, ctx) -> state`` and
    ``_compute_end(global_step, ctx, state) -> value``. A start whose step ``t + 1``
    never comes through the cockpit is dropped.
    """

    def __init__(self, track_schedule, verbose=False, key=None):
        super().__init__(track_schedule, verbose=verbose, key=key)
        self._pending: dict[int, Any] = {}

    def is_end(self, global_step: int) -> bool:
        """Return whether ``global_step`` completes a pending start."""
        return global_step - 1 in self._pending

    def is_active(self, global_step: int) -> bool:
        """Active on scheduled steps and on the step after each of them."""
        return self.should_compute(global_step) or self.is_end(global_step)

    def track(self, global_step: int, ctx: TrackContext) -> list[tuple[int, Any]]:
        """Finish the pending start of the previous step, then start anew."""
        results = []
        if self.is_end(global_step):
            state = self._pending.pop(global_step - 1)
            results.append(
                (global_step - 1, self._compute_end(global_step, ctx, state))
            )
        for stale in [s for s in self._pending if s < global_step]:
            del self._pending[stale]
        if self.should_compute(global_step):
            state = self._compute_start(global_step, ctx)
            if state is not None:  # a start without a usable state is dropped
                self._pending[global_step] = state
        return results

    @abc.abstractmethod
    def _compute_start(self, global_step: int, ctx: TrackContext) -> Any:
        """Implemented by each subclass."""

    @abc.abstractmethod
    def _compute_end(self, global_step: int, ctx: TrackContext, state: Any) -> Any:
        """Implemented by each subclass."""

    def state_dict(self) -> dict[str, Any]:
        """Return the pending starts (parameter snapshots and the like)."""
        return {"pending": dict(self._pending)}

    def load_state_dict(self, state: dict[str, Any]) -> None:  # noqa: B027
        """Restore pending starts saved by :meth:`state_dict`."""
        self._pending = dict(state.get("pending", {}))
