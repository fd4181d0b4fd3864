"""CockpitCallback: a Lightning ``Trainer.fit`` logs what the plain loop logs."""

from __future__ import annotations

import math
import warnings

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
from tests.utils import expected_warnings as expected

pytestmark = [
    expected.TIC_HESSIAN_NOT_POSITIVE,
    expected.GGN_FOR_HESSIAN,
    expected.ALPHA_ACCUMULATION,
    expected.LIGHTNING_NO_VAL,
    *expected.LIGHTNING_SHORT_RUNS,
]

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


class ClassifierSteps:
    """A LightningModule written without cockpit in mind, less its base class (so
    tests/integrations/test_integrations_pytorch_lightning.py puts pytorch_lightning's
    under it)."""

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


class Classifier(ClassifierSteps, pl.LightningModule):
    """The module most tests train."""


def _trainer(tmp_path, callback, package=pl, **kwargs):
    """A quiet CPU trainer of ``package`` (``lightning.pytorch`` or
    ``pytorch_lightning``) with ``callback``."""
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
    return package.Trainer(callbacks=[callback], **settings)


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


def check_fit_logs_what_the_plain_loop_logs(
    tmp_path, callback_class=CockpitCallback, module=Classifier, package=pl
):
    """Two epochs with validation, configuration "full", against the plain loop."""
    callback = callback_class(quantities=configuration("full"))
    trainer = _trainer(tmp_path, callback, package=package)
    trainer.fit(module(_net()), _loader(), _loader())
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


def test_fit_logs_what_the_plain_loop_logs(tmp_path):
    check_fit_logs_what_the_plain_loop_logs(tmp_path)


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
    with warnings.catch_warnings():  # nothing about the names the callback passes
        warnings.simplefilter("error", CockpitWarning)
        trainer.fit(Classifier(_net()), _loader())
    assert callback.cockpit.logpath == f"{logger.log_dir}/cockpit.jsonl"
    logger.experiment.flush()
    accumulator = event_accumulator.EventAccumulator(logger.log_dir)
    accumulator.Reload()
    tags = accumulator.Tags()
    assert "train_loss" in tags["scalars"]  # the user's own value, same run
    assert "cockpit/GradNorm/net.0.weight" in tags["scalars"]
    assert "cockpit/GradHist1d" in tags["histograms"]
    assert "cockpit/learning_rates/group_0" in tags["scalars"]  # per group


class Positions(pl.LightningModule):
    """Tokens, a position embedding called with a batch of one (as in BERT), a
    LayerNorm and a head; the optimizer leaves the token embedding alone."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(4)
        self.tokens, self.positions = nn.Embedding(7, 6), nn.Embedding(5, 6)
        self.norm, self.head = nn.LayerNorm(6), nn.Linear(6, 3)
        self.loss_fn = nn.CrossEntropyLoss()
        self.double()

    def forward(self, ids):
        where = torch.arange(ids.shape[1]).unsqueeze(0)  # [1, T]
        return self.head(self.norm(self.tokens(ids) + self.positions(where)).mean(1))

    def training_step(self, batch, batch_idx):
        ids, y = batch
        return self.loss_fn(self(ids), y)

    def configure_optimizers(self):
        updated = [p for n, p in self.named_parameters() if not n.startswith("tok")]
        return torch.optim.SGD(updated, lr=0.2)


def _token_loader():
    generator = torch.Generator().manual_seed(6)
    ids = torch.randint(0, 7, (BATCH * 2, 5), generator=generator)
    y = torch.randint(0, 3, (BATCH * 2,), generator=generator)
    return torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(ids, y), batch_size=BATCH, shuffle=False
    )


def test_the_callback_tracks_what_the_optimizer_updates_exactly(tmp_path):
    """The tensors of the optimizer, so Alpha has its value and nothing is said;
    per-sample values are exact for layers BackPACK has no rule for or gets the
    sample axis of wrong (Variance against a per-sample loop)."""
    from cockpit.quantities import Alpha, Variance

    callback = CockpitCallback(quantities=[Variance(linear(1)), Alpha(linear(1))])
    trainer = _trainer(tmp_path, callback, max_epochs=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CockpitWarning)
        trainer.fit(Positions(), _token_loader())
    names = ["positions.weight", "norm.weight", "norm.bias", "head.weight", "head.bias"]
    assert callback.cockpit.param_names == names
    history = callback.cockpit.history
    assert "missing" not in history[0] and math.isfinite(history[0]["Alpha"])
    model = Positions()
    params = [dict(model.named_parameters())[n] for n in names]
    ids, y = next(iter(_token_loader()))
    per_sample = [
        torch.autograd.grad(model.loss_fn(model(ids[i : i + 1]), y[i : i + 1]), params)
        for i in range(BATCH)
    ]
    for index, got in enumerate(history[0]["Variance"]):
        g = torch.stack([grads[index] for grads in per_sample])
        want = (g - g.mean(0)).square().flatten(1).sum(1).mean().item()
        assert math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-15), names[index]


# --- gradient accumulation and clipping: values recomputed by brute force ------------
MICRO, MICRO_BATCHES = 8, 5  # float64 runs: 5 micro-batches of 8 samples per epoch


def _micro_loader():
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(MICRO * MICRO_BATCHES, 6, generator=generator, dtype=torch.float64)
    y = torch.randint(0, 3, (MICRO * MICRO_BATCHES,), generator=generator)
    data = torch.utils.data.TensorDataset(x, y)
    return torch.utils.data.DataLoader(data, batch_size=MICRO, shuffle=False)


def _net64():
    torch.manual_seed(2)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).double()


class Recording(pl.LightningModule):
    """Keeps every micro-batch with the parameters its forward pass saw."""

    def __init__(self):
        super().__init__()
        self.net = _net64()
        self.loss_fn = nn.CrossEntropyLoss()
        self.seen = []  # (global_step, batch_idx, parameters, x, y)

    def training_step(self, batch, batch_idx):
        x, y = batch
        params = {n: p.detach().clone() for n, p in self.net.named_parameters()}
        self.seen.append((self.trainer.global_step, batch_idx, params, x, y))
        return self.loss_fn(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.5)


class RecordingStrictBackward(Recording):
    def backward(self, loss):
        loss.backward()


def _fit64(tmp_path, callback, module=Recording, **kwargs):
    model = module()
    trainer = _trainer(tmp_path, callback, max_epochs=-1, limit_val_batches=0, **kwargs)
    trainer.fit(model, _micro_loader())
    return model, trainer


def _first_micro_batches(model):
    """The first micro-batch of every optimizer step: {step: (params, x, y)}."""
    first = {}
    for step, _, params, x, y in model.seen:
        first.setdefault(step, (params, x, y))
    return first


def _brute_force(net, params: dict, x, y) -> dict:
    """Loss, GradNorm, Variance, NormTest, HessTrace, HessMaxEV of one micro-batch.

    Plain autograd: one backward pass per sample, and the full Hessian.
    """
    from torch.func import functional_call

    names = list(params)
    shapes = [params[n].shape for n in names]
    sizes = [params[n].numel() for n in names]

    def loss(flat, xs, ys):
        theta = dict(zip(names, (t.view(s) for t, s in zip(flat.split(sizes), shapes))))
        return nn.functional.cross_entropy(functional_call(net, theta, (xs,)), ys)

    flat = torch.cat([params[n].flatten() for n in names])
    per_sample = []
    for i in range(x.shape[0]):
        point = flat.clone().requires_grad_()
        (grad,) = torch.autograd.grad(loss(point, x[i : i + 1], y[i : i + 1]), point)
        per_sample.append(grad.split(sizes))
    n = x.shape[0]
    mean = [sum(g[p] for g in per_sample) / n for p in range(len(names))]
    hessian = torch.autograd.functional.hessian(lambda f: loss(f, x, y), flat)
    eigenvalues = torch.linalg.eigvalsh(hessian)
    spread = sum(
        ((g[p] - mean[p]) ** 2).sum() for g in per_sample for p in range(len(names))
    )
    return {
        "Loss": float(loss(flat, x, y)),
        "GradNorm": [float(m.norm()) for m in mean],
        "Variance": [
            float(sum(((g[p] - mean[p]) ** 2).sum() for g in per_sample) / n)
            for p in range(len(names))
        ],
        "NormTest": float(
            (spread / (n * (n - 1) * sum((m**2).sum() for m in mean))).sqrt()
        ),
        "HessTrace": [float(d.sum()) for d in hessian.diagonal().split(sizes)],
        "HessMaxEV": float(eigenvalues[eigenvalues.abs().argmax()]),
    }


def _norms_between(a: dict, b: dict) -> list[float]:
    return [float((a[n] - b[n]).norm()) for n in a]


def _exact(got, want, where: str, rel: float = 1e-10):
    if isinstance(want, list):
        assert len(got) == len(want), where
        for i, (a, b) in enumerate(zip(got, want)):
            _exact(a, b, f"{where}[{i}]", rel)
    else:
        assert math.isclose(got, want, rel_tol=rel, abs_tol=1e-13), (where, got, want)


def _accumulation_quantities(create_graph: bool = True):
    from cockpit.quantities import (
        Alpha,
        Distance,
        GradNorm,
        HessMaxEV,
        HessTrace,
        Loss,
        NormTest,
        UpdateSize,
        Variance,
    )

    every = linear(1)
    hess_max_ev = [HessMaxEV(every, rtol=1e-12, atol=1e-14, max_iter=60)]
    return [
        Loss(every), GradNorm(every), Variance(every), NormTest(every),
        HessTrace(every), *(hess_max_ev if create_graph else []),
        UpdateSize(every), Distance(every), Alpha(every),
    ]  # fmt: skip


@pytest.mark.parametrize("module", [Recording, RecordingStrictBackward])
def test_accumulation_tracks_the_first_micro_batch_of_every_optimizer_step(
    tmp_path, module
):
    """k=2 over 5 micro-batches an epoch: windows [0, 1], [2, 3], [4] (the epoch's
    last, short one), then [0, 1], [2, 3] in the next epoch; max_steps=5. An
    override of ``backward`` without ``**kwargs`` gets the loss of the micro-batch
    too (HessMaxEV, which needs create_graph, is left out there)."""
    create_graph = module is Recording
    callback = CockpitCallback(quantities=_accumulation_quantities(create_graph))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, trainer = _fit64(
            tmp_path, callback, module, max_steps=5, accumulate_grad_batches=2
        )
    history = callback.cockpit.history
    # the tracked steps are the optimizer steps, each the window's first micro-batch
    assert trainer.global_step == 5
    assert history.steps == [0, 1, 2, 3, 4]
    assert [(s, i) for s, i, *_ in model.seen] == [
        (0, 0), (0, 1), (1, 2), (1, 3), (2, 4), (3, 0), (3, 1), (4, 2), (4, 3),
    ]  # fmt: skip
    first = _first_micro_batches(model)
    initial = first[0][0]
    for step in history.steps:
        params, x, y = first[step]
        want = _brute_force(_net64(), params, x, y)
        if not create_graph:
            del want["HessMaxEV"]
        for key, value in want.items():
            _exact(history[step][key], value, f"step {step}, {key}")
        _exact(history[step]["Distance"], _norms_between(params, initial), "Distance")
        if step + 1 in first:  # the whole optimizer step, all micro-batches
            _exact(
                history[step]["UpdateSize"],
                _norms_between(first[step + 1][0], params),
                f"step {step}, UpdateSize",
            )
        # Alpha replays the update from this micro-batch alone: missing, with why
        assert "Alpha" not in history[step]
        assert "accumulate_grad_batches=2" in history[step]["missing"]["Alpha"]
    alpha_warnings = [w for w in caught if "Alpha has no value" in str(w.message)]
    assert len(alpha_warnings) == 1
    assert issubclass(alpha_warnings[0].category, CockpitWarning)
    assert "accumulate_grad_batches=1" in str(alpha_warnings[0].message)  # the fix
    assert "backward" not in model.__dict__  # restored


@pytest.mark.parametrize("k", [2, 3])
def test_accumulation_with_the_callback_trains_as_without_it(tmp_path, k):
    """The optimizer gets Lightning's gradients: bit for bit for k = 2 (a power of
    two), to rounding for k = 3."""
    callback = CockpitCallback(quantities=configuration("full"))
    tracked, _ = _fit64(tmp_path, callback, max_steps=4, accumulate_grad_batches=k)
    plain = Recording()
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=4, accumulate_grad_batches=k,
        logger=False, default_root_dir=str(tmp_path),
        enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0,
    )  # fmt: skip
    trainer.fit(plain, _micro_loader())
    assert callback.cockpit.history.steps == [0, 1, 2, 3]
    for a, b in zip(tracked.parameters(), plain.parameters()):
        if k == 2:
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=1e-14, atol=1e-15)


def test_an_accumulation_schedule_is_followed_step_by_step(tmp_path):
    """GradientAccumulationScheduler: k = 1 in epoch 0 (steps 0-4), k = 2 in epoch 1
    (windows [0, 1], [2, 3], [4]: steps 5-7). Alpha's start at step 4 (a one-batch
    update) is finished at step 5 with the first micro-batch's per-sample gradients;
    its starts at steps 5-7 are missing."""
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    from cockpit.quantities import Alpha, GradNorm, Loss

    every = linear(1)
    callback = CockpitCallback(quantities=[Alpha(every), GradNorm(every), Loss(every)])
    model = Recording()
    trainer = pl.Trainer(
        callbacks=[GradientAccumulationScheduler({0: 1, 1: 2}), callback],
        accelerator="cpu", devices=1, max_steps=8, logger=False,
        default_root_dir=str(tmp_path),
        enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0,
    )  # fmt: skip
    with pytest.warns(CockpitWarning, match="accumulate_grad_batches=2"):
        trainer.fit(model, _micro_loader())
    history = callback.cockpit.history
    assert history.steps == list(range(8))
    first = _first_micro_batches(model)
    for step in history.steps:
        want = _brute_force(_net64(), *first[step])
        _exact(history[step]["GradNorm"], want["GradNorm"], f"step {step}")
        _exact(history[step]["Loss"], want["Loss"], f"step {step}")
    assert history.series("Alpha")[0] == [0, 1, 2, 3, 4]
    for step in (5, 6, 7):
        assert "accumulate_grad_batches=2" in history[step]["missing"]["Alpha"]


def test_without_accumulation_the_brute_force_values_hold_too(tmp_path):
    callback = CockpitCallback(quantities=_accumulation_quantities()[:6])
    model, _ = _fit64(tmp_path, callback, max_steps=3)
    history = callback.cockpit.history
    assert history.steps == [0, 1, 2]
    first = _first_micro_batches(model)
    for step in history.steps:
        want = _brute_force(_net64(), *first[step])
        for key, value in want.items():
            _exact(history[step][key], value, f"step {step}, {key}")


def _alpha_run(tmp_path, **kwargs):
    from cockpit.quantities import Alpha, GradNorm

    callback = CockpitCallback(quantities=[Alpha(linear(1)), GradNorm(linear(1))])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _fit64(tmp_path, callback, max_steps=4, **kwargs)
    caught = [w for w in caught if "Alpha has no value" in str(w.message)]
    return callback.cockpit.history, caught


@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_lightning_gradient_clipping_makes_alpha_missing(tmp_path, algorithm):
    history, caught = _alpha_run(
        tmp_path, gradient_clip_val=1e-3, gradient_clip_algorithm=algorithm
    )
    assert history.steps == [0, 1, 2, 3]
    for step in history.steps:
        assert "Alpha" not in history[step]
        reason = history[step]["missing"]["Alpha"]
        assert "gradient_clip_val=0.001" in reason
        assert "GradNorm" in history[step]  # the others are unaffected
    assert len(caught) == 1 and issubclass(caught[0].category, CockpitWarning)
    assert "Trainer(gradient_clip_val=None)" in str(caught[0].message)  # the fix


def test_clipping_that_changes_nothing_keeps_alpha(tmp_path):
    clipped, caught = _alpha_run(tmp_path, gradient_clip_val=1e6)
    unclipped, _ = _alpha_run(tmp_path / "plain")
    assert not caught
    steps, values = clipped.series("Alpha")
    assert steps == [0, 1, 2]  # the last start has no next step
    assert values == unclipped.series("Alpha")[1]
    assert all(math.isfinite(v) for v in values)


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


def test_ddp_strategies_are_accepted(tmp_path):
    """(Trained under DDP in tests/integrations/test_integrations_lightning_ddp.py.)"""
    for strategy in ("ddp", "ddp_spawn"):
        callback = CockpitCallback()
        trainer = _trainer(tmp_path, callback, strategy=strategy, devices=2)
        callback.setup(trainer, Classifier(_net()), "fit")


def test_the_lightning_example_runs_with_accumulation(tmp_path):
    pytest.importorskip("sklearn")
    from tests.test_examples import load_example

    module = load_example("lightning_digits")
    with pytest.warns(CockpitWarning, match="accumulate_grad_batches=2"):
        paths = module.main(steps=2, out=str(tmp_path / "out"), accumulate=2)
    history = History.from_json(paths["log"])
    assert history.steps == [0, 1]
    assert "GradNorm" in history[0] and "Alpha" in history[0]["missing"]


class Block(nn.Module):
    """A custom container with a child named ``output`` (as in BERT)."""

    def __init__(self):
        super().__init__()
        self.dense = nn.Linear(10, 8)
        self.output = nn.Sequential(nn.Tanh(), nn.Linear(8, 3))

    def forward(self, x):
        return self.output(self.dense(x))


def test_custom_containers_estimate_or_miss_curvature_as_the_plain_loop(tmp_path):
    callback = CockpitCallback(quantities=configuration("business"))
    trainer = _trainer(tmp_path, callback, max_epochs=1)
    trainer.fit(Classifier(Block()), _loader())
    history = callback.cockpit.history
    assert history.steps == list(range(BATCHES))
    # a custom container: BackPACK's curvature does not pass through its forward(),
    # so, as in the plain loop, HessTrace and TICDiag read the GGN of the
    # cross-entropy formed from the per-sample losses' graph (exact here: few rows
    # times classes), which the estimate records name
    assert "missing" not in history[0]
    assert history[0]["HessTrace_estimate"]["curvature"] == "ggn"
    assert history[0]["TICDiag_estimate"]["method"] == "ggn_exact"
    assert {"Alpha", "GradNorm", "NormTest"} <= set(history[0])
