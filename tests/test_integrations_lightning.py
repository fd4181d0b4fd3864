"""CockpitCallback: a Lightning ``Trainer.fit`` logs what the plain loop logs."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from cockpit import Cockpit
from cockpit.errors import CockpitWarning
from cockpit.history import History
from cockpit.utils.configuration import configuration
from cockpit.utils.schedules import linear

try:
    import lightning.pytorch as pl
except (ImportError, RuntimeError) as error:  # RuntimeError: a broken torchvision
    pytest.skip(f"lightning cannot be imported: {error}", allow_module_level=True)
from cockpit.integrations.lightning import CockpitCallback  # noqa: E402

BATCH, BATCHES = 8, 4


def _data(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(BATCH * BATCHES, 10, generator=generator)
    y = torch.randint(0, 3, (BATCH * BATCHES,), generator=generator)
    return x, y


def _loader():
    return torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(*_data()), batch_size=BATCH, shuffle=False
    )


def _net():
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(10, 8), nn.Tanh(), nn.Linear(8, 3))


def _optimizer(params):
    opt = torch.optim.SGD(params, lr=0.3, momentum=0.5)
    return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


class Classifier(pl.LightningModule):
    """A LightningModule written without cockpit in mind."""

    def __init__(self, net):
        super().__init__()
        self.net = net
        self.loss_fn = nn.CrossEntropyLoss()

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = self.loss_fn(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", self.loss_fn(self.net(x), y))

    def configure_optimizers(self):
        opt, scheduler = _optimizer(self.parameters())
        return {
            "optimizer": opt,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }


def _trainer(tmp_path, callback, **kwargs):
    settings = dict(
        accelerator="cpu",
        devices=1,
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
        limit_val_batches=1,
    )
    settings.update(kwargs)
    return pl.Trainer(callbacks=[callback], **settings)


def _plain_loop(net, quantities, epochs: int = 2, validate: bool = True) -> Cockpit:
    """The README's training loop on the same data, model and optimizer."""
    from backpack import extend

    net = extend(net)
    loss_fn = extend(nn.CrossEntropyLoss())
    individual_loss_fn = nn.CrossEntropyLoss(reduction="none")
    opt, scheduler = _optimizer(net.parameters())
    cockpit = Cockpit(net.parameters(), quantities=quantities)
    step = 0
    for epoch in range(epochs):
        for x, y in _loader():
            outputs = net(x)
            loss = loss_fn(outputs, y)
            losses = individual_loss_fn(outputs, y)
            opt.zero_grad()
            info = {"batch_size": x.shape[0], "individual_losses": losses,
                    "loss": loss, "optimizer": opt}  # fmt: skip
            with cockpit(step, info=info):
                loss.backward(create_graph=cockpit.create_graph(step))
            lr = opt.param_groups[0]["lr"]
            cockpit.log(step, epoch, None, None, None, None, None, None, lr)
            opt.step()
            scheduler.step()
            step += 1
        if validate:  # as Lightning's validation: one batch, after the epoch
            with torch.no_grad():
                x, y = next(iter(_loader()))
                valid_loss = loss_fn(net(x), y).item()
            cockpit.log(step - 1, epoch, None, valid_loss, None, None, None, None, lr)
    return cockpit


def assert_same_history(actual: History, expected: History, skip=("Time",)):
    """Equal steps, keys and values (floats to a tight tolerance)."""
    assert actual.steps == expected.steps
    for step in expected.steps:
        got, want = actual[step], expected[step]
        assert sorted(got) == sorted(want), step
        for key in want:
            if key not in skip:
                _assert_close(got[key], want[key], f"step {step}, {key}")


def _assert_close(got, want, where: str):
    if isinstance(want, dict):
        assert sorted(got) == sorted(want), where
        for key in want:
            _assert_close(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, list):
        assert len(got) == len(want), where
        for i, (a, b) in enumerate(zip(got, want)):
            _assert_close(a, b, f"{where}[{i}]")
    elif isinstance(want, float):
        assert math.isclose(got, want, rel_tol=1e-5, abs_tol=1e-7), (where, got, want)
    else:
        assert got == want, where


def test_fit_logs_what_the_plain_loop_logs(tmp_path):
    callback = CockpitCallback(quantities=configuration("full"))
    trainer = _trainer(tmp_path, callback)
    trainer.fit(Classifier(_net()), _loader(), _loader())
    assert callback.cockpit.logpath == str(tmp_path / "cockpit.jsonl")
    logged = History.from_json(callback.cockpit.logpath)
    expected = _plain_loop(_net(), configuration("full")).history
    assert logged.steps == list(range(2 * BATCHES))
    assert "HessMaxEV" in logged[0] and "GradHist2d" in logged[0]
    assert_same_history(logged, expected)
    assert_same_history(callback.cockpit.history, expected)
    assert logged.series("learning_rate")[1][:4] == [0.3, 0.3, 0.15, 0.15]
    steps, values = logged.series("valid_loss")
    validated = [s for s, v in zip(steps, values) if v is not None]
    assert validated == [BATCHES - 1, 2 * BATCHES - 1]


def test_resume_from_a_checkpoint_continues_the_log(tmp_path):
    quantities = lambda: configuration("economy", track_schedule=linear(1))  # noqa: E731
    first = CockpitCallback(quantities=quantities(), logpath=tmp_path / "log")
    trainer = _trainer(tmp_path, first, max_epochs=1, enable_checkpointing=True)
    trainer.fit(Classifier(_net()), _loader())
    checkpoint = trainer.checkpoint_callback.best_model_path
    second = CockpitCallback(quantities=quantities(), logpath=tmp_path / "log")
    trainer = _trainer(tmp_path, second, max_epochs=2)
    trainer.fit(Classifier(_net()), _loader(), ckpt_path=checkpoint)
    expected = _plain_loop(_net(), quantities(), validate=False).history
    assert_same_history(History.from_json(tmp_path / "log.jsonl"), expected)


def test_tensorboard_logger_gets_the_export(tmp_path):
    from lightning.pytorch.loggers import TensorBoardLogger

    event_accumulator = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator"
    )
    logger = TensorBoardLogger(str(tmp_path), name="runs")
    callback = CockpitCallback(quantities=configuration("economy"))
    trainer = _trainer(
        tmp_path, callback, logger=logger, max_epochs=1, log_every_n_steps=1
    )
    trainer.fit(Classifier(_net()), _loader())
    assert callback.cockpit.logpath == f"{logger.log_dir}/cockpit.jsonl"
    logger.experiment.flush()
    accumulator = event_accumulator.EventAccumulator(logger.log_dir)
    accumulator.Reload()
    tags = accumulator.Tags()
    assert "train_loss" in tags["scalars"]  # the user's own value, same run
    assert "cockpit/GradNorm/net.0.weight" in tags["scalars"]
    assert "cockpit/GradHist1d" in tags["histograms"]


def test_gradient_accumulation_warns_and_tracks_nothing(tmp_path):
    callback = CockpitCallback(quantities=configuration("economy"))
    trainer = _trainer(tmp_path, callback, max_epochs=1, accumulate_grad_batches=2)
    with pytest.warns(CockpitWarning, match="accumulate_grad_batches=1"):
        trainer.fit(Classifier(_net()), _loader())
    assert len(callback.cockpit.history) == 0


class FunctionalLoss(Classifier):
    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)


def test_a_functional_loss_fails_with_the_fix(tmp_path):
    callback = CockpitCallback(quantities=configuration("economy"))
    trainer = _trainer(tmp_path, callback, max_epochs=1)
    with pytest.raises(RuntimeError, match="loss module attribute"):
        trainer.fit(FunctionalLoss(_net()), _loader())
    # the failed step was abandoned: a plain backward works again
    model = trainer.lightning_module
    model.loss_fn(model.net(torch.randn(2, 10)), torch.tensor([0, 1])).backward()


class StrictBackward(Classifier):
    def backward(self, loss):
        loss.backward()


def test_an_override_of_backward_without_kwargs_gets_a_warning(tmp_path):
    from cockpit.quantities import HessMaxEV

    callback = CockpitCallback(quantities=[HessMaxEV(linear(1))])
    trainer = _trainer(tmp_path, callback, max_epochs=1)
    with pytest.warns(CockpitWarning, match="create_graph"):
        with pytest.raises(Exception, match="create_graph"):
            trainer.fit(StrictBackward(_net()), _loader())


class ForwardingBackward(Classifier):
    def backward(self, loss, *args, **kwargs):
        loss.backward(*args, **kwargs)


def test_an_override_of_backward_with_kwargs_gets_create_graph(tmp_path):
    from cockpit.quantities import HessMaxEV

    callback = CockpitCallback(quantities=[HessMaxEV(linear(2))])
    trainer = _trainer(tmp_path, callback, max_epochs=1)
    trainer.fit(ForwardingBackward(_net()), _loader())
    assert callback.cockpit.history.series("HessMaxEV")[0] == [0, 2]
    assert "backward" not in trainer.lightning_module.__dict__  # restored


def test_multi_process_strategies_are_refused(tmp_path):
    callback = CockpitCallback()
    trainer = _trainer(tmp_path, callback, strategy="ddp_spawn", devices=2)
    with pytest.raises(RuntimeError, match="single-device"):
        callback.setup(trainer, Classifier(_net()), "fit")


def test_the_lightning_example_runs(tmp_path):
    pytest.importorskip("sklearn")
    from tests.test_examples import assert_png, load_example

    module = load_example("lightning_digits")
    assert "python examples/lightning_digits.py" in module.__doc__
    paths = module.main(steps=4, out=str(tmp_path / "out"))
    assert_png(paths["dashboard"])
    history = History.from_json(paths["log"])
    assert history.steps == [0, 1, 2, 3]
    assert {"Alpha", "GradHist1d", "learning_rate", "valid_accuracy"} <= set(
        history.keys
    )
    valid_loss, valid_accuracy = history[3]["valid_loss"], history[3]["valid_accuracy"]
    assert math.isfinite(valid_loss) and valid_loss > 0  # a cross-entropy
    assert 0.0 <= valid_accuracy <= 1.0


class Block(nn.Module):
    """A custom container with a child named ``output`` (as in BERT)."""

    def __init__(self):
        super().__init__()
        self.dense = nn.Linear(10, 8)
        self.output = nn.Sequential(nn.Tanh(), nn.Linear(8, 3))

    def forward(self, x):
        return self.output(self.dense(x))


def test_custom_containers_record_curvature_as_missing(tmp_path):
    callback = CockpitCallback(quantities=configuration("business"))
    trainer = _trainer(tmp_path, callback, max_epochs=1)
    trainer.fit(Classifier(Block()), _loader())
    history = callback.cockpit.history
    assert history.steps == list(range(BATCHES))
    # a custom container: BackPACK's curvature does not pass through its forward(),
    # so the curvature quantities are recorded as missing, with the reason
    for key in ("HessTrace", "TICDiag"):
        assert "nn.Sequential" in history[0]["missing"][key]
    assert {"Alpha", "GradNorm", "NormTest"} <= set(history[0])
