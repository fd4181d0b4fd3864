"""`cockpit report`: text, Markdown and JSON of one diagnosis; CLI errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from cockpit.cli import main
from cockpit.diagnosis import Finding
from cockpit.diagnosis.report import render_json, render_markdown, render_text
from cockpit.history import History

FINDINGS = [
    Finding(
        "nonfinite",
        "error",
        (26, 149),
        "The loss became NaN at step 26.",
        {"first_nonfinite_step": 26, "what": ["loss"], "learning_rate": 3.0},
        "Lower the learning rate.",
    ),
    Finding(
        "loss_plateau",
        "info",
        (70, 149),
        "The loss may have converged.",
        {"improvement_second_half": 0.01, "threshold": 0.05},
        "Decay the learning rate.",
    ),
    Finding(
        "not_checked",
        "info",
        (0, 149),
        "Not checked, for lack of data: inputs_misscaled (needs GradHist1d).",
        {"checks": {"inputs_misscaled": "GradHist1d"}},
        "Track the economy configuration.",
    ),
]


def write_log(path, n=40, lr_too_large=False) -> str:
    """A log whose Alpha says the steps overshoot (or not)."""
    data = {}
    for t in range(n):
        data[t] = {"Loss": 2.0 - 0.02 * t, "Alpha": 1.5 if lr_too_large else -0.2}
    return History(data).write_json(path)


def test_the_three_renderings_show_the_same_records():
    text = render_text(FINDINGS, "run.json")
    markdown = render_markdown(FINDINGS, "run.json")
    data = json.loads(render_json(FINDINGS, "run.json"))
    assert text.startswith("cockpit report for run.json: 1 error, 0 warnings, 1 info")
    assert "ERROR nonfinite (steps 26-149)" in text and "INFO loss_plateau" in text
    assert "first_nonfinite_step=26" in text and "advice: Lower" in text
    assert "inputs_misscaled: needs GradHist1d" in text
    assert markdown.startswith("# cockpit report: `run.json`")
    assert "| error | `nonfinite` | steps 26-149 |" in markdown
    assert "## error: `nonfinite` (steps 26-149)" in markdown
    assert "- `first_nonfinite_step`: 26" in markdown
    assert "## Not checked" in markdown
    assert data["log"] == "run.json"
    assert [f["id"] for f in data["findings"]] == [f.id for f in FINDINGS]
    assert data["findings"][0] == FINDINGS[0].to_dict()
    assert data["counts"] == {"error": 1, "warning": 0, "info": 1}
    assert data["not_checked"] == {"inputs_misscaled": "GradHist1d"}


def test_a_healthy_report_says_so():
    assert "No problems found" in render_text([])
    assert "No problems found" in render_markdown([])
    assert json.loads(render_json([]))["findings"] == []


@pytest.mark.parametrize("flag", ["--json", "--markdown", None])
def test_report_command(tmp_path, capsys, flag):
    log = write_log(tmp_path / "run.json", lr_too_large=True)
    assert main(["report", log] + ([flag] if flag else [])) == 0
    out = capsys.readouterr().out
    if flag == "--json":
        data = json.loads(out)  # exactly one JSON object: json.loads rejects more
        assert isinstance(data, dict)
        ids = {f["id"]: f["severity"] for f in data["findings"]}
        assert ids["step_size_too_large"] == "warning"
        finding = next(f for f in data["findings"] if f["id"] == "step_size_too_large")
        assert set(finding) == {
            "id", "severity", "steps", "message", "evidence", "advice"
        }  # fmt: skip
        assert finding["steps"] == [0, 39]
        assert "UpdateSize" in data["not_checked"]["step_size_too_small"]
    elif flag == "--markdown":
        assert "| warning | `step_size_too_large` |" in out
    else:
        assert "WARNING step_size_too_large" in out


def test_fail_on_sets_the_exit_code(tmp_path, capsys):
    bad = write_log(tmp_path / "bad.json", lr_too_large=True)
    good = write_log(tmp_path / "good.json")
    assert main(["report", bad, "--fail-on", "warning"]) == 2
    assert main(["report", bad, "--fail-on", "error"]) == 0
    assert main(["report", good, "--fail-on", "warning"]) == 0


@pytest.mark.parametrize(
    "content, problem",
    [
        (None, "no such file"),
        ("", "empty"),
        ('{"0": {"Loss": 1.0', "is truncated"),
        ("[1, 2, 3]", "JSON list"),
        ('{"zero": {"Loss": 1.0}}', "key 'zero'"),
        ("{}", "holds no tracked step"),
    ],
)
def test_unusable_logs_fail_with_one_line(tmp_path, capsys, content, problem):
    path = tmp_path / "run.json"
    if content is not None:
        path.write_text(content)
    assert main(["report", str(path)]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("cockpit report: error:")
    assert "run.json" in lines[0] and problem in lines[0]
    assert "Fix:" in lines[0]


def test_the_installed_command_prints_no_traceback(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "cockpit", "report", str(tmp_path / "missing.json")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert "missing.json" in result.stderr


def test_a_reference_log_is_reported(tmp_path, capsys):
    from tests.plotting.test_plotting import reference_log

    path = tmp_path / "log.json"
    path.write_text(json.dumps(reference_log(), indent=4, sort_keys=True))
    assert main(["report", str(tmp_path / "log"), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert "inputs_misscaled" in {f["id"] for f in data["findings"]}
    assert "Alpha" in data["not_checked"]["step_size_too_large"]  # 4 steps only
