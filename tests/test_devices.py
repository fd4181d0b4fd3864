"""On the GPU: the engines, checkpoint/resume, the dashboard, fp16 with a GradScaler.

Their CPU cases are the existing tests of each
(``tests/engines/test_ghost_engine.py``, ``tests/engines/test_replay_engine.py``,
``tests/log/test_resume.py``, ``tests/plotting/test_plotting.py``,
``tests/test_mixed_precision.py``); here the same checks run on the CUDA device,
against the float64 brute force on the CPU (tolerance: that of the CPU tests,
``RTOL``/``ATOL``; float64 on either device differs by rounding only). Without a GPU
they skip with the reason; ``COCKPIT_DEVICE_TESTS_ON_CPU=1`` runs them on the CPU
as well (to check the tests themselves).

The host-synchronisation and device-following tests (``tests/step/test_host_syncs.py``)
run on the CPU.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from cockpit import Cockpit
from cockpit import quantities as Q
from cockpit.errors import CockpitWarning
from cockpit.history import History
from cockpit.utils.schedules import linear
from tests.conftest import DEVICES
from tests.utils import brute_force as bf
from tests.utils.harness import run
from tests.utils.problems import Problem, make_problem

RTOL, ATOL = 1e-6, 1e-10
STEPS = 3
CASES = DEVICES if os.environ.get("COCKPIT_DEVICE_TESTS_ON_CPU") else DEVICES[1:]
pytestmark = pytest.mark.parametrize("device", CASES, indirect=True)


def close(actual, expected, what=""):
    actual = torch.as_tensor(actual, dtype=torch.float64)
    expected = torch.as_tensor(expected, dtype=torch.float64).cpu()
    torch.testing.assert_close(
        actual, expected, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}"
    )


class Scale(torch.nn.Module):
    """An elementwise scale no engine has a rule for (autograd, then replay)."""

    def __init__(self, width: int):
        super().__init__()
        self.weight = torch.nn.Parameter(1 + 0.1 * torch.randn(width))

    def forward(self, x):
        return x * self.weight


def _ce(outputs, targets):
    return torch.nn.functional.cross_entropy(outputs, targets, reduction="none")


def plain_problem(device, model) -> Problem:
    """``model`` (not extended: ghost / autograd / replay) on ``device``, float64."""
    model = model.double().to(device)
    generator = torch.Generator().manual_seed(1)

    def make_batch(step):
        x = torch.randn(6, 5, generator=generator, dtype=torch.float64)
        y = torch.randint(0, 3, (6,), generator=generator)
        return x.to(device), y.to(device)

    return Problem(
        name="plain",
        model=model,
        loss_fn=torch.nn.CrossEntropyLoss(),
        individual_loss_fn=_ce,
        make_optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
        make_batch=make_batch,
        batch_size=6,
    )


def first_order(schedule):
    return [Q.GradNorm(schedule), Q.Variance(schedule), Q.NormTest(schedule)]


def check_first_order(problem, result):
    for step, out in result.output.items():
        rec = result.records[step]
        G = bf.individual_gradients(problem, rec.params, rec.x, rec.y)
        g = [gi.mean(0) for gi in G]
        close(out["GradNorm"], [x.norm() for x in g], f"GradNorm {step}")
        variance = [((gi - m) ** 2).flatten(1).sum(1).mean() for gi, m in zip(G, g)]
        close(out["Variance"], variance, f"Variance {step}")
        flat = torch.cat([gi.flatten(1) for gi in G], 1)
        n, mean = flat.shape[0], flat.mean(0)
        norm_test = (((flat - mean) ** 2).sum() / (n * (n - 1) * mean @ mean)).sqrt()
        close(out["NormTest"], norm_test, f"NormTest {step}")


@pytest.mark.parametrize("kind", ["backpack", "ghost", "autograd"])
def test_each_engine_on_the_device_equals_the_brute_force(device, kind):
    torch.manual_seed(0)
    if kind == "backpack":
        problem = make_problem("mlp", "ce", "sgd", device=device)
    else:
        layers = [torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3)]
        if kind == "autograd":
            layers.append(Scale(3))
        problem = plain_problem(device, torch.nn.Sequential(*layers))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CockpitWarning)
        result = run(problem, first_order(linear(1)), steps=STEPS)
    engines = {row.route.engine for row in result.cockpit.coverage().params}
    assert kind in engines, engines
    methods = {row.route.method for row in result.cockpit.coverage().params}
    if kind == "autograd":
        assert any("replay" in str(m).lower() for m in methods), methods
    check_first_order(problem, result)


def test_hess_max_ev_and_the_ggn_estimate_on_the_device(device):
    """Lanczos and the Monte-Carlo GGN draw on the model's device, values exact."""
    problem = make_problem("mlp", "ce", "sgd", device=device)
    every = linear(1)
    quantities = [Q.HessMaxEV(every), Q.HessTrace(every, curvature="diag_ggn_mc")]
    result = run(problem, quantities, steps=2)
    for step, out in result.output.items():
        rec = result.records[step]
        hessian = bf.hessian(problem, rec.params, rec.x, rec.y)
        close(out["HessMaxEV"], torch.linalg.eigvalsh(hessian)[-1], "HessMaxEV")
        exact = torch.diagonal(bf.ggn(problem, rec.params, rec.x, rec.y)).sum()
        estimate = sum(out["HessTrace"])
        assert 0 < estimate < 10 * float(exact), (estimate, float(exact))


def test_resume_on_the_device_equals_the_uninterrupted_run(device, tmp_path):
    every = linear(1)

    def quantities():
        return [Q.Loss(every), Q.GradNorm(every), Q.Alpha(every), Q.Distance(every)]

    def train(problem, cockpit, optimizer, steps):
        for step in steps:
            x, y = problem.make_batch(step)
            optimizer.zero_grad()
            out = problem.model(x)
            loss = problem.loss_fn(out, y)
            info = {"individual_losses": problem.individual_loss_fn(out, y)}
            info |= {"loss": loss, "optimizer": optimizer, "batch_size": len(y)}
            with cockpit(step, info=info):
                loss.backward()
            optimizer.step()

    whole = make_problem("mlp", "ce", "momentum", device=device)
    opt = whole.optimizer()
    cockpit = Cockpit(whole.params, quantities())
    train(whole, cockpit, opt, range(4))
    want = cockpit.history.to_dict()

    first = make_problem("mlp", "ce", "momentum", device=device)
    opt1 = first.optimizer()
    cockpit1 = Cockpit(first.params, quantities())
    train(first, cockpit1, opt1, range(2))
    path = tmp_path / "ckpt.pt"
    state = {"model": first.model.state_dict(), "optimizer": opt1.state_dict()}
    torch.save(state | {"cockpit": cockpit1.state_dict()}, path)

    second = make_problem("mlp", "ce", "momentum", device=device)
    for _ in range(2):  # the same batches from step 2 on
        second.make_batch(0)
    opt2 = second.optimizer()
    cockpit2 = Cockpit(second.params, quantities())
    state = torch.load(path)
    second.model.load_state_dict(state["model"])
    opt2.load_state_dict(state["optimizer"])
    cockpit2.load_state_dict(state["cockpit"])
    train(second, cockpit2, opt2, range(2, 4))
    got = cockpit2.history.to_dict()
    assert "Alpha" in want[2]  # (the last step's Alpha needs a step after it)
    for step in (2, 3):
        for key in ("Loss", "GradNorm", "Distance", "Alpha"):
            assert (key in got[step]) == (key in want[step]), (step, key)
            if key in want[step]:
                close(got[step][key], want[step][key], f"{key} {step}")


def test_the_dashboard_of_a_device_run(device, tmp_path):
    problem = make_problem("cnn", "ce", "sgd", device=device)
    result = run(problem, first_order(linear(1)) + [Q.Loss(linear(1))], steps=STEPS)
    log = tmp_path / "run.json"
    result.cockpit.write(str(log))
    history = History.from_json(str(log))
    assert sorted(history.steps) == list(range(STEPS))
    from cockpit import CockpitPlotter

    plotter = CockpitPlotter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plotter.plot(str(log), show_plot=False, save_plot=True, savedir=str(tmp_path))
    assert any(p.suffix == ".png" for p in tmp_path.iterdir())


def test_fp16_autocast_with_a_grad_scaler_on_the_device(device):
    """The CUDA fp16 loop: the scaled backward leaves gradient quantities missing
    with the fix; bf16 autocast gives every value, near the float64 brute force."""
    if torch.device(device).type == "cpu":
        pytest.skip("fp16 autocast with a GradScaler is a CUDA loop")
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(5, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3)
    ).to(device)
    x = torch.randn(8, 5, device=device)
    y = torch.randint(0, 3, (8,), device=device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cuda")
    cockpit = Cockpit(model.parameters(), [Q.Loss(linear(1)), Q.GradNorm(linear(1))])
    with torch.autocast("cuda", dtype=torch.float16):
        out = model(x)
        loss = torch.nn.functional.cross_entropy(out, y)
    with pytest.warns(CockpitWarning, match="Fix"):
        with cockpit(0, info={"loss": loss, "optimizer": opt}):
            scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    assert "GradNorm" in cockpit.history.to_dict()[0]["missing"]

    bf16 = Cockpit(model.parameters(), [Q.GradNorm(linear(1))])
    opt.zero_grad()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = torch.nn.functional.cross_entropy(model(x), y)
    with bf16(1, info={"loss": loss, "optimizer": opt}):
        loss.backward()
    twin = [p.detach().double().cpu().requires_grad_(True) for p in model.parameters()]
    w1, b1, w2, b2 = twin
    logits = torch.relu(x.double().cpu() @ w1.T + b1) @ w2.T + b2
    grads = torch.autograd.grad(
        torch.nn.functional.cross_entropy(logits, y.cpu()), twin
    )
    got = bf16.history.to_dict()[1]["GradNorm"]
    for value, grad in zip(got, grads):
        assert abs(value - float(grad.norm())) <= 0.05 * float(grad.norm())  # bf16


def test_random_draws_are_made_on_the_device(device):
    """Probes, Monte-Carlo labels and Lanczos starts come from generators on the
    parameters' device: no draw on the CPU copied over on a device step."""
    from cockpit.curvature.ggn import Head
    from cockpit.curvature.hutchinson import rademacher

    model = torch.nn.Linear(3, 2).to(device)
    cockpit = Cockpit(model.parameters(), [Q.HessMaxEV(linear(1))])
    generator = cockpit._router.generator
    assert generator.device.type == device.type
    assert rademacher(7, generator, torch.float32, device).device.type == device.type
    x, y = torch.randn(4, 3, device=device), torch.tensor([0, 1, 1, 0], device=device)
    loss = torch.nn.functional.cross_entropy(model(x), y)
    labels = Head(loss, list(model.parameters())).labels(5, generator)
    assert labels.device.type == device.type and labels.shape == (5, 4)
    start = Q.HessMaxEV(linear(1))._start_vector(0, 11, device)
    assert start.device.type == device.type and start.dtype == torch.float64
    cockpit.close()
