"""CockpitCallback for the standalone ``pytorch_lightning`` package.

The same callback as ``cockpit.integrations.lightning``'s, built on
``pytorch_lightning.Callback``: a real ``pytorch_lightning.Trainer.fit`` logs what
the plain loop logs (the Lightning test's check), and each package's callback given
to the other package's ``Trainer`` fails at setup naming the right import.
"""

from __future__ import annotations

import importlib.util
import sys

import pytest

from cockpit.history import History
from cockpit.utils.configuration import configuration

pytorch_lightning = pytest.importorskip("pytorch_lightning")
from cockpit.integrations.pytorch_lightning import CockpitCallback  # noqa: E402
from tests.integrations.test_integrations_lightning import (  # noqa: E402  (needs lightning too)
    BATCHES,
    Classifier,
    ClassifierSteps,
    _loader,
    _net,
    _trainer,
    check_fit_logs_what_the_plain_loop_logs,
)
from tests.utils import expected_warnings as expected  # noqa: E402

pytestmark = [
    expected.TIC_HESSIAN_NOT_POSITIVE,
    expected.LIGHTNING_NO_VAL,
    *expected.LIGHTNING_SHORT_RUNS,
]


class PLClassifier(ClassifierSteps, pytorch_lightning.LightningModule):
    """The Lightning test's module on pytorch_lightning's LightningModule."""


def test_the_callback_is_pytorch_lightnings():
    assert issubclass(CockpitCallback, pytorch_lightning.Callback)
    assert CockpitCallback.__module__ == "cockpit.integrations.pytorch_lightning"
    assert CockpitCallback().state_key == "CockpitCallback"  # as in checkpoints


def test_fit_logs_what_the_plain_loop_logs(tmp_path):
    check_fit_logs_what_the_plain_loop_logs(
        tmp_path, CockpitCallback, PLClassifier, pytorch_lightning
    )


def test_tensorboard_logger_gets_the_export(tmp_path):
    pytest.importorskip("tensorboard")
    from pytorch_lightning.loggers import TensorBoardLogger

    logger = TensorBoardLogger(str(tmp_path), name="runs")
    callback = CockpitCallback(quantities=configuration("economy"))
    trainer = _trainer(
        tmp_path, callback, pytorch_lightning, logger=logger, max_epochs=1
    )
    trainer.fit(PLClassifier(_net()), _loader())
    assert callback.cockpit.logpath == f"{logger.log_dir}/cockpit.jsonl"
    assert History.from_json(callback.cockpit.logpath).steps == list(range(BATCHES))
    assert list((tmp_path / "runs").rglob("events.out.tfevents.*"))


def test_ddp_strategies_are_accepted(tmp_path):
    for strategy in ("ddp", "ddp_spawn"):
        callback = CockpitCallback()
        trainer = _trainer(
            tmp_path, callback, pytorch_lightning, strategy=strategy, devices=2
        )
        callback.setup(trainer, PLClassifier(_net()), "fit")


def test_the_other_packages_callback_fails_naming_the_right_import(tmp_path):
    """Without the check, a lightning.pytorch callback in a pytorch_lightning trainer
    failed as if SingleDeviceStrategy were not supported (its strategy classes are
    pytorch_lightning's)."""
    import lightning.pytorch as lightning_pytorch

    from cockpit.integrations import lightning as cockpit_lightning

    runs = [
        (cockpit_lightning.CockpitCallback, PLClassifier, pytorch_lightning,
         "from cockpit.integrations.pytorch_lightning import CockpitCallback"),
        (CockpitCallback, Classifier, lightning_pytorch,
         "from cockpit.integrations.lightning import CockpitCallback"),
    ]  # fmt: skip
    for callback_class, module, package, fix in runs:
        trainer = _trainer(tmp_path, callback_class(), package, max_epochs=1)
        with pytest.raises(TypeError, match="separate packages") as error:
            trainer.fit(module(_net()), _loader())
        assert str(error.value).endswith(f"Fix: {fix}.")


def _fresh(module: str):
    """Run a module's source as a new module (the imported one stays as it is)."""
    spec = importlib.util.find_spec(module)
    fresh = importlib.util.module_from_spec(
        importlib.util.spec_from_file_location(f"_fresh_{module}", spec.origin)
    )
    fresh.__spec__.loader.exec_module(fresh)
    return fresh


def test_importing_needs_no_lightning(monkeypatch):
    """With ``lightning`` not installed (blocked): both modules import, and
    lightning's callback says what to install and which import fits
    pytorch_lightning. (In-process: a new interpreter imports for seconds.)"""
    for name in [m for m in sys.modules if m.split(".")[0] == "lightning"]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "lightning", None)
    probe = _fresh("cockpit.integrations.lightning")
    assert issubclass(
        _fresh("cockpit.integrations.pytorch_lightning").CockpitCallback,
        pytorch_lightning.Callback,
    )
    with pytest.raises(ModuleNotFoundError, match="pip install") as error:
        _ = probe.CockpitCallback
    assert "from cockpit.integrations.pytorch_lightning import" in str(error.value)
