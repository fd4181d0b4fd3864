"""The command line's options: version, defaults, choices, notices, refusals.

Each test runs :func:`cockpit.cli.main` in-process (no training: the demo's
training is replaced where a test only checks what the command says).
"""

from __future__ import annotations

import subprocess
import warnings
from types import SimpleNamespace

import pytest

from cockpit import __version__
from cockpit.cli import CONFIGURATIONS, DEMO_FOLDER, build_parser, main
from cockpit.diagnosis import CHECK_IDS
from cockpit.errors import CockpitWarning
from tests.plotting.test_plotting import synthetic_history


@pytest.fixture
def log(tmp_path):
    return str(synthetic_history(6, 2).write_json(tmp_path / "run.json"))


def test_version(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"cockpit {__version__}"


def _subparsers():
    parser = build_parser()
    (sub,) = [a for a in parser._actions if a.dest == "command"]
    return parser, sub.choices


def test_every_help_shows_the_defaults():
    parser, commands = _subparsers()
    for name, command in [("cockpit", parser), *commands.items()]:
        text = command.format_help()
        for action in command._actions:
            shown = " ".join(text.split())
            if action.help and action.nargs != 0 and action.default not in (
                None, "==SUPPRESS=="
            ):  # fmt: skip
                assert f"default: {action.default})" in shown or (
                    "default" in action.help), (name, action.dest)  # fmt: skip
        assert "(default: None)" not in text and "(default: False)" not in text


def test_config_is_a_choice(capsys):
    _, commands = _subparsers()
    (config,) = [a for a in commands["demo"]._actions if a.dest == "config"]
    assert tuple(config.choices) == CONFIGURATIONS
    with pytest.raises(SystemExit) as done:
        main(["demo", "--config", "bogus"])
    assert done.value.code == 2 and "invalid choice: 'bogus'" in capsys.readouterr().err


def test_the_demo_folder_is_named_in_the_readme_and_ignored_by_git():
    root = subprocess.run(["git", "rev-parse", "--show-toplevel"], text=True,
                          capture_output=True, check=True).stdout.strip()  # fmt: skip
    with open(f"{root}/README.md", encoding="utf-8") as readme:
        assert f"{DEMO_FOLDER}/log.json" in readme.read()
    ignored = subprocess.run(["git", "check-ignore", "-q", f"{DEMO_FOLDER}/log.json"],
                             cwd=root)  # fmt: skip
    assert ignored.returncode == 0


def test_demo_live_without_a_display_says_so(monkeypatch, tmp_path, capsys):
    import cockpit.demo

    def run_demo(quantities, logpath, dashboard, live_every, **_):
        return SimpleNamespace(logpath=logpath + ".json", dashboard=dashboard)

    monkeypatch.setattr(cockpit.demo, "run_demo", run_demo)
    with pytest.warns(CockpitWarning, match="--live 5: no window can open here"):
        assert main(["demo", "--live", "5", "--out", str(tmp_path)]) == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no notice without --live
        assert main(["demo", "--out", str(tmp_path)]) == 0


def test_timelapse_to_a_still_image_is_refused_in_one_line(log, tmp_path, capsys):
    assert main(["timelapse", log, "-o", str(tmp_path / "x.png")]) == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "writes an animated GIF only, not .png" in line
    assert "Fix: give -o a file ending in .gif" in line and "cockpit plot" in line
    assert not (tmp_path / "x.png").exists()


def test_report_rejects_a_wrong_number_of_labels_like_plot(log, capsys):
    for command in ("plot", "report"):
        assert main([command, log, "--label", "a", "--label", "b"]) == 1
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert line.startswith(f"cockpit {command}: error: --label: 2 labels for 1")


def test_the_text_report_lists_the_checks_that_ran(tmp_path, capsys):
    log = synthetic_history(40, 2).write_json(tmp_path / "long.json")
    assert main(["report", str(log)]) == 0
    lines = capsys.readouterr().out.splitlines()
    missing = [line.split(":")[0].strip() for line in lines if ": needs " in line]
    assert "vanishing_gradients" in missing  # 2 tensors: not checked
    ran = [c for c in CHECK_IDS if c not in missing]
    assert lines[1] == f"Checks run: {', '.join(ran)}."
