"""MLflow: a real tracking server receives what the cockpit logged, step for step.

One ``mlflow server`` (SQLite backend, local artifact store behind its proxy, a free
port on localhost) serves the module; each path logs a short run to it: the bare
loop (``cockpit.integrations.mlflow.log_to``), Lightning's ``MLFlowLogger``,
Hugging Face's ``report_to=["mlflow"]`` and ``cockpit export --mlflow``. Every
metric series is read back through ``MlflowClient`` and compared with the series
the cockpit's own history of the same run defines (tests/utils/trackers.py).
"""

from __future__ import annotations

import json
import os
import warnings

import pytest

from cockpit.diagnosis import diagnose, worst
from cockpit.errors import CockpitWarning
from cockpit.history import History
from tests.utils.lazy import module_or_skip
from tests.utils.trackers import assert_same_series, expected_scalars, small_run

mlflow = module_or_skip(
    "mlflow", reason="mlflow is not installed (cockpit's extra: .[mlflow])"
)
from tests.utils import expected_warnings as expected  # noqa: E402
from tests.utils.mlflow_server import mlflow_server  # noqa: E402

pytestmark = [
    expected.MISSCALED_LOOKALIKE,
    expected.LIGHTNING_NO_VAL,
]

ARTIFACTS = {"dashboard.png", "dashboard.html", "cockpit_log.json", "diagnosis.json"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The tracking server's URI (one server for the module)."""
    with mlflow_server(str(tmp_path_factory.mktemp("mlflow"))) as uri:
        yield uri


def _series(client, run_id: str, names) -> dict[str, dict[int, float]]:
    found = {}
    for name in names:
        history = client.get_metric_history(run_id, name)
        steps = [m.step for m in history]
        assert len(steps) == len(set(steps)), f"{name} sent twice at a step: {steps}"
        found[name] = {m.step: m.value for m in history}
    return found


def _check_run(client, run_id: str, history: History, names, tmp_path) -> None:
    """Every series, the artifacts (the log equals the history) and the tags."""
    expected = expected_scalars(history, names)
    assert_same_series(_series(client, run_id, expected), expected)
    listed = client.list_artifacts(run_id, "cockpit")
    listed = {os.path.basename(a.path) for a in listed}
    assert ARTIFACTS <= listed
    local = client.download_artifacts(run_id, "cockpit", str(tmp_path))
    assert History.from_json(os.path.join(local, "cockpit_log.json")).to_dict() == (
        history.to_dict()
    )
    with open(os.path.join(local, "dashboard.png"), "rb") as image:
        assert image.read(8) == b"\x89PNG\r\n\x1a\n"
    with open(os.path.join(local, "dashboard.html"), encoding="utf-8") as page:
        assert "<html" in page.read(2000).lower()
    findings = diagnose(history)
    with open(os.path.join(local, "diagnosis.json"), encoding="utf-8") as file:
        sent = json.load(file)["findings"]
    assert [f["id"] for f in sent] == [f.id for f in findings]
    tags = client.get_run(run_id).data.tags
    shown = [f for f in findings if f.severity != "info"]
    assert tags["cockpit.diagnosis"] == (worst(shown) or "ok")
    for finding in findings:
        assert tags[f"cockpit.diagnosis.{finding.id}"].startswith(finding.severity)


def test_a_bare_loop_logs_every_series_and_the_outputs(server, tmp_path):
    from cockpit.integrations.mlflow import log_to

    client = mlflow.MlflowClient(server)
    experiment = client.create_experiment("bare-loop")
    run = client.create_run(experiment)
    cockpit = small_run(
        steps=5, attach=lambda c: log_to(c, run.info.run_id, tracking_uri=server)
    )
    assert cockpit.attached.steps == 5
    _check_run(client, run.info.run_id, cockpit.history, cockpit.param_names,
               tmp_path)  # fmt: skip


def test_lightning_mlflow_logger_gets_every_series(server, tmp_path):
    pl = pytest.importorskip("lightning.pytorch")
    from lightning.pytorch.loggers import MLFlowLogger

    from cockpit.integrations.lightning import CockpitCallback
    from cockpit.utils.configuration import configuration
    from tests.integrations.test_integrations_lightning import (
        Classifier,
        _loader,
        _net,
        _trainer,
    )

    logger = MLFlowLogger(experiment_name="lightning", tracking_uri=server)
    # (a logger with a remote store has no log_dir: the log would go to the cwd)
    logpath = str(tmp_path / "cockpit.jsonl")
    callback = CockpitCallback(quantities=configuration("economy"), logpath=logpath)
    trainer = _trainer(tmp_path, callback, logger=logger, max_epochs=1,
                       log_every_n_steps=1)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CockpitWarning)
        trainer.fit(Classifier(_net()), _loader())
    assert isinstance(trainer, pl.Trainer)
    history = callback.cockpit.history
    assert history.steps == [0, 1, 2, 3]
    client = mlflow.MlflowClient(server)
    _check_run(client, logger.run_id, history, callback.cockpit.param_names,
               tmp_path)  # fmt: skip
    assert "train_loss" in client.get_run(logger.run_id).data.metrics  # same run


def test_huggingface_report_to_mlflow_gets_every_series(server, tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    from cockpit.utils.configuration import configuration
    from tests.integrations.test_integrations_transformers import _fit

    monkeypatch.setenv("MLFLOW_TRACKING_URI", server)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "huggingface")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CockpitWarning)
        trainer = _fit(tmp_path, configuration("economy"), max_steps=3,
                       report_to=["mlflow"], logging_strategy="steps",
                       logging_steps=1)  # fmt: skip
    history = trainer.cockpit.history
    assert history.steps == [0, 1, 2]
    client = mlflow.MlflowClient(server)
    experiment = client.get_experiment_by_name("huggingface")
    (run,) = client.search_runs([experiment.experiment_id])
    _check_run(client, run.info.run_id, history, trainer.cockpit.param_names,
               tmp_path)  # fmt: skip
    assert "loss" in run.data.metrics  # the Trainer's own value, same run


def test_export_sends_a_log_written_earlier(server, tmp_path, capsys):
    from cockpit.cli import main

    cockpit = small_run(steps=3)
    log = cockpit.write(str(tmp_path / "earlier"))
    names = ",".join(cockpit.param_names)
    assert main(["export", log, "--mlflow", server, "--experiment", "exported",
                 "--param-names", names]) == 0  # fmt: skip
    assert "3 steps sent to MLflow run" in capsys.readouterr().out
    client = mlflow.MlflowClient(server)
    experiment = client.get_experiment_by_name("exported")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "earlier" and run.info.status == "FINISHED"
    _check_run(client, run.info.run_id, History.from_json(log), cockpit.param_names,
               tmp_path)  # fmt: skip
