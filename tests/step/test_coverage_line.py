"""The one coverage line when tracking starts, seen without any logging set-up.

Issue 11 asks for "one line when tracking starts". A line at INFO of a logger that
nobody configured is never printed, so the ``cockpit`` logger brings a stderr handler
of its own that prints only while the program has configured no logging. Each case
runs in a fresh process, not in pytest's, which configures logging: one interpreter
imports torch and BackPACK (which configure no logging, as it checks) and forks a
child per case, which runs the case's code (or ``python -m cockpit demo``) as a new
program would, set-up first, then its imports.
"""

from __future__ import annotations

import textwrap
from types import SimpleNamespace

import pytest

from tests.utils.forked import run_forked

SCRIPT = textwrap.dedent(
    """
    import logging, sys
    {setup}
    import torch
    from backpack import extend
    from cockpit import Cockpit, quantities as Q

    torch.manual_seed(0)
    model = extend(torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)))
    loss_fn = extend(torch.nn.CrossEntropyLoss())
    cockpit = Cockpit(
        model.parameters(),
        quantities=[Q.GradNorm(lambda s: True), Q.Variance(lambda s: True)],
    )
    x, y = torch.randn(5, 4), torch.randint(0, 2, (5,))
    for step in range(3):
        out = model(x)
        loss = loss_fn(out, y)
        losses = torch.nn.functional.cross_entropy(out, y, reduction="none")
        info = {{"batch_size": 5, "individual_losses": losses, "loss": loss}}
        with cockpit(step, info=info):
            loss.backward()
    cockpit.write({log!r})
    print("done")
    """
)


#: Run by the interpreter that forks the cases, after importing torch and BackPACK.
UNCONFIGURED = textwrap.dedent(
    """
    import logging, sys

    assert not logging.root.handlers, logging.root.handlers
    assert not logging.root.manager.loggerDict.get("cockpit")
    assert not [name for name in sys.modules if name.split(".")[0] == "cockpit"]
    """
)

FORMATTED = "logging.basicConfig(format='LOGGED %(name)s | %(message)s')"
ABOVE_INFO = [
    "logging.getLogger('cockpit').setLevel(logging.WARNING)",
    "logging.basicConfig(); logging.getLogger('cockpit').setLevel(logging.ERROR)",
]
OTHER_HANDLERS = [
    # a handler of the user's own on the cockpit logger, none on the root
    "handler = logging.StreamHandler(); "
    "handler.setFormatter(logging.Formatter('LOGGED %(name)s | %(message)s')); "
    "logging.getLogger('cockpit').addHandler(handler)",
    # the root has a handler, but cockpit's records do not propagate to it
    "logging.basicConfig(format='ROOT %(message)s'); "
    "logging.getLogger('cockpit').propagate = False",
]
DEMO = "demo"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``{set-up (or DEMO): its run's returncode, stdout and stderr}``."""
    setups = ["", FORMATTED, *ABOVE_INFO, *OTHER_HANDLERS, DEMO]
    cases = []
    for i, setup in enumerate(setups):
        out = tmp_path_factory.mktemp(f"case{i}")
        if setup == DEMO:
            argv = ["demo", "--steps", "3", "--out", str(out / "demo")]
            cases.append({"module": "cockpit", "argv": argv})
        else:
            cases.append({"code": SCRIPT.format(setup=setup, log=str(out / "log"))})
    folder = tmp_path_factory.mktemp("outputs")
    results = run_forked(cases, folder, ["torch", "backpack"], UNCONFIGURED)
    return dict(zip(setups, results, strict=True))


def _run(runs, setup: str) -> SimpleNamespace:
    done = runs[setup]
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "done"
    return done


def _coverage_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "cockpit coverage at" in line]


def test_without_logging_set_up_the_line_is_printed_once(runs):
    done = _run(runs, "")
    lines = _coverage_lines(done.stderr)
    assert lines == [
        "cockpit coverage at step 0: per-sample results for 4 parameter tensors "
        "(4 from backpack); every quantity exact. See cockpit.coverage()."
    ], done.stderr
    assert "log written" not in done.stderr  # write() stays quiet (DEBUG)


def test_configured_logging_gets_the_line_once_in_its_own_format(runs):
    done = _run(runs, FORMATTED)
    lines = _coverage_lines(done.stderr)
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("LOGGED cockpit | cockpit coverage at step 0:")


@pytest.mark.parametrize("setup", ABOVE_INFO)
def test_a_level_above_info_silences_it(runs, setup):
    done = _run(runs, setup)
    assert _coverage_lines(done.stderr) == [], done.stderr


def test_the_demo_prints_it_once_above_its_progress_bar(runs):
    """The demo's progress bar takes the line over (tqdm's logging redirect), and
    the cockpit logger's own handler must not come back beside it (``python -m
    cockpit demo --steps 3``)."""
    done = runs[DEMO]
    assert done.returncode == 0, done.stderr
    lines = _coverage_lines(done.stderr)
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("cockpit coverage at step 0:")


@pytest.mark.parametrize("setup", OTHER_HANDLERS)
def test_other_handlers_on_the_way_are_respected(runs, setup):
    done = _run(runs, setup)
    lines = _coverage_lines(done.stderr)
    assert len(lines) == 1, done.stderr
    assert not lines[0].startswith("ROOT")
    if "LOGGED" in setup:
        assert lines[0].startswith("LOGGED cockpit | cockpit coverage at step 0:")
