"""The any-model examples run at a tiny size and write a log and a dashboard."""

from __future__ import annotations

import warnings

import pytest

from cockpit.history import History
from tests.test_examples import assert_png, load_example


@pytest.mark.parametrize("name", ["char_transformer", "resnet_digits"])
def test_any_model_example_writes_log_dashboard_and_coverage(name, tmp_path):
    module = load_example(name)
    assert f"python examples/{name}.py" in module.__doc__
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Full backward hook is firing")
        paths = module.main(steps=2, out=str(tmp_path / name))
    assert_png(paths["dashboard"])
    history = History.from_json(paths["log"])
    assert history.steps == [0, 1]
    assert {"Alpha", "GradNorm", "HessTrace", "HessTrace_estimate"} <= set(history.keys)
    engine = "autograd" if name == "char_transformer" else "backpack"
    assert f"from {engine}" in paths["coverage"]
    assert "HessTrace estimated" in paths["coverage"]
