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

import json
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest

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


#: Runs each case of ``sys.argv[1]`` (JSON) in a child forked from this interpreter:
#: code as ``python -c`` runs it, or a module as ``python -m`` does, its output and
#: exit status going to files.
FORKING = textwrap.dedent(
    """
    import json, logging, os, runpy, sys, traceback

    import torch
    import backpack

    assert not logging.root.handlers, logging.root.handlers
    assert not logging.root.manager.loggerDict.get("cockpit")
    assert not [name for name in sys.modules if name.split(".")[0] == "cockpit"]

    def run(case):
        if "module" in case:
            sys.argv = [case["module"], *case["argv"]]
            runpy.run_module(case["module"], run_name="__main__", alter_sys=True)
        else:
            sys.argv = ["-c"]
            exec(compile(case["code"], "<string>", "exec"), {"__name__": "__main__"})

    for case in json.loads(sys.argv[1]):
        pid = os.fork()
        if pid:
            os.waitpid(pid, 0)
            continue
        for fd, name in ((1, "stdout"), (2, "stderr")):
            os.dup2(os.open(case[name], os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
        status = 0
        try:
            run(case)
        except SystemExit as stop:
            status = stop.code if isinstance(stop.code, int) else 0
            if stop.code is not None and not isinstance(stop.code, int):
                print(stop.code, file=sys.stderr)
                status = 1
        except BaseException:
            traceback.print_exc()
            status = 1
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        with open(case["status"], "w") as f:
            f.write(str(status))
        os._exit(status)
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
    cases = {}
    for i, setup in enumerate(["", FORMATTED, *ABOVE_INFO, *OTHER_HANDLERS, DEMO]):
        folder = tmp_path_factory.mktemp(f"case{i}")
        case = {name: str(folder / name) for name in ("stdout", "stderr", "status")}
        if setup == DEMO:
            case["module"] = "cockpit"
            case["argv"] = ["demo", "--steps", "3", "--out", str(folder / "demo")]
        else:
            case["code"] = SCRIPT.format(setup=setup, log=str(folder / "log"))
        cases[setup] = case
    done = subprocess.run(
        [sys.executable, "-c", FORKING, json.dumps(list(cases.values()))],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    results = {}
    for setup, case in cases.items():
        read = {}
        for name in ("stdout", "stderr", "status"):
            with open(case[name]) as f:  # no status: the child died
                read[name] = f.read()
        results[setup] = SimpleNamespace(
            returncode=int(read["status"]), stdout=read["stdout"], stderr=read["stderr"]
        )
    return results


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
