"""The integration examples run as scripts in the environment the docs' install makes.

README command 2 (and so CI) installs the integrations with the line of
docs/integrations.md; these tests run ``examples/lightning_digits.py`` and
``examples/huggingface_tiny_bert.py`` as a user does, each in a process of its own
(``python examples/<name>.py``, the integration imported before the framework), so
an install that leaves a broken environment (a torchvision that cannot load, a
missing extra) fails here with the script's own error. Both processes are forked
from one interpreter that imported only torch and BackPACK
(:func:`tests.utils.forked.run_forked`): neither framework is imported before the
script imports it.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

from cockpit.cli import main as cockpit_main
from cockpit.history import History
from tests.test_examples import assert_png
from tests.utils.forked import run_forked

ROOT = Path(__file__).resolve().parents[2]
#: What the extras of the docs' install line bring, by the import name.
DOCUMENTED = (
    "lightning", "transformers", "accelerate", "tensorboard", "sklearn",
    "mlflow", "wandb",
)  # fmt: skip


def test_the_documented_extras_are_installed():
    """The suite runs where the docs' install line ran: none of it may be missing
    (a missing one would quietly skip the integration tests)."""
    missing = [name for name in DOCUMENTED if importlib.util.find_spec(name) is None]
    assert not missing, (
        f"{missing} not installed: the tests run in the environment of README "
        "command 2, which installs the integrations as docs/integrations.md says: "
        ".venv/bin/pip install -c constraints.txt -e "
        '".[demo,lightning,transformers,mlflow,wandb]" '
        "&& .venv/bin/pip uninstall -y torchvision"
    )


#: The examples run as scripts, with their ``--steps``.
SCRIPTS = {"lightning_digits": 4, "huggingface_tiny_bert": 3}


@pytest.fixture(scope="module")
def scripts(tmp_path_factory) -> dict:
    """``{name: result}`` (returncode, stdout, stderr) of ``python
    examples/<name>.py --steps N --out FOLDER`` run from the repository root, each
    in a process of its own."""
    folders = {name: tmp_path_factory.mktemp(name) / "out" for name in SCRIPTS}
    cases = []
    for name, steps in SCRIPTS.items():
        script = ROOT / "examples" / f"{name}.py"
        # run as its docstring says to run it
        assert f"python examples/{name}.py" in script.read_text()
        argv = ["--steps", str(steps), "--out", str(folders[name])]
        cases.append({"path": str(script), "argv": argv, "cwd": str(ROOT)})
    outputs = tmp_path_factory.mktemp("outputs")
    results = run_forked(cases, outputs, ["torch", "torch._dynamo", "backpack"])
    return dict(zip(SCRIPTS, results, strict=True))


def run_example(scripts: dict, name: str) -> dict[str, str]:
    """What ``python examples/<name>.py`` printed (it must have succeeded)."""
    proc = scripts[name]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    printed = dict(
        line.split(": ", 1) for line in proc.stdout.splitlines() if ": " in line
    )
    assert_png(printed["dashboard"])
    return printed


def test_the_lightning_example_runs_as_a_script(scripts, capsys):
    printed = run_example(scripts, "lightning_digits")
    history = History.from_json(printed["log"])
    assert history.steps == [0, 1, 2, 3]
    assert {"Alpha", "GradHist1d", "learning_rate", "valid_accuracy"} <= set(
        history.keys
    )
    valid_loss, valid_accuracy = history[3]["valid_loss"], history[3]["valid_accuracy"]
    assert math.isfinite(valid_loss) and valid_loss > 0  # a cross-entropy
    assert 0.0 <= valid_accuracy <= 1.0
    # `cockpit report` reads the log the callback streamed
    capsys.readouterr()
    assert cockpit_main(["report", printed["log"]]) == 0
    assert capsys.readouterr().out.strip()
    assert cockpit_main(["report", printed["log"], "--json"]) == 0
    report = json.loads(capsys.readouterr().out)  # one JSON object, nothing else
    assert isinstance(report, dict) and isinstance(report["findings"], list)


def test_the_huggingface_example_runs_as_a_script(scripts):
    printed = run_example(scripts, "huggingface_tiny_bert")
    history = History.from_json(printed["log"])
    assert history.steps == [0, 1, 2]
    assert {"GradNorm", "learning_rate", "Alpha"} <= set(history.keys)
    # every parameter the optimizer updates is tracked: Alpha has its values
    assert "Alpha" in history[0] or "max_grad_norm" in history[0]["missing"]["Alpha"]
