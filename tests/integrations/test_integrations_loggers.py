"""Every Lightning logger gets cockpit's values; the tracker extras stay optional.

Lightning's ``CSVLogger`` (a logger cockpit has no sink of its own for) receives
every tracked step through ``log_metrics``: its CSV holds each series step for step
as the cockpit's own history defines it (tests/utils/trackers.py). ``import
cockpit`` imports neither wandb nor mlflow, and a missing one is one line naming
the install command.
"""

from __future__ import annotations

import csv
import subprocess
import sys
import warnings

import pytest

from cockpit.errors import CockpitWarning
from tests.utils import expected_warnings as expected
from tests.utils.trackers import assert_same_series, expected_scalars, small_run

pytestmark = [expected.LIGHTNING_NO_VAL]


def _csv_series(path) -> dict[str, dict[int, float]]:
    found: dict[str, dict[int, float]] = {}
    with open(path, newline="") as file:
        for row in csv.DictReader(file):
            step = int(row["step"])
            for key, value in row.items():
                if key.startswith("cockpit/") and value != "":
                    series = found.setdefault(key, {})
                    assert series.get(step, float(value)) == float(value), (key, step)
                    series[step] = float(value)
    return found


def test_lightning_csv_logger_holds_every_series(tmp_path):
    pytest.importorskip("lightning.pytorch")
    from lightning.pytorch.loggers import CSVLogger

    from cockpit.integrations.lightning import CockpitCallback
    from cockpit.utils.configuration import configuration
    from tests.integrations.test_integrations_lightning import (
        Classifier,
        _loader,
        _net,
        _trainer,
    )

    logger = CSVLogger(str(tmp_path), name="csv")
    callback = CockpitCallback(quantities=configuration("economy"))
    trainer = _trainer(tmp_path, callback, logger=logger, max_epochs=2,
                       log_every_n_steps=1)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CockpitWarning)
        trainer.fit(Classifier(_net()), _loader())
    history = callback.cockpit.history
    assert history.steps == list(range(8))
    expected = expected_scalars(history, callback.cockpit.param_names)
    found = _csv_series(f"{logger.log_dir}/metrics.csv")
    assert_same_series(found, expected)
    assert set(found) == set(expected)  # nothing else under cockpit/


def test_loggers_false_sends_nothing(tmp_path):
    pytest.importorskip("lightning.pytorch")
    from lightning.pytorch.loggers import CSVLogger

    from cockpit.integrations.lightning import CockpitCallback
    from cockpit.utils.configuration import configuration
    from tests.integrations.test_integrations_lightning import (
        Classifier,
        _loader,
        _net,
        _trainer,
    )

    logger = CSVLogger(str(tmp_path), name="csv")
    callback = CockpitCallback(quantities=configuration("economy"), loggers=False)
    trainer = _trainer(tmp_path, callback, logger=logger, max_epochs=1,
                       log_every_n_steps=1)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CockpitWarning)
        trainer.fit(Classifier(_net()), _loader())
    with open(f"{logger.log_dir}/metrics.csv", newline="") as file:
        header = next(csv.reader(file))
    assert "train_loss" in header and not any(h.startswith("cockpit/") for h in header)


def test_import_cockpit_imports_no_tracker():
    code = (
        "import sys, cockpit, cockpit.integrations.wandb, cockpit.integrations.mlflow, "
        "cockpit.integrations.loggers; "
        "print(sorted(m for m in ('wandb', 'mlflow') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True,
                         text=True, check=True)  # fmt: skip
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("tracker", ["wandb", "mlflow"])
def test_a_missing_tracker_is_one_line_naming_the_install(tracker, monkeypatch):
    import importlib

    module = importlib.import_module(f"cockpit.integrations.{tracker}")
    monkeypatch.setitem(sys.modules, tracker, None)  # import fails as if missing
    cockpit = small_run(steps=1)
    with pytest.raises(ImportError) as caught:
        module.log_to(cockpit)
    message = str(caught.value)
    assert "\n" not in message
    assert f"pip install {tracker}" in message and f'".[{tracker}]"' in message
