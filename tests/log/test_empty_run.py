"""A run that tracked no step is named as such, with its likely cause.

``Cockpit.write`` warns, and every command given the ``{}`` log it wrote exits with
one line; both say what most likely happened (the backward pass not wrapped in
``with cockpit(step, info=...)``, or schedules that never fire).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from backpack import extend

from cockpit import Cockpit
from cockpit.cli import main
from cockpit.errors import CockpitWarning
from cockpit.quantities import GradNorm, Loss
from cockpit.utils.schedules import linear

WRAP = "`with cockpit(step, info=...):`"


def _train(cockpit, model, wrapped: bool, steps: int = 2) -> None:
    loss_fn = extend(torch.nn.CrossEntropyLoss())
    generator = torch.Generator().manual_seed(0)
    for step in range(1, steps + 1):
        x = torch.randn(4, 3, generator=generator)
        y = torch.randint(0, 2, (4,), generator=generator)
        model.zero_grad()
        outputs = model(x)
        loss = loss_fn(outputs, y)
        losses = torch.nn.functional.cross_entropy(outputs, y, reduction="none")
        info = {"batch_size": 4, "individual_losses": losses, "loss": loss}
        if wrapped:
            with cockpit(step, info=info):
                loss.backward()
        else:
            loss.backward()


def _written_warnings(cockpit, path):
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        written = cockpit.write(path)
    return written, [w for w in said if issubclass(w.category, CockpitWarning)]


@pytest.mark.parametrize("wrapped", [False, True])
def test_write_of_a_run_without_a_tracked_step_warns_with_the_likely_cause(
    tmp_path, wrapped
):
    model = extend(torch.nn.Linear(3, 2))
    every_100 = linear(100)  # fires at step 0 only; the loop starts at 1
    cockpit = Cockpit(model.parameters(), [Loss(every_100), GradNorm(every_100)])
    _train(cockpit, model, wrapped)
    written, said = _written_warnings(cockpit, str(tmp_path / "run"))
    assert len(said) == 1
    message = str(said[0].message)
    assert message.startswith("Cockpit.write: the run tracked no step")
    assert written in message and WRAP in message and "Fix:" in message
    if wrapped:
        assert "the steps were wrapped, but no quantity's track_schedule" in message
    else:
        assert "no step was ever opened and closed" in message
    assert said[0].filename == __file__  # points at the user's write(), not cockpit
    assert (tmp_path / "run.json").read_text().strip() == "{}"


def test_write_of_a_tracked_run_says_nothing(tmp_path):
    model = extend(torch.nn.Linear(3, 2))
    cockpit = Cockpit(model.parameters(), [Loss(linear(1))])
    _train(cockpit, model, wrapped=True, steps=1)
    _, said = _written_warnings(cockpit, str(tmp_path / "run"))
    assert said == []


@pytest.mark.parametrize("command", ["plot", "timelapse", "export", "report"])
@pytest.mark.parametrize("content", ["{}", ""])
def test_every_command_names_an_empty_run_and_its_likely_cause(
    tmp_path, capsys, command, content
):
    log = tmp_path / "run.json"
    log.write_text(content)
    output = {
        "plot": ["-o", str(tmp_path / "x.png")],
        "timelapse": ["-o", str(tmp_path / "x.gif")],
        "export": ["--tensorboard", str(tmp_path / "tb")],
        "report": [],
    }[command]
    assert main([command, str(log), *output]) == 1
    captured = capsys.readouterr()
    (line,) = captured.err.splitlines()
    assert line.startswith(f"cockpit {command}: error: {log}: ")
    if content:
        assert "holds no tracked steps: its run tracked none" in line
    else:
        assert "is empty (0 bytes): the run has tracked no step yet" in line
    assert "Likely cause:" in line and WRAP in line and "track_schedule" in line
    assert captured.out == ""
