"""The ``cockpit`` command line: demo, plot (also of a 1.0.2 log), timelapse."""

from __future__ import annotations

import json
import subprocess
import sys

import matplotlib.image
import pytest

from cockpit.cli import build_parser, main
from cockpit.history import History
from tests.test_plotting import reference_log, synthetic_history


@pytest.fixture
def reference_logpath(tmp_path):
    """A log as cockpit-for-pytorch 1.0.2 writes it, named without ``.json``."""
    path = tmp_path / "testproblem" / "SGD" / "run_0" / "log"
    path.parent.mkdir(parents=True)
    (tmp_path / "testproblem" / "SGD" / "run_0" / "log.json").write_text(
        json.dumps(reference_log(), indent=4, sort_keys=True)
    )
    return path


def test_plot_a_reference_log(reference_logpath, tmp_path, capsys):
    out = tmp_path / "pictures" / "out.png"
    assert main(["plot", str(reference_logpath), "-o", str(out)]) == 0
    assert matplotlib.image.imread(out).shape[:2] == (900, 1600)
    assert str(out) in capsys.readouterr().out


def test_plot_defaults_next_to_the_log_and_secondary(tmp_path):
    log = synthetic_history(8).write_json(tmp_path / "run.json")
    secondary = tmp_path / "second.png"
    code = main(["plot", log, "--secondary", str(secondary), "--discard", "4",
                 "--log-iter", "--title", "My run", "--dpi", "50"])  # fmt: skip
    assert code == 0
    assert matplotlib.image.imread(tmp_path / "run_dashboard.png").shape[:2] == (
        450,
        800,
    )
    assert secondary.exists()


def test_plot_a_missing_log_fails_with_a_message(tmp_path, capsys):
    assert main(["plot", str(tmp_path / "nothing.json")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("cockpit plot: error:") and "nothing.json" in err


def test_timelapse(tmp_path):
    from PIL import Image

    log = synthetic_history(6).write_json(tmp_path / "run.json")
    assert main(["timelapse", log, "--frames", "1", "-o", str(tmp_path / "a.gif")]) == 0
    with Image.open(tmp_path / "a.gif") as gif:
        assert gif.format == "GIF"
    assert main(["timelapse", log, "--frames", "0"]) == 1


def test_demo_writes_log_and_dashboard(tmp_path, capsys):
    out = tmp_path / "demo"
    code = main(["demo", "--out", str(out), "--steps", "3", "--no-progress"])
    assert code == 0
    history = History.from_json(out / "log.json")
    assert history.steps == [0, 1, 2]
    assert {"Alpha", "HessMaxEV", "GradHist2d", "learning_rate"} <= set(history.keys)
    assert matplotlib.image.imread(out / "dashboard.png").shape[:2] == (900, 1600)
    printed = capsys.readouterr().out
    assert "log.json" in printed and "dashboard.png" in printed


def test_demo_progress_bar_shows_loss_alpha_and_gradient_norm(tmp_path, capsys):
    from cockpit.demo import run_demo
    from cockpit.quantities import Alpha, GradNorm, Loss
    from cockpit.utils.schedules import linear

    every = linear(1)
    quantities = [Alpha(every), GradNorm(every), Loss(every)]
    run_demo(quantities, logpath=str(tmp_path / "log"), steps=3, progress=True)
    bar = capsys.readouterr().err.replace("\r", "\n").splitlines()[-1]
    assert "loss=" in bar and "alpha=" in bar and "|g|=" in bar


def test_demo_rejects_an_unknown_configuration(tmp_path, capsys):
    assert main(["demo", "--config", "luxury", "--out", str(tmp_path)]) == 1
    assert "luxury" in capsys.readouterr().err


def test_python_dash_m_runs_the_command_line(tmp_path):
    missing = str(tmp_path / "missing.json")
    done = subprocess.run(
        [sys.executable, "-m", "cockpit", "plot", missing],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 1
    assert done.stderr.startswith("cockpit plot: error:")


def test_parser_lists_the_three_commands():
    help_text = build_parser().format_help()
    assert all(command in help_text for command in ("demo", "plot", "timelapse"))
