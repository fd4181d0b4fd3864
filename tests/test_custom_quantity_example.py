"""The documented custom-quantity example computes what its docstring says."""

import importlib.util
from pathlib import Path

import torch

from cockpit.utils.schedules import linear
from tests.utils import brute_force as bf
from tests.utils.harness import run
from tests.utils.problems import make_problem

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "custom_quantity.py"


def load_example():
    spec = importlib.util.spec_from_file_location("custom_quantity", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_max_sample_grad_norm_matches_brute_force():
    example = load_example()
    for arch, loss in [("mlp", "ce"), ("cnn", "mse")]:
        problem = make_problem(arch, loss)
        result = run(problem, [example.MaxSampleGradNorm(linear(1))], steps=3)
        for step, rec in result.records.items():
            per_sample = bf.individual_gradients(problem, rec.params, rec.x, rec.y)
            norms = torch.stack([g.flatten(1).pow(2).sum(1) for g in per_sample]).sum(0)
            expected = norms.max().sqrt().item()
            actual = result.output[step]["MaxSampleGradNorm"]
            assert abs(actual - expected) <= 1e-9 * expected, (actual, expected)


def test_example_main_runs():
    output = load_example().main(steps=6)
    assert sorted(output) == [0, 5]
    assert all(v["MaxSampleGradNorm"] > 0 for v in output.values())
