"""``Cockpit.missing``: integrations record values that have no value, and why."""

from __future__ import annotations

import warnings

import pytest

from cockpit import Cockpit
from cockpit import quantities as Q
from cockpit.errors import CockpitWarning
from cockpit.history import History
from cockpit.log.stream import read_stream
from cockpit.utils.schedules import linear
from tests.utils.problems import make_problem

EVERY = linear(1)
REASON = "the update was not the one replayed. Fix: leave .grad alone"


def _run(cockpit: Cockpit, problem, steps, after=None) -> None:
    """Tracked SGD steps; ``after(step)`` runs between the step and the update."""
    opt = cockpit.opt
    for step in steps:
        x, y = problem.make_batch(step)
        problem.model.zero_grad()
        out = problem.model(x)
        loss = problem.loss_fn(out, y)
        info = {"batch_size": x.shape[0], "loss": loss, "optimizer": opt,
                "individual_losses": problem.individual_loss_fn(out, y)}  # fmt: skip
        with cockpit(step, info=info):
            loss.backward()
        if after is not None:
            after(step)
        opt.step()


def _cockpit(quantities, logpath=None):
    problem = make_problem("mlp", "ce", "sgd")
    cockpit = Cockpit(problem.params, quantities, logpath=logpath)
    cockpit.opt = problem.optimizer()
    return cockpit, problem


def _missing_warnings(caught) -> list[str]:
    return [
        str(w.message)
        for w in caught
        if issubclass(w.category, CockpitWarning) and "has no value" in str(w.message)
    ]


def test_recorded_in_the_output_the_streamed_log_and_the_reloaded_history(tmp_path):
    """GradNorm every other step: step 1 has none, two reasons recorded after the
    step's values were flushed; both stay, in memory and in the log (read while
    the cockpit is still open: the crash-safe log holds them at once)."""
    logpath = str(tmp_path / "run")
    cockpit, problem = _cockpit([Q.GradNorm(linear(2)), Q.Loss(linear(2))], logpath)
    _run(cockpit, problem, [0, 1])
    with pytest.warns(CockpitWarning, match="GradNorm has no value at step 1"):
        cockpit.missing(1, cockpit.quantities[0], REASON)  # a quantity object
    with pytest.warns(CockpitWarning, match="Loss has no value at step 1: other"):
        cockpit.missing(1, "Loss", "other reason")  # a key
    want = {"GradNorm": REASON, "Loss": "other reason"}
    assert cockpit.get_output()[1]["missing"] == want
    assert cockpit.history[1]["missing"] == want
    assert read_stream(cockpit.logpath)[1]["missing"] == want  # not closed yet
    _run(cockpit, problem, [2])
    cockpit.close()
    reloaded = History.from_json(cockpit.logpath)
    assert reloaded[1]["missing"] == want
    assert "GradNorm" in reloaded[0] and "GradNorm" in reloaded[2]
    assert "missing" not in reloaded[0] and "missing" not in reloaded[2]


def test_reasons_of_the_step_itself_are_kept(tmp_path):
    """Alpha with an optimizer over half the parameters is missing at every step
    (cockpit's own check, during the step); a reason added later keeps it."""
    import torch

    problem = make_problem("mlp", "ce", "sgd")
    cockpit = Cockpit(problem.params, [Q.Alpha(EVERY), Q.GradNorm(linear(2))],
                      logpath=str(tmp_path / "run"))  # fmt: skip
    cockpit.opt = torch.optim.SGD(problem.params[:1], lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CockpitWarning)
        _run(cockpit, problem, [0, 1])
        cockpit.missing(1, ["GradNorm"], REASON)
    cockpit.close()
    for history in (cockpit.history, History.from_json(cockpit.logpath)):
        assert sorted(history[1]["missing"]) == ["Alpha", "GradNorm"]
        assert history[1]["missing"]["GradNorm"] == REASON
        assert "does not track" in history[1]["missing"]["Alpha"]


def test_an_update_that_cannot_be_replayed_makes_alpha_missing_with_the_reason(
    tmp_path,
):
    """An optimizer whose step cannot be run on a copy (here: only the instance
    the loop made steps): Alpha's start has no update to fit along, so Alpha of
    that step is missing with the reason in the output and the log, not absent."""
    import torch

    class OnlyThisOne(torch.optim.SGD):
        original = False

        def step(self, closure=None):
            if not self.original:
                raise RuntimeError("only the loop's own instance steps")
            return super().step(closure)

    problem = make_problem("mlp", "ce", "sgd")
    cockpit = Cockpit(problem.params, [Q.Alpha(EVERY), Q.GradNorm(EVERY)],
                      logpath=str(tmp_path / "run"))  # fmt: skip
    cockpit.opt = OnlyThisOne(problem.params, lr=0.1, momentum=0.9)
    cockpit.opt.original = True
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _run(cockpit, problem, [0, 1, 2])
    cockpit.close()
    for history in (cockpit.history, History.from_json(cockpit.logpath)):
        for step in (0, 1, 2):
            reason = history[step]["missing"]["Alpha"]
            assert "could not be replayed" in reason and "Fix:" in reason, reason
            assert "GradNorm" in history[step]
    alpha = [w for w in _missing_warnings(caught) if w.startswith("Alpha")]
    assert len(alpha) == 1 and "only the loop's own instance steps" in alpha[0]


def test_warned_once_per_key_and_cause():
    cockpit, problem = _cockpit([Q.GradNorm(linear(4)), Q.Loss(linear(4))])
    _run(cockpit, problem, [0])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in (1, 2, 3):  # the reason's text changes, the cause does not
            cockpit.missing(step, ["GradNorm"], f"{step} clipped", cause="clipping")
        cockpit.missing(1, ["Loss"], "1 clipped", cause="clipping")  # another key
        cockpit.missing(2, ["Loss"], REASON, cause="accumulation")  # another cause
        for step in (1, 2):  # no cause: the reason is the cause
            cockpit.missing(step, ["Loss"], "same reason")
        cockpit.missing(3, ["Loss"], "a new reason")
    assert _missing_warnings(caught) == [
        "GradNorm has no value at step 1: 1 clipped. (Recorded under 'missing'; "
        "warned once.)",
        "Loss has no value at step 1: 1 clipped. (Recorded under 'missing'; "
        "warned once.)",
        f"Loss has no value at step 2: {REASON}. (Recorded under 'missing'; warned "
        "once.)",
        "Loss has no value at step 1: same reason. (Recorded under 'missing'; "
        "warned once.)",
        "Loss has no value at step 3: a new reason. (Recorded under 'missing'; "
        "warned once.)",
    ]
    assert all(w.filename == __file__ for w in caught)  # points at the caller
    history = cockpit.history
    assert history[1]["missing"] == {"GradNorm": "1 clipped", "Loss": "same reason"}
    assert history[2]["missing"] == {"GradNorm": "2 clipped", "Loss": "same reason"}
    assert history[3]["missing"] == {"GradNorm": "3 clipped", "Loss": "a new reason"}


def test_a_started_two_step_value_is_dropped():
    """Alpha of step 1 would be finished at step 2: it is dropped, and Alpha of
    step 2 starts and finishes as usual."""
    cockpit, problem = _cockpit([Q.Alpha(EVERY)])

    def after(step):
        if step == 1:
            with pytest.warns(CockpitWarning, match="Alpha has no value at step 1"):
                cockpit.missing(step, "Alpha", REASON)

    _run(cockpit, problem, [0, 1, 2, 3], after)
    history = cockpit.history
    assert history.series("Alpha")[0] == [0, 2]
    assert history[1]["missing"] == {"Alpha": REASON}
    assert "missing" not in history[0] and "missing" not in history[2]


def test_clear_errors_and_nothing_recorded():
    cockpit, problem = _cockpit([Q.GradNorm(linear(2)), Q.Loss(EVERY)])
    other = Q.GradNorm(EVERY)
    _run(cockpit, problem, [0, 1])
    before = cockpit.history.to_dict()
    with pytest.raises(ValueError, match=r"key 'Nope'.*keys: \['GradNorm', 'Loss'\]"):
        cockpit.missing(1, ["GradNorm", "Nope"], REASON)
    with pytest.raises(ValueError, match="not one of this cockpit's quantities"):
        cockpit.missing(1, [other], REASON)  # same key, another cockpit's quantity
    with pytest.raises(ValueError, match="Loss already has a value at step 1"):
        cockpit.missing(1, ["GradNorm", "Loss"], REASON)
    with pytest.raises(TypeError, match="quantities or their keys"):
        cockpit.missing(1, [Q.GradNorm], REASON)  # a class
    with pytest.raises(TypeError, match="reason must be a string"):
        cockpit.missing(1, ["GradNorm"], None)
    with pytest.raises(ValueError, match="reason is empty"):
        cockpit.missing(1, ["GradNorm"], "  ")
    with pytest.raises(TypeError, match="global_step must be an int"):
        cockpit.missing(1.0, ["GradNorm"], REASON)
    x, y = problem.make_batch(2)
    problem.model.zero_grad()
    loss = problem.loss_fn(problem.model(x), y)
    cockpit.begin(2, info={"loss": loss, "batch_size": x.shape[0]})
    with pytest.raises(RuntimeError, match="step 2 is open.*after cockpit.end"):
        cockpit.missing(1, ["GradNorm"], REASON)
    loss.backward()
    cockpit.end()
    after = cockpit.history.to_dict()
    assert after[0] == before[0] and after[1] == before[1]  # nothing recorded
    cockpit.missing(1, [], REASON)  # nothing to record
    assert "missing" not in cockpit.history[1]
