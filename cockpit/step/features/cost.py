"""What a tracked step costs: one line, once, when tracking is expensive.

The cockpit's steps are timed (wall clock; on a GPU after a synchronisation) until
the cost is known, then never again:

* the ``with cockpit(...)`` block of every step, in three parts for tracked steps:
  the cockpit's work before your backward pass (per-sample gradients from the
  replay and autograd engines, quantities beginning), your backward pass (with
  BackPACK's extensions and the quantities that read them as each layer
  finishes), and the cockpit's work after it (e.g. Hessian-vector products);
* the rest of your loop: from the end of one block to the start of the next
  (forward pass, optimizer step, data).

Untracked steps (a sparse ``track_schedule``) give the cost of a plain iteration,
so the line compares the two: tracking is expensive if a tracked iteration costs
at least :data:`COST_RATIO` untracked ones. When every step is tracked there is no
untracked one to time (the cockpit cannot run a second, plain backward pass: the
first frees what BackPACK stored): the line then gives the parts, and tracking is
expensive if the ``with`` block costs at least :data:`BLOCK_RATIO` times the rest
of the loop. A plain backward pass costs about one to three forward passes, and
the forward pass is part of the rest, so a plain block is at most about three
times the rest (usually less: the rest also holds the optimizer step and the
data). A tracked step shorter than :data:`MIN_SECONDS` never gets a line (a toy
model's step is cheap whatever the ratio). The first tracked step (one-time
set-up) is not a measurement.

The line goes to the ``cockpit`` logger at INFO, like the coverage line (one per
run, from the process that writes the log), with what makes tracking cheaper: a
sparser schedule or a lighter configuration.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field
from statistics import median

import torch

from cockpit.step.console import LOG
from cockpit.step.features.base import StepFeature, register_feature

#: A tracked iteration at least this many times an untracked one is worth a line.
COST_RATIO = 5.0

#: Every step tracked: a ``with`` block at least this many times the rest of the
#: loop is worth a line.
BLOCK_RATIO = 5.0

#: A tracked step shorter than this (seconds) is never worth a line (toy models).
MIN_SECONDS = 0.05

#: Tracked steps measured after the first (whose set-up is left out).
TRACKED_STEPS = 2

#: Untracked steps measured, if the schedule has them between tracked ones.
UNTRACKED_STEPS = 3


def clock() -> float:
    """Seconds of wall time (a function of its own, so that tests can drive it)."""
    return time.perf_counter()


@dataclass
class _Tracked:
    step: int
    before: float  # the cockpit's work before the backward pass
    backward: float  # the backward pass, with BackPACK's extensions
    after: float  # the cockpit's work after it
    rest: float = 0.0  # the rest of the loop until the next step

    @property
    def cockpit(self) -> float:
        return self.before + self.after

    @property
    def block(self) -> float:
        return self.before + self.backward + self.after

    @property
    def total(self) -> float:
        return self.block + self.rest


@dataclass
class _Untracked:
    step: int
    block: float  # the with block: the backward pass alone
    rest: float = 0.0

    @property
    def total(self) -> float:
        return self.block + self.rest


@dataclass
class _Clock:
    """The measurements of one cockpit (kept until the line is decided)."""

    sync: bool
    tracked: list[_Tracked] = field(default_factory=list)
    untracked: list[_Untracked] = field(default_factory=list)
    pending: tuple[_Tracked | _Untracked, float] | None = None
    seen_tracked: int = 0
    done: bool = False


#: One clock per cockpit, found through its recorder (which every step holds).
_CLOCKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _speaks(state) -> bool:
    """Whether this process prints the line (not data-parallel, or rank 0)."""
    communicator = state.communicator
    return communicator is None or communicator.local or communicator.rank == 0


def _clock_of(state) -> _Clock:
    found = _CLOCKS.get(state.recorder)
    if found is None:
        sync = any(p.device.type == "cuda" for p in state.params)
        found = _CLOCKS[state.recorder] = _Clock(sync=sync, done=not _speaks(state))
    return found


@register_feature
class StepCost(StepFeature):
    """Times the step's parts until the cost line is decided (see the module)."""

    order = -1000.0  # first at every point: its marks bound the others' work

    @classmethod
    def applies(cls, state) -> bool:
        """Only while the line is undecided."""
        return not _clock_of(state).done

    def __init__(self, state):
        super().__init__(state)
        self.clock = _clock_of(state)
        self.tracked = bool(state.plan.active)
        self.marks = [self._now()]  # the step opens
        pending, self.clock.pending = self.clock.pending, None
        if pending is not None:
            record, ended = pending
            record.rest = self.marks[0] - ended
            self._keep(record)

    def _now(self) -> float:
        if self.clock.sync:
            torch.cuda.synchronize()
        return clock()

    def before_backward(self) -> None:
        """The cockpit's work before the user's backward pass ends here."""
        self.marks.append(self._now())

    def after_backward(self, produced) -> None:
        """The user's backward pass ended."""
        self.marks.append(self._now())

    def close(self) -> None:
        """The step's block ends; its rest is measured when the next one opens."""
        end = self._now()
        step = self.state.step
        if self.tracked and len(self.marks) == 3:
            opened, ready, backward_done = self.marks
            record = _Tracked(
                step, ready - opened, backward_done - ready, end - backward_done
            )
        elif not self.tracked:
            record = _Untracked(step, end - self.marks[0])
        else:  # a tracked step that failed or stopped early: not a measurement
            return
        self.clock.pending = (record, end)

    def _keep(self, record: _Tracked | _Untracked) -> None:
        clock = self.clock
        if isinstance(record, _Tracked):
            clock.seen_tracked += 1
            if clock.seen_tracked > 1:  # the first holds the one-time set-up
                clock.tracked.append(record)
        elif len(clock.untracked) < UNTRACKED_STEPS:
            clock.untracked.append(record)
        if len(clock.tracked) >= TRACKED_STEPS:
            clock.done = True
            line = cost_line(clock.tracked, clock.untracked, self.state.step)
            if line is not None:
                LOG.info(line)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms"


def _steps(records) -> str:
    steps = [r.step for r in records]
    if len(steps) > 2 and steps == list(range(steps[0], steps[-1] + 1)):
        return f"steps {steps[0]}-{steps[-1]}"
    return "steps " + ", ".join(str(s) for s in steps)


def cost_line(tracked: list, untracked: list, step: int) -> str | None:
    """The line for these measurements, or ``None`` if tracking is not expensive.

    Args:
        tracked: Measured tracked steps (after the first).
        untracked: Measured untracked steps (none if every step is tracked).
        step: The step at which the line is printed.
    """
    cost = median(r.total for r in tracked)
    if cost < MIN_SECONDS:
        return None
    own = median(r.cockpit for r in tracked)
    backward = median(r.backward for r in tracked)
    rest = median(r.rest for r in tracked)
    parts = (
        f"{_ms(backward)} in your backward pass with the cockpit's extensions, "
        f"{_ms(own)} in the cockpit's work before and after it, {_ms(rest)} in the "
        "rest of your loop (forward pass, optimizer step, data)"
    )
    if untracked:
        plain = median(r.total for r in untracked)
        ratio = cost / plain if plain > 0 else float("inf")
        if ratio < COST_RATIO:
            return None
        seen = (
            f"a tracked step took {_ms(cost)} against {_ms(plain)} for an untracked "
            f"one ({ratio:.3g}x; wall time of the whole iteration, "
            f"{_steps(tracked)} against {_steps(untracked)}): {parts}."
        )
    else:
        block = median(r.block for r in tracked)
        ratio = block / rest if rest > 0 else float("inf")
        if ratio < BLOCK_RATIO:
            return None
        seen = (
            f"every step is tracked (quantities of two steps, such as Alpha and "
            f"UpdateSize, also track the step after each scheduled one), and a "
            f"tracked step took {_ms(cost)} (wall time, "
            f"{_steps(tracked)}): {parts}. The with block took {ratio:.3g}x the "
            "rest; a plain backward pass costs about one to three forward passes, "
            "so a tracked step costs several untracked ones (track a sparser "
            "schedule to have this measured)."
        )
    return (
        f"cockpit cost at step {step}: {seen} Cheaper: track fewer steps (a sparser "
        "track_schedule, e.g. configuration(..., track_schedule=linear(10)) or "
        "logarithmic(...)) or fewer and lighter quantities "
        "(configuration('economy') leaves out the curvature); cockpit.coverage() "
        "names the engine of each parameter."
    )
