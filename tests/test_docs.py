"""Every code block of docs/*.md runs as written, or is checked where it cannot run.

As for the README (tests/test_readme.py): the ```python blocks of a page run in
order in one namespace, in a temporary folder, on a few small batches; the bash
commands run where they stand. What a reader brings (their model, data, optimizer,
a trained run) is supplied here, per page and block, and nothing else; names the
README's loop imports (``Cockpit``, ``configuration``, ``torch``) are in scope.

Commands that take minutes or other processes are checked, not run: ``torchrun``
and the scripts that tests already run are checked against those tests (the same
script, options it accepts), ``python -m benchmarks.X`` against the module, install
lines against the install rules (and .ci/run), ``tensorboard`` against the installed
program. A block meant as an illustration says so right above it, with the reason,
in an HTML comment ``<!-- not run: ... -->``; there are few.
"""

from __future__ import annotations

import ast
import configparser
import importlib.util
import json
import re
import shlex
import sys
import warnings
from pathlib import Path
from typing import Callable

import pytest
import torch
from backpack import extend

from cockpit import Cockpit
from cockpit.cli import main as cockpit_main
from cockpit.utils.configuration import configuration
from cockpit.utils.schedules import linear
from tests.test_readme import free_names as names_read
from tests.utils import expected_warnings as expected

pytestmark = [expected.ALPHA_ACCUMULATION]

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
FENCE = re.compile(
    r"^(?:<!-- not run: (?P<why>.+?) -->\n)?```(?P<lang>[^\n`]*)\n(?P<code>.*?)^```\n",
    re.MULTILINE | re.DOTALL,
)
#: What the README's loop imports: in scope on every page.
COMMON = {"Cockpit": Cockpit, "configuration": configuration, "torch": torch}
#: Most blocks a page may mark as not run, over all pages.
MOST_NOT_RUN = 3


def blocks(page: Path) -> list[tuple[str, str, str | None]]:
    """``(language, code, why not run)`` of every fenced block of ``page``."""
    return [
        (m["lang"].strip(), m["code"], m["why"])
        for m in FENCE.finditer(page.read_text())
    ]


def free_names(code: str) -> set[str]:
    """Names ``code`` reads without defining them (functions' own names too)."""
    defined = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.arg):
            defined.add(node.arg)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.Lambda)):
            defined.add(getattr(node, "name", ""))
    return names_read(code) - defined


# --- what a reader brings ---------------------------------------------------------
def _mlp():
    torch.manual_seed(0)
    return extend(
        torch.nn.Sequential(
            torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3)
        )
    )


def _train(cockpit: Cockpit, model, opt, steps: range) -> None:
    """The reader's loop (the README's), on a few random batches."""
    loss_fn = extend(torch.nn.CrossEntropyLoss())
    individual = torch.nn.CrossEntropyLoss(reduction="none")
    generator = torch.Generator().manual_seed(steps.start)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Full backward hook is firing")
        for step in steps:
            x = torch.randn(8, 6, generator=generator)
            y = torch.randint(0, 3, (8,), generator=generator)
            opt.zero_grad()
            out = model(x)
            loss = loss_fn(out, y)
            info = {"batch_size": 8, "loss": loss, "optimizer": opt,
                    "individual_losses": individual(out, y)}  # fmt: skip
            with cockpit(step, info=info):
                loss.backward()
            opt.step()


def _a_run(path: str, steps: int = 4) -> None:
    """A short healthy run of the economy configuration, logged to ``path``."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    cockpit = Cockpit(model.parameters(), configuration("economy"), logpath=path)
    _train(cockpit, model, opt, range(steps))
    cockpit.close()


def _model_and_optimizer(ns: dict) -> None:
    ns["model"] = _mlp()
    ns["opt"] = torch.optim.SGD(ns["model"].parameters(), lr=0.05)
    ns["quantities"] = configuration("economy")


def _hugging_face(ns: dict) -> None:
    from tests.test_readme import _hugging_face as readme_hf

    supplied = readme_hf(Path.cwd())
    ns.update(model=supplied["model"], args=supplied["args"], train=supplied["data"])


def _lightning(ns: dict) -> None:
    import lightning.pytorch as pl

    ns["Trainer"] = pl.Trainer


def _a_cockpit_with_alpha(ns: dict) -> None:
    """A cockpit that tracked steps 0 and 1 (Alpha's value of step 1 pending)."""
    from cockpit.quantities import Alpha, Loss

    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ns["cockpit"] = Cockpit(model.parameters(), [Loss(linear(1)), Alpha(linear(1))])
    _train(ns["cockpit"], model, opt, range(2))
    ns["step"] = 1


def _trains_the_cockpit(ns: dict) -> None:
    """The reader's training between the lines (three steps)."""
    _train(ns["cockpit"], ns["model"], ns["opt"], range(3))


def _a_new_process(ns: dict) -> None:
    """The checkpoint is resumed "in a new process": the old cockpit is gone."""
    ns.pop("cockpit").close()


#: page -> what runs before its first block.
SETUP: dict[str, Callable[[dict], None]] = {
    "diagnosis.md": lambda ns: _a_run("runs/log.json"),
}
#: (page, index of the python block) -> what runs before it.
BEFORE: dict[tuple[str, int], Callable[[dict], None]] = {
    ("any_model.md", 0): lambda ns: ns.update(model=_mlp()),
    ("integrations.md", 0): lambda ns: _a_run("logs/run"),
    ("integrations.md", 1): _lightning,
    ("integrations.md", 2): _hugging_face,
    ("integrations.md", 3): _a_cockpit_with_alpha,
    ("robust_runs.md", 0): _model_and_optimizer,
    ("robust_runs.md", 2): _a_new_process,
}
#: (page, index of the python block) -> what runs after it.
AFTER: dict[tuple[str, int], Callable[[dict], None]] = {
    ("robust_runs.md", 0): _trains_the_cockpit,
}
#: Pages whose python blocks another test runs from the page itself.
RUN_ELSEWHERE = {"architecture.md": ROOT / "tests" / "test_extension_points.py"}


# --- commands -----------------------------------------------------------------------
def command_lines(code: str) -> list[tuple[list[str], str]]:
    """``(words, line)`` of each command of a bash block (comments off, ``&&``
    separating commands)."""
    commands = []
    for line in code.splitlines():
        command: list[str] = []
        for word in [*shlex.split(line, comments=True), "&&"]:
            if word == "&&":
                if command:
                    commands.append((command, line))
                command = []
            else:
                command.append(word)
    return commands


def _program_words(words: list[str]) -> list[str]:
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):  # VAR=value prefixes
        words = words[1:]
    return words


def _script_options_exist(script: Path, words: list[str]) -> None:
    """Every ``--option`` is declared by the script or a module next to it."""
    source = "".join(p.read_text() for p in script.parent.glob("*.py"))
    for word in words:
        if word.startswith("--"):
            assert f'"{word.split("=")[0]}"' in source, (script, word)


def check_command(command: list[str], line: str, page: str) -> str:
    """Run or check one command; return what kind it was."""
    words = _program_words(command)
    program = Path(words[0]).name
    if program == "cockpit":
        assert cockpit_main(words[1:]) == 0, (page, command)
        for option in ("-o", "--tensorboard"):
            if option in words:
                assert Path(words[words.index(option) + 1]).exists(), command
        return f"cockpit {words[1]}"
    if program == "pip":
        if words[1] == "install":  # the install rules of README.md
            assert "-c" in words and "constraints.txt" in words, (page, line)
            assert "uninstall -y torchvision" in line, (page, line)
        return "pip"
    if program == "torchrun":
        script = next(w for w in words if w.endswith(".py"))
        ddp_test = (ROOT / "tests" / "distributed" / "test_ddp_example.py").read_text()
        assert f'EXAMPLES / "{Path(script).name}"' in ddp_test, command
        assert "--nproc_per_node=2" in words and '"--nproc_per_node=2"' in ddp_test
        _script_options_exist(ROOT / script, words[words.index(script) + 1 :])
        return "torchrun"
    if program == "tensorboard":  # a server: installed, not started
        assert (Path(sys.executable).parent / "tensorboard").exists()
        return "tensorboard"
    assert program == "python", f"{page} runs {program!r}: teach this test to check it"
    if words[1] == "-m":
        assert words[2].startswith("benchmarks."), command
        spec = importlib.util.find_spec(words[2])
        assert spec is not None, command
        _script_options_exist(Path(spec.origin), words[3:])
        return "benchmark"
    script = ROOT / words[1]
    assert script.is_file(), command
    _script_options_exist(script, words[2:])
    runner = {
        "ddp.py": ("distributed/test_ddp_example.py", 'load_example("ddp").main('),
        "fsdp.py": ("distributed/test_fsdp_example.py", 'EXAMPLES / "fsdp.py"'),
        "advanced.py": ("test_compat_102.py", '"advanced": '),
    }[script.name]
    assert runner[1] in (ROOT / "tests" / runner[0]).read_text(), command
    return f"python {script.name}"


# --- the pages ----------------------------------------------------------------------
@pytest.mark.parametrize("page", sorted(p.name for p in DOCS.glob("*.md")))
def test_every_block_of_the_page_runs(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": page, **COMMON}
    if page in SETUP:
        SETUP[page](namespace)
    python = 0
    for language, code, why in blocks(DOCS / page):
        if why is not None or language not in ("python", "bash"):
            continue
        if language == "bash":
            for command, line in command_lines(code):
                check_command(command, line, page)
            continue
        key, python = (page, python), python + 1
        if page in RUN_ELSEWHERE:
            assert f"run_block({key[1]})" in RUN_ELSEWHERE[page].read_text(), key
            continue
        if key in BEFORE:
            BEFORE[key](namespace)
        missing = free_names(code) - namespace.keys()
        assert not missing, f"{page}: a block uses {missing} before they are defined"
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Full backward hook is firing")
            exec(compile(code, f"{DOCS / page} block {key[1]}", "exec"), namespace)
        if key in AFTER:
            AFTER[key](namespace)


def test_few_blocks_are_illustrations_and_each_says_why():
    marked = [
        (page.name, why)
        for page in DOCS.glob("*.md")
        for _, _, why in blocks(page)
        if why is not None
    ]
    assert len(marked) <= MOST_NOT_RUN, marked
    assert all(len(why) > 20 for _, why in marked), marked
    # every fence is parsed (an unclosed or odd fence would hide blocks)
    for page in DOCS.glob("*.md"):
        fences = sum(line.startswith("```") for line in page.read_text().splitlines())
        assert fences == 2 * len(blocks(page)), page.name


def test_the_json_of_the_report_is_what_report_json_prints(tmp_path, capsys):
    """docs/diagnosis.md's JSON example has the keys ``cockpit report --json`` has."""
    ((_, example, _),) = [b for b in blocks(DOCS / "diagnosis.md") if b[0] == "json"]
    documented = json.loads(example)
    log = str(tmp_path / "run")
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=8.0)  # far too large: findings
    cockpit = Cockpit(model.parameters(), configuration("economy"), logpath=log)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _train(cockpit, model, opt, range(12))
    cockpit.close()
    capsys.readouterr()
    cockpit_main(["report", log + ".jsonl", "--json"])
    printed = json.loads(capsys.readouterr().out)
    assert printed["findings"]
    assert set(documented) == set(printed)
    assert set(documented["findings"][0]) == set(printed["findings"][0])
    assert set(documented["counts"]) == set(printed["counts"])


def test_the_integrations_install_line_is_what_ci_installs():
    ((_, code, _),) = [
        b for b in blocks(DOCS / "integrations.md") if b[0] == "bash" and "pip" in b[1]
    ]
    (line,) = [line for line in code.splitlines() if "pip install" in line]
    assert line.strip() in (ROOT / ".ci" / "run").read_text()
    # pip only warns about an extra that does not exist: each must be in setup.cfg
    extras = configparser.ConfigParser()
    extras.read(ROOT / "setup.cfg")
    (named,) = re.findall(r'"\.\[([a-z,]+)\]"', line)
    assert set(named.split(",")) <= set(extras["options.extras_require"]), named
