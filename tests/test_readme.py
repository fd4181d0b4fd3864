"""README.md runs as written: every ```python block and every ```bash command.

The python blocks are executed in order in one namespace, in a temporary folder,
on a few small batches; the names a reader brings (their data, their Hugging Face
model) are supplied here, nothing else. The bash commands run where they stand in
the README, so a ``cockpit ...`` command reads the log a python block above wrote.
"""

from __future__ import annotations

import ast
import builtins
import re
import shlex
import warnings
from pathlib import Path

import torch

from cockpit.cli import main as cockpit_main
from tests.test_examples import load_example

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
FENCE = re.compile(r"^```(bash|python)\n(.*?)^```\n", re.MULTILINE | re.DOTALL)


def readme_blocks() -> list[tuple[str, str]]:
    """``(language, code)`` of every ```bash and ```python block, in order."""
    return FENCE.findall(README.read_text())


def commands(code: str) -> list[list[str]]:
    """The commands of a bash block, each split as the shell would (comments off)."""
    return [words for line in code.splitlines() if (words := shlex.split(line, True))]


def free_names(code: str) -> set[str]:
    """Names ``code`` reads without assigning or importing them itself."""
    tree = ast.parse(code)
    stored, loaded = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (loaded if isinstance(node.ctx, ast.Load) else stored).add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            stored |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return loaded - stored - set(dir(builtins))


# --- what the reader brings -----------------------------------------------------------
def _batches():
    """Three batches of 16 inputs of the loop's model (64 features, 10 classes)."""
    generator = torch.Generator().manual_seed(0)
    return [
        (torch.randn(16, 64, generator=generator),
         torch.randint(0, 10, (16,), generator=generator))
        for _ in range(3)
    ]  # fmt: skip


def _hugging_face(tmp_path: Path) -> dict:
    """``model``, ``args`` and ``data`` of the Hugging Face lines (no download)."""
    from transformers import TrainingArguments

    example = load_example("huggingface_tiny_bert")
    args = TrainingArguments(
        output_dir=str(tmp_path / "hf"), max_steps=1, report_to=[], use_cpu=True
    )
    return {"model": example.tiny_bert(), "args": args, "data": example.ContainsToken()}


#: Per name a reader brings, what supplies it (given the temporary folder).
BROUGHT = {
    "batches": lambda tmp_path: {"batches": _batches()},
    "model": _hugging_face,
    "args": _hugging_face,
    "data": _hugging_face,
}


# --- the bash commands ----------------------------------------------------------------
def run_command(words: list[str]) -> str:
    """Run one README command; return its program (``cockpit <command>``)."""
    if words[0] == "torchrun":
        # Two processes starting torch take ~30 s on a 2-core machine, so this one
        # is run by tests/distributed/test_ddp_example.py (the same options, with
        # --steps 3).
        *options, script = words[1:]
        assert (ROOT / script).is_file(), script
        ddp_test = (ROOT / "tests" / "distributed" / "test_ddp_example.py").read_text()
        assert all(option in ddp_test for option in options), words
        assert f'EXAMPLES / "{Path(script).name}"' in ddp_test, words
        return "torchrun"
    assert words[0] == "cockpit", f"README runs {words[0]!r}: teach this test to run it"
    if words[1] == "demo":  # the same command, 12 of its 200 steps (a minute each)
        words = [*words, "--steps", "12", "--no-progress"]
    assert cockpit_main(words[1:]) == 0, words
    for option in ("-o", "--tensorboard"):  # what the command writes
        if option in words:
            assert Path(words[words.index(option) + 1]).exists(), words
    return f"cockpit {words[1]}"


def test_the_two_set_up_commands_are_what_ci_runs():
    language, code = readme_blocks()[0]
    assert language == "bash"
    demo, tests = (line for line in code.splitlines() if line.startswith("python3"))
    assert demo.endswith("&& .venv/bin/cockpit demo")
    assert tests in (ROOT / ".ci" / "run").read_text()  # .ci/run is command 2
    for command in (demo, tests):
        assert ".venv/bin/pip install -c constraints.txt -e" in command
        assert "&& .venv/bin/pip uninstall -y torchvision &&" in command


def test_every_readme_block_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    blocks = readme_blocks()
    # The first block holds the two set-up commands (a virtual environment, pip
    # installing torch and BackPACK: minutes, and the network). The test above
    # checks that they are the ones CI (.ci/run) runs; they are not run here.
    assert blocks[0][0] == "bash" and "python3 -m venv" in blocks[0][1]
    namespace: dict = {"__name__": "readme"}
    ran = set()
    for language, code in blocks[1:]:
        if language == "bash":
            ran |= {run_command(words) for words in commands(code)}
            continue
        brought = {BROUGHT[name] for name in free_names(code) & BROUGHT.keys()}
        for supply in brought:
            namespace.update(supply(tmp_path))
        missing = free_names(code) - namespace.keys()
        assert not missing, f"a README block uses {missing} before they are defined"
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Full backward hook is firing")
            exec(compile(code, str(README), "exec"), namespace)
    commands_of_the_cli = {"plot", "timelapse", "report", "export"}
    assert {f"cockpit {c}" for c in commands_of_the_cli} <= ran  # all documented
    # what the python blocks say they write
    assert Path("logs/run.json").is_file()
    assert Path("plots/cockpit__primary.png").is_file()
    assert namespace["frame"].shape[0] == len(_batches())  # one row per step
