"""Long work shows progress on a terminal and nothing elsewhere (logs, tests).

``cockpit timelapse`` counts its frames, and every example that runs longer than a
few seconds shows a bar: its own tqdm (``disable=None``: on a terminal only) or its
framework's, switched on where stderr is a terminal.
"""

from __future__ import annotations

import ast
import io
import sys

import pytest

from cockpit.cli import main
from tests.plotting.test_plotting import synthetic_history
from tests.test_examples import EXAMPLES, load_example


class Terminal(io.StringIO):
    """A stderr that says it is a terminal."""

    def isatty(self) -> bool:
        return True


def test_the_timelapse_command_counts_its_frames_on_a_terminal_only(
    tmp_path, capsys, monkeypatch
):
    log = synthetic_history(4).write_json(tmp_path / "run.json")

    def timelapse(*options: str) -> None:
        out = str(tmp_path / "run.gif")
        assert main(["timelapse", log, "--frames", "1", "-o", out, *options]) == 0

    timelapse()  # pytest's stderr is no terminal: no bar
    captured = capsys.readouterr()
    assert captured.err == "" and captured.out.startswith("timelapse written to")
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    timelapse()
    bar = terminal.getvalue().replace("\r", "\n").strip().splitlines()[-1]
    assert bar.startswith("cockpit timelapse: 100%") and "1/1" in bar and "frame" in bar
    said = terminal.getvalue()
    timelapse("--no-progress")
    assert terminal.getvalue() == said


def test_an_example_shows_its_bar_on_a_terminal(tmp_path, monkeypatch):
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    load_example("quickstart").main(steps=2, out=str(tmp_path))
    bar = terminal.getvalue().replace("\r", "\n")
    assert "quickstart: 100%" in bar and "2/2" in bar


#: Every example that runs longer than a few seconds at its defaults, and how it
#: shows progress (the others run in a few seconds: custom_quantity,
#: loss_is_not_enough, misscaled_data, vanishing_gradients, fsdp: 10 steps).
LONG = {
    "quickstart": "tqdm",
    "resnet_digits": "tqdm",
    "char_transformer": "tqdm",
    "ddp": "tqdm",
    "lightning_digits": "enable_progress_bar",
    "huggingface_tiny_bert": "disable_tqdm",
    "bert_docstrings": "tqdm",
}


def _keywords(name: str) -> dict[str, str]:
    """``{keyword: source of its value}`` of every call in ``examples/<name>.py``."""
    source = (EXAMPLES / f"{name}.py").read_text()
    return {
        keyword.arg: ast.unparse(keyword.value)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call)
        for keyword in node.keywords
        if keyword.arg
    }


@pytest.mark.parametrize("name", sorted(LONG))
def test_every_long_example_shows_progress_on_a_terminal_only(name):
    keywords = _keywords(name)
    if LONG[name] == "tqdm":  # a terminal only; ddp: rank 0 only
        assert keywords["disable"] in ("None", "True if rank else None")
    elif LONG[name] == "enable_progress_bar":
        assert keywords["enable_progress_bar"] == "sys.stderr.isatty()"
    else:
        assert keywords["disable_tqdm"] == "not sys.stderr.isatty()"


def test_the_long_examples_are_all_the_examples_but_the_short_ones():
    short = {"custom_quantity", "loss_is_not_enough", "misscaled_data",
             "vanishing_gradients", "fsdp"}  # fmt: skip
    assert {path.stem for path in EXAMPLES.glob("*.py")} == set(LONG) | short
