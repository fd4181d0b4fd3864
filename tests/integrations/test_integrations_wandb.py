"""W&B (offline, no server): the run's own files hold what the cockpit logged.

Each path writes an offline run (``WANDB_MODE=offline``): the bare loop
(``cockpit.integrations.wandb.log_to``), Lightning's ``WandbLogger``, Hugging Face's
``report_to=["wandb"]`` and ``cockpit export --wandb``. The test reads the run's
transaction log (``run-<id>.wandb``, wandb's own protobuf records,
tests/utils/wandb_records.py) and compares every series, step for step, and the
histograms with the cockpit's own history of the same run.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest

from cockpit.diagnosis import Finding, diagnose, worst
from cockpit.errors import CockpitWarning
from cockpit.history import History
from tests.utils import expected_warnings as expected
from tests.utils import wandb_records
from tests.utils.lazy import module_or_skip
from tests.utils.trackers import assert_same_series, expected_scalars, small_run

pytestmark = [
    expected.MISSCALED_LOOKALIKE,
    expected.LIGHTNING_NO_VAL,
]

wandb = module_or_skip(
    "wandb", reason="wandb is not installed (cockpit's extra: .[wandb])"
)


@pytest.fixture(autouse=True)
def _offline(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DISABLE_GIT", "true")
    yield
    wandb.teardown()  # wandb reads the environment once per process set-up


def _series(rows, axis: str, prefix: str = "") -> dict[str, dict[int, float]]:
    """``{name: {step: value}}`` of the numbers of every row with the x-axis."""
    found: dict[str, dict[int, float]] = {}
    for row in rows:
        if axis not in row:
            continue
        step = int(row[axis])
        for key, value in row.items():
            if not key.startswith(prefix + "cockpit/") or key == axis:
                continue
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                series = found.setdefault(key[len(prefix) :], {})
                assert series.get(step, value) == value, (key, step)
                series[step] = float(value)
    return found


def _histograms(rows, axis: str, key: str, prefix: str = "") -> dict[int, dict]:
    return {
        int(r[axis]): r[prefix + key] for r in rows if axis in r and prefix + key in r
    }


def _check_histograms(rows, axis: str, history: History, prefix: str = "") -> None:
    """GradHist1d as the log's counts and edges; GradHist2d as its marginals."""
    one = _histograms(rows, axis, "cockpit/GradHist1d", prefix)
    gradient = _histograms(rows, axis, "cockpit/GradHist2d/gradient", prefix)
    steps = [s for s in history.steps if "GradHist1d" in history[s]]
    assert sorted(one) == steps
    assert sorted(gradient) == [s for s in steps if "GradHist2d" in history[s]]
    for step in steps:
        logged = history[step]["GradHist1d"]
        assert one[step]["_type"] == "histogram"
        assert one[step]["values"] == list(logged["hist"])
        assert np.allclose(one[step]["bins"], logged["edges"], rtol=0, atol=1e-12)
        if "GradHist2d" in history[step]:  # not in the economy configuration
            counts = np.asarray(history[step]["GradHist2d"]["hist"])
            assert gradient[step]["values"] == counts.sum(axis=1).tolist()


def _check_outputs(path: str, history: History, prefix: str = "") -> None:
    summary = wandb_records.summary(path)
    findings = diagnose(history)
    shown = [f for f in findings if f.severity != "info"]
    assert summary["cockpit/diagnosis"] == (worst(shown) or "ok")
    for finding in findings:
        assert summary[f"cockpit/diagnosis/{finding.id}"].startswith(finding.severity)
    assert summary[prefix + "cockpit/dashboard/_type"] == "image-file"
    assert summary[prefix + "cockpit/dashboard_html/_type"] == "html-file"
    artifacts = wandb_records.of_type(path, "artifact")  # also the charts' tables
    (artifact,) = [a for a in artifacts if a.type == "cockpit"]
    assert {e.path for e in artifact.manifest.contents} == {
        "dashboard.png", "dashboard.html", "cockpit_log.json",
    }  # fmt: skip


def test_a_bare_loop_logs_every_series_histogram_and_output(tmp_path):
    from cockpit.integrations.wandb import log_to

    run = wandb.init(project="cockpit-tests", dir=str(tmp_path))
    cockpit = small_run(steps=5, attach=lambda c: log_to(c, run))
    run.finish()
    path = wandb_records.run_file(str(tmp_path))
    rows = wandb_records.history_rows(path)
    expected = expected_scalars(cockpit.history, cockpit.param_names)
    assert_same_series(_series(rows, "cockpit/global_step"), expected)
    _check_histograms(rows, "cockpit/global_step", cockpit.history)
    _check_outputs(path, cockpit.history)


def test_error_findings_are_alerts_and_in_the_summary(tmp_path, monkeypatch):
    """Offline runs drop alerts, so the call is caught where it leaves cockpit."""
    from cockpit.integrations.wandb import WandbSink

    run = wandb.init(project="cockpit-tests", dir=str(tmp_path))
    alerts = []
    monkeypatch.setattr(run, "alert", lambda **kwargs: alerts.append(kwargs))
    error = Finding("nonfinite", "error", (3, 4), "The loss became NaN.", {}, "Lower")
    warning = Finding("loss_plateau", "warning", (0, 9), "Flat.", {}, "Wait")
    WandbSink(run).summary([error, warning])
    assert run.summary["cockpit/diagnosis"] == "error"
    assert run.summary["cockpit/diagnosis/loss_plateau"].startswith("warning")
    run.finish()
    (alert,) = alerts
    assert alert["title"] == "cockpit: nonfinite"
    assert alert["level"] == wandb.AlertLevel.ERROR and "Lower" in alert["text"]


def test_lightning_wandb_logger_gets_every_series(tmp_path):
    pytest.importorskip("lightning.pytorch")
    from lightning.pytorch.loggers import WandbLogger

    from cockpit.integrations.lightning import CockpitCallback
    from cockpit.utils.configuration import configuration
    from tests.integrations.test_integrations_lightning import (
        Classifier,
        _loader,
        _net,
        _trainer,
    )

    logger = WandbLogger(project="cockpit-tests", save_dir=str(tmp_path), offline=True)
    callback = CockpitCallback(quantities=configuration("economy"))
    trainer = _trainer(tmp_path, callback, logger=logger, max_epochs=1,
                       log_every_n_steps=1)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CockpitWarning)
        trainer.fit(Classifier(_net()), _loader())
    wandb.finish()
    history = callback.cockpit.history
    path = wandb_records.run_file(str(tmp_path))
    rows = wandb_records.history_rows(path)
    expected = expected_scalars(history, callback.cockpit.param_names)
    assert_same_series(_series(rows, "trainer/global_step"), expected)
    _check_histograms(rows, "trainer/global_step", history)
    _check_outputs(path, history)
    assert any("train_loss" in row for row in rows)  # the module's own value


def test_huggingface_report_to_wandb_gets_every_series(tmp_path):
    pytest.importorskip("transformers")
    from cockpit.utils.configuration import configuration
    from tests.integrations.test_integrations_transformers import _fit

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CockpitWarning)
        trainer = _fit(tmp_path, configuration("economy"), max_steps=3,
                       report_to=["wandb"], logging_strategy="steps",
                       logging_steps=1)  # fmt: skip
    wandb.finish()  # the callback leaves its run open
    history = trainer.cockpit.history
    path = wandb_records.run_file(str(tmp_path))
    rows = wandb_records.history_rows(path)
    expected = expected_scalars(history, trainer.cockpit.param_names)
    # the callback puts train/ in front of every name it is given
    found = _series(rows, "train/global_step", prefix="train/")
    assert_same_series(found, expected)
    _check_histograms(rows, "train/global_step", history)
    _check_outputs(path, history)


def test_export_sends_a_log_written_earlier(tmp_path, capsys):
    from cockpit.cli import main

    cockpit = small_run(steps=3)
    log = cockpit.write(str(tmp_path / "earlier"))
    names = ",".join(cockpit.param_names)
    assert main(["export", log, "--wandb", "cockpit-tests", "--param-names",
                 names]) == 0  # fmt: skip
    assert "3 steps sent to W&B run" in capsys.readouterr().out
    path = wandb_records.run_file(str(tmp_path))
    rows = wandb_records.history_rows(path)
    history = History.from_json(log)
    expected = expected_scalars(history, cockpit.param_names)
    assert_same_series(_series(rows, "cockpit/global_step"), expected)
    _check_histograms(rows, "cockpit/global_step", history)
    _check_outputs(path, history)
    assert not math.isnan(expected["cockpit/Loss"][0])
