"""One ledger per step: what happens to every quantity due at it.

Each active quantity is *computed* (exact), *estimated* (with a standard error) or
*missing* (with the reason and the fix). Every check of the step writes here
(routing, the loss-scale and repeated-backward checks, non-finite values, a
missing double backward, a quantity's own :class:`~cockpit.quantities.base.Missing`);
the step's plan, the ``missing`` records and the warnings are derived from it in
one place (:meth:`Ledger.plan`, :meth:`Ledger.settle`), and so is every recorded
value with its estimate (:meth:`Ledger.record`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from cockpit.log.keys import ESTIMATE_SUFFIX
from cockpit.quantities.base import Missing
from cockpit.utils.host import Deferred

COMPUTED = "computed"
ESTIMATED = "estimated"
MISSING = "missing"


@dataclass
class Entry:
    """The status of one quantity at the step.

    Attributes:
        status: :data:`COMPUTED`, :data:`ESTIMATED` or :data:`MISSING`.
        reason: Why it is missing, or how it is estimated.
        errors: ``(per-parameter standard errors, standard error of the sum)``
            of an estimate, once known.
        settings: How the estimate was made (``method``, ``curvature``, ...), as
            recorded with the errors (over the step's :attr:`Ledger.estimator`).
    """

    status: str = COMPUTED
    reason: str = ""
    errors: Any = None
    settings: Any = None


class Ledger:
    """The account of one step.

    Args:
        plan: The step's plan (before anything was left out).
        recorder: Where values and ``missing`` reasons go.
        diagnostics: Warns once per quantity and reason.
    """

    def __init__(self, plan, recorder, diagnostics):
        self.step = plan.global_step
        #: The plan before anything was left out.
        self.planned = plan
        self._plan = plan
        self._derived = None
        self.recorder = recorder
        self.diagnostics = diagnostics
        self.entries: dict[int, Entry] = {id(q): Entry() for q in plan.active}
        self._notes: list[tuple] = []
        #: Values decided on the host (``Deferred``): ``(quantity, step, keys)``.
        self._deferred: list[tuple] = []
        #: Settings of the estimates (``method``, ``probes``) as recorded.
        self.estimator: dict[str, Any] = {}

    # --- writing ----------------------------------------------------------------------
    def leave_out(
        self,
        quantities,
        reason: str,
        steps: Sequence[int] | None = None,
        once=None,
        abort: bool = True,
        short: str | None = None,
    ) -> None:
        """Record ``quantities`` (one or several) as missing, with ``reason``.

        Args:
            quantities: A quantity or a list of them (one warning names them all).
            reason: Why, with the fix (the text of the record and the warning).
            steps: The steps without a value (default: this step).
            once: What makes the warning new (see ``StepChecks.missing``);
                ``False``: no warning (the caller gives its own).
            abort: Whether the quantities drop this step's work (``False`` for a
                value the quantity itself returned as missing).
            short: The reason as the coverage report shows it (default: ``reason``).
        """
        group = quantities if isinstance(quantities, (list, tuple)) else [quantities]
        for quantity in group if abort else ():
            quantity.abort_step(self.step)
            entry = self.entries.setdefault(id(quantity), Entry())
            entry.status, entry.reason = MISSING, short or reason
        keys = [q.key for q in group]
        key = keys[0] if not isinstance(quantities, (list, tuple)) else keys
        self._notes.append((list(steps or [self.step]), key, reason, once))

    def estimate(self, quantity, how: str) -> None:
        """Mark ``quantity`` as estimated at this step (``how``: the method)."""
        self.entries[id(quantity)] = Entry(ESTIMATED, how)

    def set_errors(self, quantity, errors, settings=None) -> None:
        """The standard errors of ``quantity``'s estimate (and how it was made)."""
        entry = self.entries[id(quantity)]
        entry.errors = errors
        if settings is not None:  # (joined errors keep the settings)
            entry.settings = settings

    # --- reading ----------------------------------------------------------------------
    def out(self, quantity) -> bool:
        """Whether ``quantity`` has no value at this step."""
        entry = self.entries.get(id(quantity))
        return entry is not None and entry.status == MISSING

    def estimated(self) -> list:
        """The active quantities whose curvature is estimated at this step."""
        return [q for q in self._plan.active if self.entries[id(q)].status == ESTIMATED]

    def plan(self):
        """The plan without the quantities left out so far (derived once)."""
        if self._derived is None:
            gone = [q for q in self._plan.active if self.out(q)]
            self._derived = self._plan.without(gone) if gone else self._plan
        return self._derived

    def record(self, quantity, save_step: int, value) -> None:
        """Record a value of ``quantity`` (and its standard error if estimated)."""
        if value is None:
            return
        if isinstance(value, Missing):
            self.leave_out(quantity, value.reason, steps=[save_step], abort=False)
            return
        keys = [quantity.key]
        self.recorder.record(save_step, keys[0], value)
        for key, extra in quantity.companions(save_step).items():
            self.recorder.record(save_step, key, extra)
            keys.append(key)
        entry = self.entries.get(id(quantity), Entry())
        errors = entry.errors
        if errors is not None:
            errors = quantity.estimate_error(save_step, errors)
        if isinstance(value, Deferred):
            self._deferred.append((quantity, save_step, keys))
        if errors is not None:
            per_param, total = errors
            keys.append(f"{keys[0]}{ESTIMATE_SUFFIX}")
            self.recorder.record(
                save_step,
                keys[-1],
                {
                    **self.estimator,
                    **(entry.settings or {}),
                    "stderr": list(per_param),  # recorded as numbers
                    "stderr_sum": total,
                },
            )

    def settle(self) -> None:
        """Decide the deferred values; note the missing ones, warn once per reason.

        Where values are decided on the host (:class:`~cockpit.utils.host.
        Deferred`), the step's values go there now, in one copy per device: the
        flush that follows has nothing left to copy.
        """
        if self._deferred:
            deferred, self._deferred = self._deferred, []
            self.recorder.to_host()
            for quantity, step, keys in deferred:
                value = self.recorder.value(step, keys[0])
                if isinstance(value, Missing):
                    self.recorder.forget(step, keys)
                    self.leave_out(quantity, value.reason, steps=[step], abort=False)
        notes, self._notes = self._notes, []
        for steps, key, reason, once in notes:
            if once is False:
                for step in steps:
                    for name in [key] if isinstance(key, str) else key:
                        self.recorder.note_missing(step, name, reason)
            else:
                self.diagnostics.missing(self.recorder, steps, key, reason, once=once)
