"""A torchvision that cannot load is named, with its fix, where an integration imports.

pip installs torchvision as BackPACK's dependency; PyPI's wheel does not load next
to the CPU torch (``RuntimeError: operator torchvision::nms does not exist``), and
Lightning (torchmetrics) and transformers import it. A fake ``torchvision`` package
whose import raises that error stands in for it.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cockpit.integrations._common import check_torchvision

ROOT = Path(__file__).resolve().parents[2]
BROKEN = 'raise RuntimeError("operator torchvision::nms does not exist")\n'
FIX = "-m pip uninstall -y torchvision"


def fake_torchvision(folder: Path, body: str = BROKEN) -> Path:
    """Write a ``torchvision`` package (version 0.28.0) whose import runs ``body``."""
    (folder / "torchvision").mkdir(parents=True)
    (folder / "torchvision" / "__init__.py").write_text(body)
    meta = folder / "torchvision-0.28.0.dist-info"
    meta.mkdir()
    (meta / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: torchvision\nVersion: 0.28.0\n"
    )
    return folder


@pytest.fixture
def on_path(tmp_path, monkeypatch):
    """Put a folder first on ``sys.path``; forget the torchvision imported from it."""

    def put(folder: Path) -> None:
        monkeypatch.syspath_prepend(str(folder))
        importlib.invalidate_caches()

    monkeypatch.delitem(sys.modules, "torchvision", raising=False)
    yield put
    sys.modules.pop("torchvision", None)
    importlib.invalidate_caches()


def test_a_broken_torchvision_raises_one_message_with_the_fix(tmp_path, on_path):
    on_path(fake_torchvision(tmp_path))
    with pytest.raises(ImportError) as caught:
        check_torchvision("cockpit.integrations.lightning", "Lightning")
    message = str(caught.value)
    assert message.startswith("cockpit.integrations.lightning cannot be used")
    assert "torchvision 0.28.0" in message and "operator torchvision::nms" in message
    assert message.endswith(f"Fix: {sys.executable} {FIX}")
    assert caught.value.name == "torchvision"
    assert caught.value.__suppress_context__  # one message, not a chain


def test_a_missing_blocked_or_working_torchvision_is_left_alone(
    tmp_path, on_path, monkeypatch
):
    if importlib.util.find_spec("torchvision") is None:
        assert check_torchvision("x", "y") is None  # not installed
    monkeypatch.setitem(sys.modules, "torchvision", None)
    assert check_torchvision("x", "y") is None  # blocked on purpose
    monkeypatch.delitem(sys.modules, "torchvision")
    on_path(fake_torchvision(tmp_path, body="WORKS = True\n"))
    assert check_torchvision("x", "y") is None
    assert sys.modules["torchvision"].WORKS


_IMPORT_EACH = """
import importlib, json, sys
said = {}
for module, name in [
    ("cockpit.integrations.lightning", "CockpitCallback"),
    ("cockpit.integrations.pytorch_lightning", "CockpitCallback"),
    ("cockpit.integrations.transformers", "CockpitTrainer"),
]:
    try:
        getattr(importlib.import_module(module), name)
    except Exception as error:
        said[module] = [type(error).__name__, str(error), error.__suppress_context__]
    else:
        said[module] = None
sys.modules["transformers"] = None  # not installed: its own error, not ours
try:
    importlib.import_module("cockpit.integrations.transformers")
except ImportError as error:
    said["without transformers"] = str(error)
print(json.dumps(said))
"""


def test_each_integration_names_the_fix_in_a_fresh_process(tmp_path):
    frameworks = ("lightning", "pytorch_lightning", "transformers")
    if any(importlib.util.find_spec(name) is None for name in frameworks):
        pytest.skip("needs lightning, pytorch_lightning and transformers")
    fake = fake_torchvision(tmp_path / "site")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(fake), str(ROOT)]))
    done = subprocess.run(
        [sys.executable, "-c", _IMPORT_EACH],
        capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    said = json.loads(done.stdout.splitlines()[-1])
    for module in (f"cockpit.integrations.{name}" for name in frameworks):
        kind, message, suppressed = said[module]
        assert kind == "ImportError" and suppressed, (module, message)
        assert message.startswith(f"{module} cannot be used"), message
        assert message.count("Fix:") == 1 and message.endswith(FIX), message
        assert "operator torchvision::nms does not exist" in message
    assert "cannot be used" not in said["without transformers"]


@pytest.mark.parametrize(
    "example, framework",
    [("lightning_digits", "lightning"), ("huggingface_tiny_bert", "transformers")],
)
def test_the_integration_examples_import_cockpit_before_their_framework(
    example, framework
):
    tree = ast.parse((ROOT / "examples" / f"{example}.py").read_text())
    imported = [
        node.module if isinstance(node, ast.ImportFrom) else node.names[0].name
        for node in tree.body
        if isinstance(node, (ast.Import, ast.ImportFrom))
    ]
    first_framework = next(
        i for i, name in enumerate(imported) if name.split(".")[0] == framework
    )
    assert imported.index(f"cockpit.integrations.{framework}") < first_framework
