"""The three extension points of docs/architecture.md, run from the page itself.

A toy engine registered from outside the package (it serves ``nn.Linear`` with
``torch.func``) takes those parameters without any edit of cockpit, and every
first-order quantity it feeds equals per-sample brute force (float64).
"""

import re
import warnings
from pathlib import Path

import pytest
import torch

from cockpit import quantities as Q
from cockpit.engines.base import engine_classes, unregister_engine
from cockpit.errors import CockpitWarning
from cockpit.utils.schedules import linear
from tests.utils.any_model import first_order_reference, make_any_problem, per_sample
from tests.utils.harness import run
from tests.utils.problems import make_problem

DOC = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"


def doc_blocks():
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)


def run_block(index):
    namespace = {}
    exec(compile(doc_blocks()[index], f"{DOC.name}[{index}]", "exec"), namespace)
    return namespace


@pytest.fixture
def func_linear():
    namespace = run_block(1)
    engine = namespace["FuncLinear"]
    try:
        yield engine
    finally:
        unregister_engine(engine)
    assert engine not in engine_classes()


def close(actual, expected, what):
    torch.testing.assert_close(
        torch.as_tensor(actual, dtype=torch.float64),
        torch.as_tensor(expected, dtype=torch.float64),
        rtol=1e-6,
        atol=1e-10,
        msg=lambda m: f"{what}: {m}",
    )


FIRST_ORDER = ["GradNorm", "Variance", "NormTest", "InnerTest", "OrthoTest"]


@pytest.mark.parametrize("arch", ["rmsnorm-mlp", "transformer"])
def test_a_registered_engine_serves_its_layers_exactly(func_linear, arch):
    problem = make_any_problem(arch)
    every = linear(1)
    quantities = [getattr(Q, name)(every) for name in FIRST_ORDER]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CockpitWarning)
        result = run(problem, quantities, steps=2)
    routes = [row.route for row in result.cockpit.coverage().params]
    linears = [
        i
        for i, p in enumerate(problem.params)
        if any(
            type(m) is torch.nn.Linear and any(p is q for q in m.parameters())
            for m in problem.model.modules()
        )
    ]
    assert linears and all(routes[i].engine == "torch.func" for i in linears)
    others = [r for i, r in enumerate(routes) if i not in linears]
    assert all(r.engine != "torch.func" for r in others)
    assert all(r.declines and r.declines[0].message for r in others)
    for step in range(2):
        G, _ = per_sample(problem, result.records[step])
        out, params = result.output[step], result.records[step].params
        for name in FIRST_ORDER:
            want = first_order_reference(name, G, params)
            if isinstance(want, list):
                want = torch.stack(want)
            close(out[name], want, f"{name} step {step}")


def test_without_the_engine_the_same_parameters_go_to_backpack(func_linear):
    unregister_engine(func_linear)
    problem = make_any_problem("rmsnorm-mlp")
    result = run(problem, [Q.GradNorm(linear(1))], steps=1)
    engines = {row.route.engine for row in result.cockpit.coverage().params}
    assert "torch.func" not in engines


def test_the_documented_quantity_and_output_run_in_a_loop():
    quantity_ns, output_ns = run_block(0), run_block(2)
    problem = make_problem("mlp", "ce", "sgd")
    quantity = quantity_ns["LargestSampleNorm"](linear(1))
    printer = output_ns["PrintNorms"]()
    optimizer = problem.optimizer()
    from cockpit import Cockpit

    cockpit = Cockpit(problem.params, [quantity, Q.GradNorm(linear(1))])
    cockpit.recorder.subscribe(printer)
    x, y = problem.make_batch(0)
    outputs = problem.model(x)
    losses = problem.individual_loss_fn(outputs, y)
    loss = problem.loss_fn(outputs, y)
    with cockpit(0, info={"batch_size": x.shape[0], "individual_losses": losses,
                          "loss": loss, "optimizer": optimizer}):  # fmt: skip
        loss.backward()
    rows = []
    for sample_loss in problem.individual_loss_fn(problem.model(x), y):
        grads = torch.autograd.grad(sample_loss, problem.params, retain_graph=True)
        rows.append(torch.cat([g.reshape(-1) for g in grads]))
    rows = torch.stack(rows)
    out = cockpit.get_output()[0]
    close(out["LargestSampleNorm"], rows.norm(dim=1).max(), "LargestSampleNorm")
    total = torch.stack([torch.as_tensor(v) for v in out["GradNorm"]]).norm()
    assert printer.lines == [f"step 0: |g| = {float(total):.4f}"]
