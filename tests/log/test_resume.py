"""A run restarted from a checkpoint continues exactly (issue 5, part 3)."""

import math
import warnings

import pytest
import torch

from cockpit import Cockpit
from cockpit import quantities as Q
from cockpit.errors import CockpitWarning
from cockpit.history import History
from cockpit.utils.schedules import linear
from tests.utils.any_model import make_any_problem
from tests.utils.problems import make_problem

EVERY = linear(1)
STEPS = 9
CHECKPOINT = 4  # saved after step 4's optimizer.step()
DIED_AT = 6  # the first run goes on to step 6, then is killed
KEYS = ("Distance", "UpdateSize", "Alpha", "Loss", "GradNorm", "GradHist1d")


def make_quantities():
    return [
        Q.Distance(EVERY),
        Q.UpdateSize(EVERY),
        Q.Alpha(EVERY),
        Q.Loss(EVERY),
        Q.GradNorm(linear(3)),
        Q.GradHist1d(linear(2)),  # large arrays: stored compactly in the checkpoint
    ]


class Run:
    """Model, optimizer and cockpit of one process's life.

    ``spec`` is the arguments of :func:`make_problem` or a function making the
    problem (called with a seed: each life builds its model afresh and gets the
    weights from the checkpoint).
    """

    def __init__(self, spec, logpath, batches, quantities=make_quantities, seed=0):
        self.problem = spec(seed) if callable(spec) else make_problem(*spec)
        self.optimizer = self.problem.optimizer()
        self.cockpit = Cockpit(self.problem.params, quantities(), logpath=logpath)
        self.batches = batches

    def steps(self, first, last):
        problem = self.problem
        for step in range(first, last + 1):
            x, y = self.batches[step]
            self.optimizer.zero_grad()
            out = problem.model(x)
            loss = problem.loss_fn(out, y)
            info = {
                "batch_size": x.shape[0],
                "individual_losses": problem.individual_loss_fn(out, y),
                "loss": loss,
                "optimizer": self.optimizer,
            }
            with self.cockpit(step, info=info):
                loss.backward()
            self.optimizer.step()

    def checkpoint(self, path):
        torch.save(
            {
                "model": self.problem.model.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "cockpit": self.cockpit.state_dict(),
            },
            path,
        )

    def restore(self, path):
        state = torch.load(path)  # weights_only: the cockpit state is plain data
        self.problem.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.cockpit.load_state_dict(state["cockpit"])


def assert_close(got, want, where):
    if isinstance(want, dict):
        assert set(got) == set(want), where
        for key in want:
            assert_close(got[key], want[key], where)
    elif isinstance(want, list):
        assert len(got) == len(want), where
        for g, w in zip(got, want):
            assert_close(g, w, where)
    else:
        assert math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-12), (where, got, want)


def interrupted_and_resumed(tmp_path, spec, quantities=make_quantities):
    """Return the outputs and logs of an uninterrupted and a resumed run."""
    batch_source = spec(0) if callable(spec) else make_problem(*spec)
    batches = [batch_source.make_batch(s) for s in range(STEPS + 1)]

    whole = Run(spec, str(tmp_path / "whole"), batches, quantities)
    whole.steps(0, STEPS)

    # the first life: checkpoint after step 4, then steps 5-6 on other data (so its
    # records differ from the resumed run's), then killed while writing a record
    other = [(x + 1.0, y) for x, y in batches]
    first = Run(
        spec, str(tmp_path / "resumed"), batches[: CHECKPOINT + 1] + other, quantities
    )
    first.steps(0, CHECKPOINT)
    first.checkpoint(tmp_path / "ckpt.pt")
    first.steps(CHECKPOINT + 1, DIED_AT)
    logpath = first.cockpit.logpath
    first.cockpit.close()
    with open(logpath, "ab") as handle:
        handle.write(b'{"step":7,"values":{"Loss":')
    del first

    second = Run(spec, str(tmp_path / "resumed"), batches, quantities, seed=1)
    second.restore(tmp_path / "ckpt.pt")
    second.steps(CHECKPOINT + 1, CHECKPOINT + 1)
    # the dead life's later records are superseded as soon as the run resumes
    with warnings.catch_warnings():
        warnings.simplefilter("error", CockpitWarning)  # the torn record was cut off
        assert max(History.from_json(logpath).steps) == CHECKPOINT + 1
    second.steps(CHECKPOINT + 2, STEPS)

    return (
        whole.cockpit.history.to_dict(),
        second.cockpit.history.to_dict(),
        History.from_json(whole.cockpit.logpath).to_dict(),
        History.from_json(logpath).to_dict(),
    )


def assert_same_values(want, got, keys):
    assert sorted(got) == sorted(want)
    for step in want:
        for key in keys:
            assert (key in want[step]) == (key in got[step]), (step, key)
            if key in want[step]:
                assert_close(got[step][key], want[step][key], (step, key))


@pytest.mark.parametrize(
    "spec",
    [("mlp", "ce", "sgd"), ("cnn", "mse", "sgd"), ("mlp", "ce", "momentum")],
    ids=["mlp-ce-sgd", "cnn-mse-sgd", "mlp-ce-momentum"],
)
def test_interrupted_and_resumed_run_equals_uninterrupted(tmp_path, spec):
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # resuming warns about nothing
        warnings.filterwarnings("ignore", message="Full backward hook")  # PyTorch's
        want, got, want_log, got_log = interrupted_and_resumed(tmp_path, spec)
    assert_same_values(want, got, KEYS)
    assert_same_values(want_log, got_log, KEYS)
    assert all("Alpha" in want[s] for s in range(STEPS))  # Alpha was compared


@pytest.mark.parametrize("optimizer", ["momentum", "adam"])
def test_alpha_resumes_with_stateful_optimizers(tmp_path, optimizer):
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        warnings.filterwarnings("ignore", message="Full backward hook")  # PyTorch's
        want, got, _, _ = interrupted_and_resumed(tmp_path, ("mlp", "mse", optimizer))
    assert_same_values(want, got, ["Alpha"])
    assert all("Alpha" in want[s] for s in range(STEPS))


def estimated_quantities():
    return [
        Q.HessTrace(EVERY, curvature="hutchinson"),
        Q.Loss(EVERY),
        Q.GradNorm(linear(2)),
    ]


ESTIMATED = ("HessTrace", "HessTrace_estimate", "Loss", "GradNorm")


def test_resumed_hutchinson_estimates_are_bit_identical(tmp_path):
    """RMSNorm: BackPACK has no Hessian diagonal, HessTrace is estimated with
    random probes; the resumed run must draw the uninterrupted run's probes."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # estimates: no warning
        warnings.filterwarnings("ignore", message="Full backward hook")  # PyTorch's
        want, got, want_log, got_log = interrupted_and_resumed(
            tmp_path,
            lambda seed: make_any_problem("rmsnorm-mlp", batch_size=6, seed=seed),
            estimated_quantities,
        )
    for wanted, gotten in ((want, got), (want_log, got_log)):
        assert sorted(gotten) == sorted(wanted)
        for step in wanted:
            for key in ESTIMATED:
                assert (key in wanted[step]) == (key in gotten[step]), (step, key)
            # bit-identical values and standard errors, not merely close
            assert gotten[step]["HessTrace"] == wanted[step]["HessTrace"], step
            assert (
                gotten[step]["HessTrace_estimate"]
                == (wanted[step]["HessTrace_estimate"])
            ), step
    assert all("HessTrace_estimate" in want[s] for s in range(STEPS + 1))
    # a probe sequence restarted at the checkpoint would differ: the test can fail
    assert want[CHECKPOINT + 1]["HessTrace"] != want[0]["HessTrace"]


def test_state_without_estimate_generator_keeps_default_and_warns(tmp_path):
    """A state of an older cockpit (no generator state) still loads: the fresh
    cockpit's seeded source stays, and a warning says that the estimates after
    the checkpoint differ from an uninterrupted run's, only if there were any."""
    problem = make_any_problem("rmsnorm-mlp", batch_size=6)
    batches = [problem.make_batch(s) for s in range(2)]
    life = Run(lambda seed: problem, None, batches, estimated_quantities)
    life.steps(0, 1)
    state = life.cockpit.state_dict()
    assert state["estimate_generator"].dtype == torch.uint8
    old = {k: v for k, v in state.items() if k != "estimate_generator"}
    fresh = Cockpit(problem.params, estimated_quantities())
    default = fresh._router.generator.get_state()
    with pytest.warns(CockpitWarning, match=r"no random source.*after step 1"):
        fresh.load_state_dict(old)
    assert torch.equal(fresh._router.generator.get_state(), default)
    fresh.load_state_dict(state)  # the saved source replaces the default
    assert torch.equal(
        fresh._router.generator.get_state(), life.cockpit._router.generator.get_state()
    )
    exact = Cockpit(problem.params, [Q.Loss(EVERY)])  # no estimates: nothing to say
    with warnings.catch_warnings():
        warnings.simplefilter("error", CockpitWarning)
        exact.load_state_dict({"quantities": {"Loss": {}}, "history": {}})
    with pytest.raises(ValueError, match=r"estimate_generator.*Fix: pass the dict"):
        exact.load_state_dict(
            dict(state, quantities={"Loss": {}}, estimate_generator=torch.zeros(3))
        )


def test_state_dict_mismatch_and_bad_input_are_explained(tmp_path):
    problem = make_problem("mlp", "ce")
    cockpit = Cockpit(problem.params, [Q.Distance(EVERY), Q.UpdateSize(EVERY)])
    state = cockpit.state_dict()
    other = Cockpit(problem.params, [Q.Distance(EVERY), Q.Loss(EVERY)])
    with pytest.raises(ValueError, match=r"missing \['Loss'\], unexpected \['UpdateS"):
        other.load_state_dict(state)
    other.load_state_dict(state, strict=False)  # Loss starts afresh
    with pytest.raises(ValueError, match=r"Cockpit.state_dict\(\).*Fix"):
        other.load_state_dict(problem.model.state_dict())
    with pytest.raises(ValueError, match=r"version 99.*upgrade"):
        other.load_state_dict(dict(state, version=99))
