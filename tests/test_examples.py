"""Every example of ``examples/`` (written for the dashboard) runs at a tiny size."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import matplotlib.image
import pytest

from cockpit.history import History

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def load_example(name: str):
    """Import ``examples/<name>.py`` as a module (the folder is not a package)."""
    spec = importlib.util.spec_from_file_location(
        f"example_{name}", EXAMPLES / f"{name}.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def assert_png(path, min_size=(200, 300)):
    image = matplotlib.image.imread(path)
    assert image.shape[0] >= min_size[0] and image.shape[1] >= min_size[1]


def test_quickstart(tmp_path):
    paths = load_example("quickstart").main(steps=4, out=str(tmp_path / "quick"))
    assert paths["dashboard"] == str(tmp_path / "quick" / "dashboard.png")
    assert_png(paths["dashboard"])
    history = History.from_json(paths["log"])
    assert history.steps == [0, 1, 2, 3]
    assert {"Alpha", "GradNorm", "Loss", "learning_rate"} <= set(history.keys)


def test_loss_is_not_enough_separates_alpha(tmp_path):
    out = tmp_path / "loss.png"
    alphas = load_example("loss_is_not_enough").main(steps=10, out=str(out))
    assert_png(out)
    constant, decaying = alphas.values()
    assert constant > 0.3 and decaying < -0.3


def test_misscaled_data_piles_up_at_the_edges(tmp_path):
    out = tmp_path / "misscaled.png"
    shares = load_example("misscaled_data").main(steps=1, out=str(out))
    assert_png(out)
    scaled, raw = shares.values()
    assert scaled < 0.001 and raw > 0.05


def test_vanishing_gradients_in_early_sigmoid_layers(tmp_path):
    out = tmp_path / "vanishing.png"
    spreads = load_example("vanishing_gradients").main(steps=1, out=str(out))
    assert_png(out)
    relu, sigmoid = spreads["ReLU"], spreads["sigmoid"]
    assert len(relu) == len(sigmoid) == 6
    assert sigmoid[0] < relu[0] / 5  # the first sigmoid layer barely gets a gradient
    assert sigmoid[-1] > sigmoid[0] * 5  # ... while the last one does


@pytest.mark.parametrize(
    "name",
    ["quickstart", "loss_is_not_enough", "misscaled_data", "vanishing_gradients"],
)
def test_example_documents_how_to_run_it(name):
    module = load_example(name)
    assert f"python examples/{name}.py" in module.__doc__
    assert callable(module.main)
