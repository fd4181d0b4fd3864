"""Issue-2 quantities against brute-force float64 references from their definitions."""

import time

import pytest
import torch

from cockpit import quantities as Q
from cockpit.needs import Need
from cockpit.utils.schedules import linear
from tests.utils import brute_force as bf
from tests.utils.harness import run
from tests.utils.problems import (
    make_problem,
    tracked_steps,
)

STEPS = 5
RTOL, ATOL = 1e-6, 1e-10


def close(actual, expected, what=""):
    actual = torch.as_tensor(actual, dtype=torch.float64)
    expected = torch.as_tensor(expected, dtype=torch.float64)
    torch.testing.assert_close(
        actual, expected, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}"
    )


def test_loss(problem, schedule):
    result = run(problem, [Q.Loss(schedule)], steps=STEPS)
    out = result.output
    assert sorted(out) == tracked_steps(schedule, STEPS)
    for step in tracked_steps(schedule, STEPS):
        rec = result.records[step]
        close(
            out[step]["Loss"], bf.batch_loss(problem, rec.params, rec.x, rec.y), "Loss"
        )


def test_grad_norm(problem, schedule):
    result = run(problem, [Q.GradNorm(schedule)], steps=STEPS)
    for step in tracked_steps(schedule, STEPS):
        rec = result.records[step]
        expected = [g.norm() for g in bf.gradient(problem, rec.params, rec.x, rec.y)]
        close(result.output[step]["GradNorm"], expected, f"GradNorm step {step}")


def test_distance(problem, schedule):
    result = run(problem, [Q.Distance(schedule)], steps=STEPS)
    initial = result.records[0].params  # snapshot at the first step seen
    assert sorted(result.output) == tracked_steps(schedule, STEPS)
    for step in tracked_steps(schedule, STEPS):
        rec = result.records[step]
        expected = [(p - p0).norm() for p, p0 in zip(rec.params, initial)]
        close(result.output[step]["Distance"], expected, f"Distance step {step}")


def test_update_size(problem, schedule):
    result = run(problem, [Q.UpdateSize(schedule)], steps=STEPS)
    expected_steps = [s for s in tracked_steps(schedule, STEPS) if s + 1 < STEPS]
    assert sorted(result.output) == expected_steps
    for step in expected_steps:
        now, nxt = result.records[step], result.records[step + 1]
        expected = [(b - a).norm() for a, b in zip(now.params, nxt.params)]
        close(result.output[step]["UpdateSize"], expected, f"UpdateSize step {step}")


def test_parameters(problem, schedule):
    result = run(problem, [Q.Parameters(schedule)], steps=STEPS)
    for step in tracked_steps(schedule, STEPS):
        stored = result.output[step]["Parameters"]
        for value, p in zip(stored, result.records[step].params):
            close(value, p, "Parameters")


def test_time(problem, schedule):
    before = time.time()
    result = run(problem, [Q.Time(schedule)], steps=STEPS)
    stamps = [result.output[s]["Time"] for s in tracked_steps(schedule, STEPS)]
    assert before <= stamps[0] <= time.time()
    assert stamps == sorted(stamps)


@pytest.mark.parametrize("curvature", ["diag_h", "diag_ggn_exact"])
def test_hess_trace(problem, schedule, curvature):
    result = run(problem, [Q.HessTrace(schedule, curvature=curvature)], steps=STEPS)
    matrix = bf.hessian if curvature == "diag_h" else bf.ggn
    for step in tracked_steps(schedule, STEPS):
        rec = result.records[step]
        diag = bf.split_diagonal(matrix(problem, rec.params, rec.x, rec.y), rec.params)
        expected = [d.sum() for d in diag]
        close(result.output[step]["HessTrace"], expected, f"{curvature} step {step}")


def test_hess_trace_mc_is_unbiased_for_ggn():
    """The MC-GGN trace averages to the exact GGN trace (statistical check)."""
    problem = make_problem("mlp", "ce", "sgd", batch_size=4)
    torch.manual_seed(123)
    x, y = problem.make_batch(0)
    repeats = 400
    from cockpit import Cockpit

    cockpit = Cockpit(problem.params, [Q.HessTrace(linear(1), curvature="diag_ggn_mc")])
    samples = []
    for step in range(repeats):
        for p in problem.params:
            p.grad = None
        loss = problem.loss_fn(problem.model(x), y)
        with cockpit(step, info={"loss": loss}):
            loss.backward()
        samples.append(torch.tensor(cockpit.get_output()[step]["HessTrace"]))
    samples = torch.stack(samples).sum(1)  # total trace per repeat
    exact = torch.diagonal(bf.ggn(problem, problem.params, x, y)).sum()
    mean, sem = samples.mean(), samples.std() / repeats**0.5
    assert sem > 0  # the estimator is random
    assert abs(mean - exact) < 4 * sem, (mean, exact, sem)


def test_variance(problem, schedule):
    result = run(problem, [Q.Variance(schedule)], steps=STEPS)
    for step in tracked_steps(schedule, STEPS):
        rec = result.records[step]
        per_sample = bf.individual_gradients(problem, rec.params, rec.x, rec.y)
        expected = []
        for g_i in per_sample:
            g = g_i.mean(0)
            expected.append(((g_i - g) ** 2).flatten(1).sum(1).mean())
        close(result.output[step]["Variance"], expected, f"Variance step {step}")


def test_variance_with_batch_grad_source(problem):
    """Variance is the same when per-sample norms come from BatchGrad (shared pass)."""
    schedule = linear(1)
    plain = run(problem, [Q.Variance(schedule)], steps=2).output
    problem2 = make_problem(*problem.name.split("-"))
    shared = run(problem2, [Q.Variance(schedule), _NeedsGradBatch(schedule)], steps=2)
    for step in plain:
        close(shared.output[step]["Variance"], plain[step]["Variance"], "Variance")
        # the other quantity really saw per-sample gradients of every parameter
        n = problem.batch_size
        assert shared.output[step]["_NeedsGradBatch"] == [n] * len(problem.params)


class _NeedsGradBatch(Q.SingleStepQuantity):
    """A quantity that forces BatchGrad (to test statistic sharing)."""

    needs = frozenset({Need.INDIVIDUAL_GRADIENTS})
    Accumulator = Q.PerParameter

    def accumulate(self, global_step, view):
        self.acc.entries[view.index] = view.individual_gradients().shape[0]

    def _compute(self, global_step, ctx):
        return self.acc.ordered(len(ctx.params))
