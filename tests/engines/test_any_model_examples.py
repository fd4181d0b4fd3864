"""The any-model examples run at a tiny size and write a log and a dashboard."""

from __future__ import annotations

import warnings

import pytest

from cockpit.history import History
from tests.test_examples import assert_png, load_example
from tests.utils import expected_warnings as expected

pytestmark = [expected.GGN_FOR_HESSIAN]

CASES = {
    "char_transformer": (
        "char_transformer",
        {},
        "5 from autograd, 11 from backpack, 1 from ghost",
    ),
    # BatchNorm in train mode: the convolutions before one go to autograd
    "resnet_digits": ("resnet_digits", {}, "12 from autograd, 4 from backpack"),
    "resnet_digits-group": ("resnet_digits", {"norm": "group"}, "16 from backpack"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_any_model_example_writes_log_dashboard_and_coverage(case, tmp_path):
    name, kwargs, engines = CASES[case]
    module = load_example(name)
    assert f"python examples/{name}.py" in module.__doc__
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Full backward hook is firing")
        warnings.filterwarnings("ignore", ".*sit before batch norms")
        paths = module.main(steps=2, out=str(tmp_path / case), **kwargs)
    assert_png(paths["dashboard"])
    history = History.from_json(paths["log"])
    assert history.steps == [0, 1]
    assert {"Alpha", "GradNorm", "HessTrace", "HessTrace_estimate"} <= set(history.keys)
    assert "missing" not in history.keys
    assert f"({engines})" in paths["coverage"]
    assert "HessTrace estimated" in paths["coverage"]
