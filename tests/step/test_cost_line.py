"""The cost line: what a tracked step costs, said once when tracking is expensive.

Timings are not asserted on real clocks: the module's clock is replaced by one the
test advances, in the user's loop (forward pass, backward pass) and inside the
cockpit's work (a quantity that "takes" time when it is computed).
"""

from __future__ import annotations

import logging

import pytest
import torch
from backpack import extend

import cockpit.step.features.cost as cost
from cockpit import Cockpit
from cockpit.quantities import SingleStepQuantity
from cockpit.utils.schedules import linear

REST, BACKWARD = 0.010, 0.004  # seconds of the user's loop, by the fake clock


class FakeClock:
    """Time that moves only when told."""

    def __init__(self):
        self.now = 0.0
        self.reads = 0

    def __call__(self) -> float:
        self.reads += 1
        return self.now


class Slow(SingleStepQuantity):
    """A quantity whose computation takes ``seconds`` of the fake clock."""

    needs = frozenset()

    def __init__(self, schedule, clock: FakeClock, seconds: float):
        super().__init__(schedule)
        self.fake, self.seconds = clock, seconds

    def _compute(self, global_step, ctx):
        self.fake.now += self.seconds
        return 0.0


@pytest.fixture
def fake(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(cost, "clock", clock)
    return clock


class Run:
    """A linear model trained under the fake clock."""

    def __init__(self, fake: FakeClock, seconds: float, schedule):
        torch.manual_seed(0)
        self.fake = fake
        self.model = extend(torch.nn.Linear(3, 2))
        self.loss_fn = extend(torch.nn.MSELoss())
        self.cockpit = Cockpit(self.model.parameters(), [Slow(schedule, fake, seconds)])
        self.step = 0

    def train(self, steps: int) -> Run:
        for _ in range(steps):
            self.fake.now += REST  # forward pass, optimizer step, data
            loss = self.loss_fn(self.model(torch.randn(4, 3)), torch.randn(4, 2))
            with self.cockpit(self.step, info={"loss": loss}):
                self.fake.now += BACKWARD
                loss.backward()
            self.step += 1
        return self


def _train(fake: FakeClock, seconds: float, schedule, steps: int = 12) -> Run:
    return Run(fake, seconds, schedule).train(steps)


def _lines(caplog) -> list[tuple[int, str]]:
    return [
        (r.levelno, r.getMessage())
        for r in caplog.records
        if r.name == "cockpit" and r.getMessage().startswith("cockpit cost")
    ]


def test_every_step_tracked_and_expensive(fake, caplog):
    """Steps 1 and 2 are measured (step 0 holds the set-up): the with block is
    BACKWARD + 0.5 s against REST, so one line at step 3, with the parts."""
    with caplog.at_level(logging.INFO, logger="cockpit"):
        _train(fake, 0.5, linear(1))
    ((level, line),) = _lines(caplog)
    assert level == logging.INFO
    assert line.startswith("cockpit cost at step 3: every step is tracked")
    assert "took 514 ms (wall time, steps 1, 2)" in line
    assert "4 ms in your backward pass" in line
    assert "500 ms in the cockpit's work before and after it" in line
    assert "10 ms in the rest of your loop" in line
    assert "The with block took 50.4x the rest" in line
    assert "track_schedule=linear(10)" in line and "'economy'" in line


def test_a_sparse_schedule_compares_with_untracked_steps(fake, caplog):
    """linear(5): steps 0 and 5 tracked (0 is the set-up), the others untracked
    (block BACKWARD, rest REST); decided when step 10's rest is known."""
    with caplog.at_level(logging.INFO, logger="cockpit"):
        _train(fake, 0.2, linear(5), steps=12)
    ((_, line),) = _lines(caplog)
    assert line.startswith("cockpit cost at step 11: a tracked step took 214 ms")
    assert "against 14 ms for an untracked one (15.3x" in line
    assert "steps 5, 10 against steps 1-3" in line


@pytest.mark.parametrize("schedule", [linear(1), linear(5)], ids=["every", "sparse"])
def test_cheap_tracking_says_nothing(fake, caplog, schedule):
    with caplog.at_level(logging.INFO, logger="cockpit"):
        _train(fake, 0.001, schedule, steps=20)
    assert _lines(caplog) == []


@pytest.mark.parametrize("seconds", [0.5, 0.001], ids=["expensive", "cheap"])
def test_the_clock_stops_once_decided(fake, seconds):
    run = _train(fake, seconds, linear(1), steps=4)  # decided at step 3
    reads = fake.reads
    run.train(5)
    assert fake.reads == reads


def test_only_the_logs_writer_speaks():
    class Communicator:
        local, rank = False, 1

    class Step:
        communicator = Communicator()

    assert not cost._speaks(Step())
    Step.communicator.rank = 0
    assert cost._speaks(Step())
    Step.communicator = None
    assert cost._speaks(Step())


def test_a_toy_models_step_is_never_worth_a_line():
    """20x an untracked step, but 10 ms: no line; the same ratio at 1 s: a line."""
    for scale, said in ((0.01, False), (1.0, True)):
        tracked = [cost._Tracked(s, 0.2 * scale, 0.1 * scale, 0.65 * scale,
                                 0.05 * scale) for s in (1, 2)]  # fmt: skip
        untracked = [cost._Untracked(s, 0.01 * scale, 0.04 * scale) for s in (3, 4)]
        line = cost.cost_line(tracked, untracked, 5)
        assert (line is not None) == said
        assert line is None or "(20x;" in line
