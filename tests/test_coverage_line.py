"""The one coverage line when tracking starts, seen without any logging set-up.

Issue 11 asks for "one line when tracking starts". A line at INFO of a logger that
nobody configured is never printed, so the ``cockpit`` logger brings a stderr handler
of its own that prints only while the program has configured no logging. Each case
runs in a fresh interpreter: pytest configures logging in its own process.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

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


def _run(tmp_path, setup: str) -> subprocess.CompletedProcess:
    code = SCRIPT.format(setup=setup, log=str(tmp_path / "log"))
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "done"
    return done


def _coverage_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "cockpit coverage at" in line]


def test_without_logging_set_up_the_line_is_printed_once(tmp_path):
    done = _run(tmp_path, "")
    lines = _coverage_lines(done.stderr)
    assert lines == [
        "cockpit coverage at step 0: per-sample results for 4 parameter tensors "
        "(4 from backpack); every quantity exact. See cockpit.coverage()."
    ], done.stderr
    assert "log written" not in done.stderr  # write() stays quiet (DEBUG)


def test_configured_logging_gets_the_line_once_in_its_own_format(tmp_path):
    setup = "logging.basicConfig(format='LOGGED %(name)s | %(message)s')"
    done = _run(tmp_path, setup)
    lines = _coverage_lines(done.stderr)
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("LOGGED cockpit | cockpit coverage at step 0:")


@pytest.mark.parametrize(
    "setup",
    [
        "logging.getLogger('cockpit').setLevel(logging.WARNING)",
        "logging.basicConfig(); logging.getLogger('cockpit').setLevel(logging.ERROR)",
    ],
)
def test_a_level_above_info_silences_it(tmp_path, setup):
    done = _run(tmp_path, setup)
    assert _coverage_lines(done.stderr) == [], done.stderr


def test_the_demo_prints_it_once_above_its_progress_bar(tmp_path):
    """The demo's progress bar takes the line over (tqdm's logging redirect), and
    the cockpit logger's own handler must not come back beside it."""
    done = subprocess.run(
        [sys.executable, "-m", "cockpit", "demo", "--steps", "3", "--out",
         str(tmp_path / "demo")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = _coverage_lines(done.stderr)
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("cockpit coverage at step 0:")


@pytest.mark.parametrize(
    "setup",
    [
        # a handler of the user's own on the cockpit logger, none on the root
        "handler = logging.StreamHandler(); "
        "handler.setFormatter(logging.Formatter('LOGGED %(name)s | %(message)s')); "
        "logging.getLogger('cockpit').addHandler(handler)",
        # the root has a handler, but cockpit's records do not propagate to it
        "logging.basicConfig(format='ROOT %(message)s'); "
        "logging.getLogger('cockpit').propagate = False",
    ],
)
def test_other_handlers_on_the_way_are_respected(tmp_path, setup):
    done = _run(tmp_path, setup)
    lines = _coverage_lines(done.stderr)
    assert len(lines) == 1, done.stderr
    assert not lines[0].startswith("ROOT")
    if "LOGGED" in setup:
        assert lines[0].startswith("LOGGED cockpit | cockpit coverage at step 0:")
