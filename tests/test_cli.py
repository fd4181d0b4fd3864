"""The ``cockpit`` command line: demo, plot (also of a 1.0.2 log), timelapse."""

from __future__ import annotations

import json
import subprocess
import sys

import matplotlib.image
import numpy as np
import pytest

from cockpit.cli import build_parser, load_log, main
from cockpit.errors import LogFileError
from cockpit.history import History
from tests.plotting.test_plotting import reference_log, synthetic_history


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


def test_plot_a_log_named_without_suffix_next_to_a_folder_of_that_name(tmp_path):
    # 1.0.2's advanced example: log logfiles/run.json beside a folder logfiles/run/
    (tmp_path / "logfiles" / "run").mkdir(parents=True)
    synthetic_history(5).write_json(tmp_path / "logfiles" / "run.json", legacy=True)
    out = tmp_path / "dash.png"
    assert main(["plot", str(tmp_path / "logfiles" / "run"), "-o", str(out)]) == 0
    assert out.exists()


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
    with pytest.raises(SystemExit) as stopped:  # argparse: a bad option value
        main(["timelapse", log, "--frames", "0"])
    assert stopped.value.code == 2


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
    # an argparse choice (issue 42): exit code 2, as for any unparsed command line
    with pytest.raises(SystemExit) as done:
        main(["demo", "--config", "luxury", "--out", str(tmp_path)])
    assert done.value.code == 2
    assert "luxury" in capsys.readouterr().err


def _python_dash_m(*args: str) -> subprocess.CompletedProcess:
    """``python -m cockpit ARGS`` in a fresh process, its output captured."""
    return subprocess.run(
        [sys.executable, "-m", "cockpit", *args],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_python_dash_m_runs_the_command_line(tmp_path):
    missing = str(tmp_path / "missing.json")
    done = _python_dash_m("plot", missing)
    assert done.returncode == 1
    assert done.stderr.startswith("cockpit plot: error:")


def test_parser_lists_the_three_commands():
    help_text = build_parser().format_help()
    assert all(command in help_text for command in ("demo", "plot", "timelapse"))


# --- bad log files: one line on stderr, exit code 1, no traceback --------------------
def _write_bad_log(tmp_path, kind):
    """Write a log file of the given bad kind; return its path and a message part."""
    good = json.dumps(reference_log(), indent=4, sort_keys=True)
    path = tmp_path / f"{kind}.json"
    if kind == "missing":
        return path, "no such file"
    if kind == "missing-bare":
        return tmp_path / "run", "nor run.json or .jsonl"
    if kind == "empty":
        path.write_bytes(b"")
        return path, "is empty (0 bytes)"
    if kind == "whitespace":
        path.write_text("\n  \n")
        return path, "only whitespace"
    if kind == "truncated":
        path.write_text(good[: len(good) // 2])
        return path, "is truncated"
    if kind == "truncated-in-string":
        path.write_text(good[: good.index('"GradNorm"') + 4])
        return path, "is truncated"
    if kind == "png":
        path = tmp_path / "dashboard.png"
        matplotlib.image.imsave(path, np.zeros((8, 8)))
        return path, "is a PNG image"
    if kind == "json-list":
        path.write_text("[1, 2, 3]")
        return path, "holds a JSON list"
    if kind == "unrelated-json":
        path.write_text(json.dumps({"name": "my-package", "version": "1.0"}))
        return path, "has the key 'name'"
    if kind == "step-not-an-object":
        path.write_text(json.dumps({"0": 2.5}))
        return path, "holds a JSON number for step 0"
    if kind == "json-lines":
        path = tmp_path / "other.jsonl"
        path.write_text('{"a": 1}\n{"b": 2}\n')
        return path, "more than one JSON value"
    if kind == "no-steps":
        path.write_text("{}")
        return path, "holds no tracked step"
    if kind == "stream-without-steps":
        path = tmp_path / "run.jsonl"
        path.write_text('{"format":"cockpit-log-stream","version":1}\n')
        return path, "holds no tracked step"
    if kind == "newer-stream":
        path = tmp_path / "run.jsonl"
        path.write_text('{"format":"cockpit-log-stream","version":99}\n')
        return path, "stream format version 99"
    if kind == "folder":
        path = tmp_path / "logs"
        path.mkdir()
        return path, "is a folder"
    if kind == "values-not-an-object":
        path = tmp_path / "run.jsonl"
        path.write_text(
            '{"format":"cockpit-log-stream","version":1}\n{"step":0,"values":[1,2]}\n'
        )
        return path, "skipped line 2: its values are a JSON list, not an object"
    if kind == "torn-header":
        path = tmp_path / "run.jsonl"
        path.write_text('{"format":"cockpit-log-str')
        return path, "holds no readable tracked step: skipped the torn last record"
    if kind == "odd-values":  # valid JSON, step numbers, but not what cockpit writes
        path.write_text(json.dumps({"0": {"GradHist1d": {"hist": [1, 2]}}}))
        return path, "unexpected"
    raise AssertionError(kind)


BAD_KINDS = [
    "missing", "missing-bare", "empty", "whitespace", "truncated",
    "truncated-in-string", "png", "json-list", "unrelated-json", "step-not-an-object",
    "json-lines", "no-steps", "stream-without-steps", "newer-stream", "folder",
    "values-not-an-object", "torn-header", "odd-values",
]  # fmt: skip


@pytest.mark.parametrize("kind", BAD_KINDS)
@pytest.mark.parametrize("command", ["plot", "timelapse", "export", "report"])
def test_a_bad_log_gives_one_line_naming_file_and_problem(
    tmp_path, capsys, command, kind
):
    if command == "report" and kind == "odd-values":
        pytest.skip("the report reads no histograms")
    path, problem = _write_bad_log(tmp_path, kind)
    out = tmp_path / "out" / {"plot": "x.png", "timelapse": "x.gif"}.get(command, "tb")
    option = "--tensorboard" if command == "export" else "-o"
    output = [] if command == "report" else [option, str(out)]
    assert main([command, str(path), *output]) == 1
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith(f"cockpit {command}: error: {path}"), lines[0]
    assert problem in lines[0] and "Fix:" in lines[0], lines[0]
    assert "Traceback" not in captured.err and captured.out == ""
    assert not out.exists()


def test_load_log_returns_the_history_or_raises_log_file_error(tmp_path):
    written = synthetic_history(4).write_json(tmp_path / "run.json")
    assert load_log(tmp_path / "run").steps == [0, 1, 2, 3]
    assert load_log(written).keys == History.from_json(written).keys
    path, _ = _write_bad_log(tmp_path, "json-list")
    with pytest.raises(LogFileError) as caught:
        load_log(path)
    assert caught.value.path == str(path) and "JSON list" in caught.value.problem
    assert isinstance(caught.value, ValueError)  # what History.from_json raised before


def test_python_dash_m_reports_a_bad_log_without_traceback(tmp_path):
    path, _ = _write_bad_log(tmp_path, "png")
    done = _python_dash_m("plot", str(path))
    assert done.returncode == 1
    assert done.stderr.splitlines() == [done.stderr.strip()]  # one line
    assert done.stderr.startswith(f"cockpit plot: error: {path}: is a PNG image")
    assert "Traceback" not in done.stderr


def test_python_dash_m_folds_the_skipped_records_of_an_empty_log_into_one_line(
    tmp_path,
):
    path, problem = _write_bad_log(tmp_path, "values-not-an-object")
    done = _python_dash_m("plot", str(path))
    assert done.returncode == 1
    assert done.stderr.splitlines() == [done.stderr.strip()], done.stderr  # one line
    assert problem in done.stderr and "Fix:" in done.stderr


def test_python_dash_m_prints_a_warning_in_one_line(tmp_path):
    log = tmp_path / "run.jsonl"
    log.write_text(
        '{"format":"cockpit-log-stream","version":1}\n'
        '{"step":0,"values":{"Loss":1.0}}\n{"step":1,"values":{"Loss":0.5}}\n'
        '{"step":2,"values":{"Lo'
    )
    out = str(tmp_path / "a.png")
    done = _python_dash_m("plot", str(log), "-o", out)
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines() == [
        f"cockpit plot: warning: Skipped the torn last record (line 4) of the cockpit "
        f"log {str(log)!r}: the run stopped while writing it. Every earlier step is "
        "read."
    ]


@pytest.mark.parametrize(
    "argv, option",
    [
        (["plot", "LOG", "--dpi", "0"], "--dpi"),
        (["plot", "LOG", "--dpi", "-5"], "--dpi"),
        (["plot", "LOG", "--discard", "-5"], "--discard"),
        (["timelapse", "LOG", "--fps", "0"], "--fps"),
        (["timelapse", "LOG", "--fps", "-1"], "--fps"),
        (["timelapse", "LOG", "--frames", "0"], "--frames"),
        (["demo", "--steps", "0"], "--steps"),
        (["demo", "--steps", "-3"], "--steps"),
        (["demo", "--interval", "0"], "--interval"),
        (["demo", "--live", "-1"], "--live"),
        (["demo", "--steps", "ten"], "--steps"),
        (["plot", "LOG", "--dpi", "nan"], "--dpi"),
        (["plot", "LOG", "--dpi", "inf"], "--dpi"),
        (["timelapse", "LOG", "--fps", "nan"], "--fps"),
    ],
)
def test_a_bad_option_value_is_blamed_on_the_option_not_the_log(
    tmp_path, capsys, argv, option
):
    log = synthetic_history(3).write_json(tmp_path / "run.json")
    argv = [log if a == "LOG" else a for a in argv]
    with pytest.raises(SystemExit) as stopped:
        main([*argv, "-o" if argv[0] != "demo" else "--out", str(tmp_path / "o")])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {option}" in err and ("must be" in err or "expected" in err)
    assert "log" not in err.splitlines()[-1] and "Traceback" not in err
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.png").exists()


def test_plot_output_format_is_checked_and_a_bare_name_gets_png(tmp_path, capsys):
    log = synthetic_history(3).write_json(tmp_path / "run.json")
    assert main(["plot", log, "-o", str(tmp_path / "x.xyz")]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "x.xyz: matplotlib cannot write .xyz images" in err[0]
    assert "Fix: give -o a file ending in one of" in err[0] and ".png" in err[0]
    assert "unexpected" not in err[0] and not (tmp_path / "x.xyz").exists()
    assert main(["plot", log, "-o", str(tmp_path / "bare")]) == 0
    out = capsys.readouterr().out
    assert out.strip() == f"dashboard written to {tmp_path / 'bare.png'}"
    assert (tmp_path / "bare.png").is_file() and not (tmp_path / "bare").exists()


def test_timelapse_and_folder_outputs_are_checked_before_drawing(tmp_path, capsys):
    log = synthetic_history(3).write_json(tmp_path / "run.json")
    assert main(["timelapse", log, "--frames", "1", "-o", str(tmp_path / "anim")]) == 0
    assert capsys.readouterr().out.strip().endswith("anim.gif")
    assert (tmp_path / "anim.gif").is_file()
    for argv, problem in (
        (["timelapse", log, "-o", str(tmp_path / "a.xyz")], "cannot write .xyz"),
        (["plot", log, "-o", str(tmp_path) + "/"], "is a folder"),
        (["plot", log, "-o", str(tmp_path)], "is a folder"),
    ):
        assert main(argv) == 1
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and problem in err[0] and "Fix:" in err[0], err


def test_an_output_folder_that_is_a_file_gives_one_line_with_a_fix(tmp_path, capsys):
    log = synthetic_history(3).write_json(tmp_path / "run.json")
    (tmp_path / "afile").write_text("not a folder")
    assert main(["plot", log, "-o", str(tmp_path / "afile" / "x.png")]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and str(tmp_path / "afile") in err[0], err
    assert "Fix: choose an output path whose folders are not files" in err[0]


def test_report_warns_in_one_line_about_a_damaged_line_like_plot(tmp_path):
    log = tmp_path / "run.jsonl"
    log.write_text(
        '{"format":"cockpit-log-stream","version":1}\n'
        '{"step":0,"values":{"Loss":1.0}}\n{"step":1,"values":{"Loss":0.5}}\n'
        '{"step":2,"values":{"Lo'
    )
    done = _python_dash_m("report", str(log), "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["log"] == str(log)  # one JSON object on stdout
    warning = done.stderr.splitlines()
    assert len(warning) == 1 and warning[0].startswith("cockpit report: warning:")
    assert str(log) in warning[0] and "line 4" in warning[0], warning
