"""CockpitTrainer: a Hugging Face ``Trainer.train`` logs what the plain loop logs."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from backpack import extend
from torch import nn

from cockpit import Cockpit
from cockpit.errors import CockpitWarning
from cockpit.history import History
from cockpit.utils.configuration import configuration
from cockpit.utils.schedules import linear
from tests.integrations.test_integrations_lightning import assert_same_history

transformers = pytest.importorskip("transformers")
from transformers import (  # noqa: E402
    BertConfig,
    BertForSequenceClassification,
    TrainingArguments,
)

from cockpit.integrations.transformers import CockpitTrainer  # noqa: E402
from tests.utils import expected_warnings as expected  # noqa: E402

pytestmark = [
    expected.ALPHA_GRAD_CHANGED,
    expected.ALPHA_ACCUMULATION,
]

SAMPLES, BATCH, LENGTH, VOCAB = 24, 6, 5, 40


class Sentences(torch.utils.data.Dataset):
    """Random token sequences with random labels (made in code)."""

    def __init__(self, seed: int = 0):
        generator = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (SAMPLES, LENGTH), generator=generator)
        self.labels = torch.randint(0, 3, (SAMPLES,), generator=generator)

    def __len__(self):
        return SAMPLES

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": torch.ones(LENGTH),
                "labels": self.labels[i]}  # fmt: skip

    def batches(self):
        for start in range(0, SAMPLES, BATCH):
            yield (self.ids[start : start + BATCH],
                   self.labels[start : start + BATCH])  # fmt: skip


def _model(attention: str = "sdpa"):
    torch.manual_seed(2)
    config = BertConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=LENGTH, num_labels=3,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    config._attn_implementation = attention
    return BertForSequenceClassification(config)


def _optimizer(model):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    return opt, torch.optim.lr_scheduler.LinearLR(opt, 1.0, 0.25, total_iters=8)


def _args(tmp_path, **kwargs):
    settings = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=BATCH,
        num_train_epochs=2,
        train_sampling_strategy="sequential",
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        use_cpu=True,
        max_grad_norm=1.0,
    )
    settings.update(kwargs)
    return TrainingArguments(**settings)


def _fit(tmp_path, quantities, attention="sdpa", **kwargs):
    model = _model(attention)
    trainer = CockpitTrainer(
        model=model,
        args=_args(tmp_path, **kwargs),
        train_dataset=Sentences(),
        optimizers=_optimizer(model),
        cockpit_quantities=quantities,
    )
    trainer.train()
    return trainer


def _plain_loop(quantities, epochs: int = 2, attention="sdpa") -> Cockpit:
    """The README's loop: same model, data order, optimizer, schedule, clipping."""
    model = extend(_model(attention))
    loss_fn = extend(nn.CrossEntropyLoss())
    individual_loss_fn = nn.CrossEntropyLoss(reduction="none")
    opt, scheduler = _optimizer(model)
    cockpit = Cockpit(model.named_parameters(), quantities=quantities)
    step = 0
    model.train()
    for epoch in range(epochs):
        for ids, labels in Sentences().batches():
            logits = model(input_ids=ids, attention_mask=torch.ones(ids.shape)).logits
            loss = loss_fn(logits, labels)
            losses = individual_loss_fn(logits, labels)
            opt.zero_grad()
            info = {"batch_size": ids.shape[0], "individual_losses": losses,
                    "loss": loss, "optimizer": opt}  # fmt: skip
            with cockpit(step, info=info):
                loss.backward(create_graph=cockpit.create_graph(step))
            lr = opt.param_groups[0]["lr"]
            cockpit.log(step, epoch, None, None, None, None, None, None, lr)
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            scheduler.step()
            step += 1
    return cockpit


def test_train_logs_what_the_plain_loop_logs(tmp_path):
    """Every parameter the optimizer updates is tracked (embeddings and LayerNorms
    too), so Alpha has its value; where the Trainer's clipping (max_grad_norm=1)
    changed the gradients it is missing, with the Trainer's fix, said once."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = _fit(tmp_path, configuration("economy"))
    assert trainer.cockpit.logpath == str(tmp_path / "cockpit.jsonl")
    logged = History.from_json(trainer.cockpit.logpath)
    expected = _plain_loop(configuration("economy")).history
    assert logged.steps == list(range(2 * SAMPLES // BATCH))
    assert {"GradHist1d", "NormTest", "Alpha"} <= set(logged.keys)
    assert trainer.cockpit.param_names == [n for n, _ in _model().named_parameters()]
    clipped = [s for s in logged.steps if "Alpha" in logged[s].get("missing", {})]
    assert clipped  # where the norm exceeded 1
    assert clipped == [s for s in expected.steps if "Alpha" not in expected[s]]
    for step in clipped:
        assert "max_grad_norm=0" in logged[step]["missing"]["Alpha"]
    (said,) = [m for m in _messages(caught) if "Alpha has no value" in m]
    assert "Fix: TrainingArguments(max_grad_norm=0)" in said
    assert_same_history(logged, expected, skip=("Time", "epoch_count", "missing"))
    lrs = logged.series("learning_rate")[1]
    assert lrs[0] == pytest.approx(1e-2) and lrs[-1] < lrs[0]


def test_the_default_tracks_what_the_optimizer_updates_exactly(tmp_path):
    """An optimizer of part of the model (the embeddings are trainable but not in
    it): the cockpit tracks exactly its tensors, so Alpha has its value and nothing
    is said. Per-sample values are exact for every tensor, the position embedding
    (called with a batch of one) included: Variance equals a per-sample loop."""
    from cockpit.quantities import Alpha, Variance

    model = _model("eager").double()
    updated = [p for n, p in model.named_parameters() if ".embeddings." not in n]
    opt = torch.optim.SGD(updated, lr=0.1)
    trainer = CockpitTrainer(
        model=model, args=_args(tmp_path, max_steps=2, max_grad_norm=0.0),
        train_dataset=Sentences(), optimizers=(opt, None),
        cockpit_quantities=[Variance(linear(1)), Alpha(linear(1))],
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("error", CockpitWarning)
        trainer.train()
    names = [n for n, p in _model().named_parameters() if ".embeddings." not in n]
    assert trainer.cockpit.param_names == names
    history = trainer.cockpit.history
    assert "missing" not in history[0] and math.isfinite(history[0]["Alpha"])

    everything = CockpitTrainer(
        model=(model := _model("eager").double()), train_dataset=Sentences(),
        args=_args(tmp_path / "all", max_steps=1, max_grad_norm=0.0),
        cockpit_quantities=[Variance(linear(1))],
    )  # fmt: skip
    everything.train()
    assert everything.cockpit.param_names == [n for n, _ in model.named_parameters()]
    assert "position_embeddings" in everything.cockpit.param_names[1]
    model = _model("eager").double()
    params = list(model.parameters())
    per_sample = []
    for i in range(BATCH):
        ids = Sentences().ids[i : i + 1]
        logits = model(input_ids=ids, attention_mask=torch.ones(ids.shape)).logits
        loss = nn.functional.cross_entropy(logits, Sentences().labels[i : i + 1])
        per_sample.append(torch.autograd.grad(loss, params))
    for index, got in enumerate(everything.cockpit.history[0]["Variance"]):
        g = torch.stack([grads[index] for grads in per_sample])
        want = (g - g.mean(0)).square().flatten(1).sum(1).mean().item()
        assert math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-15), index


def test_full_configuration_and_create_graph(tmp_path):
    """HessMaxEV gets create_graph through the accelerator's backward.

    PyTorch's fused CPU attention has no second derivative; eager attention has.
    """
    from cockpit.quantities import GradNorm, HessMaxEV
    from cockpit.utils.schedules import linear

    def quantities():
        return [HessMaxEV(linear(2)), GradNorm(linear(1))]

    trainer = _fit(tmp_path, quantities(), "eager", num_train_epochs=1)
    expected = _plain_loop(quantities(), epochs=1, attention="eager").history
    logged = History.from_json(trainer.cockpit.logpath)
    assert logged.series("HessMaxEV")[0] == [0, 2]
    assert_same_history(logged, expected, skip=("Time", "epoch_count"))


# --- gradient accumulation: float64, SGD (a wrong loss scale changes the run) ---------
MICRO, MICROS = 4, 5  # micro-batches of 4; windows of k=2: [0, 1], [2, 3], [4]


class Micro(torch.utils.data.Dataset):
    """20 random sequences with random labels, 5 micro-batches of 4."""

    def __init__(self):
        generator = torch.Generator().manual_seed(5)
        self.ids = torch.randint(
            0, VOCAB, (MICRO * MICROS, LENGTH), generator=generator
        )
        self.labels = torch.randint(0, 3, (MICRO * MICROS,), generator=generator)

    def __len__(self):
        return MICRO * MICROS

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": torch.ones(LENGTH),
                "labels": self.labels[i]}  # fmt: skip

    def batch(self, i):
        part = slice(i * MICRO, (i + 1) * MICRO)
        return self.ids[part], self.labels[part]


class TinyClassifier(nn.Module):
    """A plain module (no ``**kwargs``: the Trainer passes no num_items_in_batch;
    ``labels`` in the signature keeps the Trainer from dropping them)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(2)
        self.embed = nn.Embedding(VOCAB, 6)
        self.hidden, self.head = nn.Linear(6, 5), nn.Linear(5, 3)

    def forward(self, input_ids, attention_mask=None, labels=None):
        x = self.embed(input_ids).mean(dim=1)
        return {"logits": self.head(torch.tanh(self.hidden(x)))}


def _bert64(attention="eager"):
    """BERT in float64 with embeddings and LayerNorms frozen: the optimizer updates
    exactly the tracked Linear parameters (so Alpha is not missing for that)."""
    model = _model(attention).double()
    for module in model.modules():
        if not isinstance(module, nn.Linear):
            for p in module.parameters(recurse=False):
                p.requires_grad_(False)
    return model


def _tiny64(attention=None):
    model = TinyClassifier().double()
    model.embed.weight.requires_grad_(False)
    return model


def _sgd(model):
    trained = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.SGD(trained, lr=0.5, momentum=0.5)


def _accumulation_quantities(hessian: bool):
    from cockpit import quantities as Q

    every = linear(1)
    return [
        Q.Loss(every), Q.GradNorm(every), Q.Variance(every), Q.NormTest(every),
        Q.InnerTest(every), Q.OrthoTest(every), Q.GradHist1d(every),
        Q.Distance(every), Q.UpdateSize(every), Q.Alpha(every),
        *([Q.HessMaxEV(every, rtol=1e-12, atol=1e-14, max_iter=60)] if hessian else []),
    ]  # fmt: skip


def _fit_accumulating(tmp_path, make_model, quantities, k, max_steps, **kwargs):
    model = make_model()
    args = _args(tmp_path, per_device_train_batch_size=MICRO, num_train_epochs=3,
                 gradient_accumulation_steps=k, max_steps=max_steps,
                 lr_scheduler_type="constant", **kwargs)  # fmt: skip
    trainer = CockpitTrainer(model=model, args=args, train_dataset=Micro(),
                             optimizers=(_sgd(model), None),
                             cockpit_quantities=quantities)  # fmt: skip
    trainer.train()
    return trainer


def _windows(k: int, steps: int) -> list[tuple[int, list[int]]]:
    """(epoch, micro-batch indices) of every optimizer step, as the Trainer cuts."""
    windows = []
    for epoch in range(steps):
        cuts = [list(range(i, min(i + k, MICROS))) for i in range(0, MICROS, k)]
        windows += [(epoch, cut) for cut in cuts]
    return windows[:steps]


def _plain_accumulating_loop(make_model, quantities, k: int, steps: int) -> Cockpit:
    """The plain loop: ``with cockpit(step, ...)`` around the backward pass of the
    first micro-batch of each window, with its mean loss; then that gradient
    divided by the window's micro-batches, the others' ``loss / n`` added, the
    optimizer step."""
    model = extend(make_model())
    loss_fn = extend(nn.CrossEntropyLoss())
    individual_loss_fn = nn.CrossEntropyLoss(reduction="none")
    opt = _sgd(model)
    tracked = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    cockpit = Cockpit(tracked, quantities=quantities)
    data = Micro()
    model.train()
    for step, (epoch, window) in enumerate(_windows(k, steps)):
        for j, i in enumerate(window):
            ids, labels = data.batch(i)
            logits = model(input_ids=ids, attention_mask=torch.ones(ids.shape))
            logits = logits["logits"]
            loss = loss_fn(logits, labels)
            if j == 0:
                losses = individual_loss_fn(logits, labels)
                info = {"batch_size": ids.shape[0], "loss": loss, "optimizer": opt,
                        "individual_losses": losses}  # fmt: skip
                with cockpit(step, info=info):
                    loss.backward(create_graph=cockpit.create_graph(step))
                with torch.no_grad():
                    for _, p in tracked:
                        p.grad.mul_(1 / len(window))
            else:
                (loss / len(window)).backward()
        lr = opt.param_groups[0]["lr"]
        cockpit.log(step, epoch, None, None, None, None, None, None, lr)
        opt.step()
        opt.zero_grad()
    return cockpit


def _assert_close64(got, want, where: str):
    """Equal structure; floats to 1e-9 relative (both runs compute alike)."""
    if isinstance(want, dict):
        assert sorted(got) == sorted(want), where
        for key in want:
            _assert_close64(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, list):
        assert len(got) == len(want), where
        for i, (a, b) in enumerate(zip(got, want)):
            _assert_close64(a, b, f"{where}[{i}]")
    elif isinstance(want, float):
        assert math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-12), (where, got, want)
    else:
        assert got == want, where


@pytest.mark.parametrize("make_model", [_bert64, _tiny64], ids=["bert", "plain"])
def test_accumulation_tracks_the_first_micro_batch_of_every_optimizer_step(
    tmp_path, make_model
):
    """k=2 over 5 micro-batches an epoch: windows [0, 1], [2, 3], [4] (a short one,
    the epoch's last), [0, 1]. Every value of the first micro-batch's mean loss is
    the plain loop's. Alpha is missing where the window has two micro-batches, with
    the reason, warned once; the short window's update is its micro-batch's own, so
    Alpha has its value there. BERT takes ``**kwargs``, so the Trainer counts
    num_items_in_batch and would not divide the loss by k by itself; the plain
    module takes none."""
    hessian = make_model is _bert64  # eager attention has a second derivative
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = _fit_accumulating(tmp_path, make_model,
                                    _accumulation_quantities(hessian), k=2,
                                    max_steps=4, max_grad_norm=0.0)  # fmt: skip
    assert trainer.model_accepts_loss_kwargs is (make_model is _bert64)
    logged = History.from_json(trainer.cockpit.logpath)
    expected = _plain_accumulating_loop(
        make_model, _accumulation_quantities(hessian), k=2, steps=4
    ).history
    assert logged.steps == expected.steps == [0, 1, 2, 3]
    assert "HessMaxEV" in logged[0] or not hessian
    # step 0 from the definitions: micro-batch 0's mean loss at the initial model
    model = make_model()
    ids, labels = Micro().batch(0)
    logits = model(input_ids=ids, attention_mask=torch.ones(ids.shape))["logits"]
    loss = nn.functional.cross_entropy(logits, labels)
    trained = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, trained)
    _assert_close64(logged[0]["Loss"], loss.item(), "Loss")
    _assert_close64(logged[0]["GradNorm"], [g.norm().item() for g in grads], "norms")
    for step in logged.steps:
        got, want = logged[step], expected[step]
        for values in (got, want):  # the plain loop's check says why, differently
            values.pop("missing", None)
        if step in (0, 1, 3):  # windows of two micro-batches
            assert "Alpha" not in got
            reason = logged[step]["missing"]["Alpha"]
            assert reason.startswith("with gradient_accumulation_steps=2 the ")
            assert "Fix: gradient_accumulation_steps=1" in reason
            assert list(logged[step]["missing"]) == ["Alpha"]
            want.pop("Alpha", None)
        else:  # the window of micro-batch 4 alone
            assert "missing" not in logged[step]
            assert "Alpha" in want
        _assert_close64(got, want, f"step {step}")
    alpha_warnings = [m for m in _messages(caught) if "Alpha has no value" in m]
    assert len(alpha_warnings) == 1
    assert "gradient_accumulation_steps=1" in alpha_warnings[0]
    assert "backward" not in trainer.accelerator.__dict__  # restored
    assert "loss_is_scaled_for_ga" not in trainer.__dict__  # restored


def _messages(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, CockpitWarning)]


class MeanLossTrainer(transformers.Trainer):
    """The Trainer without cockpit, with the mixin's loss: each micro-batch's mean
    cross-entropy, declared unscaled (so the Trainer divides it by k)."""

    loss_is_scaled_for_ga = False

    def compute_loss(self, model, inputs, return_outputs=False, **kwargs):
        inputs = dict(inputs)
        labels = inputs.pop("labels")
        logits = model(**inputs)["logits"]
        loss = nn.functional.cross_entropy(logits, labels)
        return (loss, {"logits": logits}) if return_outputs else loss


@pytest.mark.parametrize("k", [2, 3])
def test_accumulation_with_cockpit_trains_as_without_it(tmp_path, k):
    """The optimizer gets the Trainer's gradients of the mean losses: bit for bit
    for k = 2 (a power of two), to rounding for k = 3 (clipping on)."""
    tracked = _fit_accumulating(tmp_path, _bert64, configuration("economy"), k=k,
                                max_steps=3)  # fmt: skip
    model = _bert64()
    args = _args(tmp_path / "plain", per_device_train_batch_size=MICRO,
                 num_train_epochs=3, gradient_accumulation_steps=k, max_steps=3,
                 lr_scheduler_type="constant")  # fmt: skip
    MeanLossTrainer(model=model, args=args, train_dataset=Micro(),
                    optimizers=(_sgd(model), None)).train()  # fmt: skip
    assert tracked.cockpit.history.steps == [0, 1, 2]
    moved = False
    for a, b, start in zip(tracked.model.parameters(), model.parameters(),
                           _bert64().parameters()):  # fmt: skip
        moved |= not torch.equal(a, start)
        if k == 2:
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-15)
    assert moved


def test_accumulation_needs_a_trainer_that_can_be_told_the_loss_is_a_mean(
    tmp_path, monkeypatch
):
    """Older transformers lack Trainer.loss_is_scaled_for_ga: warn at the set-up,
    track nothing (this version's training_step reads it, so it is back for that)."""
    trainer = CockpitTrainer(
        model=_model(),
        args=_args(tmp_path, gradient_accumulation_steps=2, max_steps=1),
        train_dataset=Sentences(),
    )
    monkeypatch.delattr(transformers.Trainer, "loss_is_scaled_for_ga")
    with pytest.warns(CockpitWarning, match="upgrade transformers, or debug with"):
        trainer._cockpit_setup(trainer.model)
    monkeypatch.undo()
    trainer.train()
    assert trainer.state.global_step == 1
    assert len(trainer.cockpit.history) == 0


def test_a_loss_changed_after_compute_loss_is_an_error(tmp_path):
    """The cockpit backpropagates compute_loss's loss: a term added afterwards would
    be lost from the gradients, so the step says how to fix it instead."""

    class Regularised(CockpitTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, **kwargs):
            loss = super().compute_loss(model, inputs, return_outputs, **kwargs)
            penalty = model.classifier.weight.square().sum()
            return loss + 1e-3 * penalty

    trainer = Regularised(
        model=_model(),
        args=_args(tmp_path, max_steps=1),
        train_dataset=Sentences(),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CockpitWarning)
        with pytest.raises(RuntimeError, match="put other terms into cockpit_loss_fn"):
            trainer.train()
    assert "backward" not in trainer.accelerator.__dict__
    assert len(trainer.cockpit.history) == 0


def test_a_training_step_without_the_accelerators_backward_is_named(tmp_path):
    """The cockpit's step runs in accelerator.backward: a base trainer whose
    training_step calls loss.backward() itself gets nothing tracked, and is told."""
    from cockpit.integrations.transformers import CockpitTrainerMixin

    class OwnBackward(transformers.Trainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            model.train()
            loss = self.compute_loss(model, inputs)
            loss.backward()
            return loss.detach()

    class Tracked(CockpitTrainerMixin, OwnBackward):
        pass

    trainer = Tracked(model=_model(), args=_args(tmp_path, max_steps=2),
                      train_dataset=Sentences())  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    named = [m for m in _messages(caught) if "ran no accelerator.backward" in m]
    assert len(named) == 1 and "tracked nothing at step 0" in named[0]
    assert trainer.state.global_step == 2 and len(trainer.cockpit.history) == 0
    assert "backward" not in trainer.accelerator.__dict__


def test_the_huggingface_example_runs_with_accumulation(tmp_path):
    from tests.test_examples import load_example

    module = load_example("huggingface_tiny_bert")
    assert "--accumulate" in module.__doc__
    paths = module.main(steps=2, out=str(tmp_path / "out"), accumulate=2)
    history = History.from_json(paths["log"])
    assert history.steps == [0, 1]  # optimizer steps, of two micro-batches each
    assert {"GradNorm", "Loss", "learning_rate"} <= set(history[1])


def test_tensorboard_run_gets_the_export(tmp_path):
    event_accumulator = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator"
    )
    trainer = _fit(tmp_path, configuration("economy"), max_steps=2,
                   report_to=["tensorboard"], logging_strategy="steps",
                   logging_steps=1)  # fmt: skip
    (callback,) = [
        c
        for c in trainer.callback_handler.callbacks
        if type(c).__name__ == "TensorBoardCallback"
    ]
    accumulator = event_accumulator.EventAccumulator(callback.logging_dir)
    accumulator.Reload()
    scalars = accumulator.Tags()["scalars"]
    assert "train/loss" in scalars  # the Trainer's own value, same run
    # through the callback's on_log, which puts train/ in front of every name
    assert "train/cockpit/NormTest" in scalars
    assert "train/cockpit/GradNorm/classifier.weight" in scalars
    assert "cockpit/GradHist1d" in accumulator.Tags()["histograms"]
    assert "cockpit/dashboard" in accumulator.Tags()["images"]


def test_a_resumed_run_keeps_the_first_log(tmp_path):
    first = _fit(tmp_path, configuration("economy"), max_steps=2,
                 save_strategy="steps", save_steps=2)  # fmt: skip
    model = _model()
    second = CockpitTrainer(
        model=model,
        args=_args(tmp_path, max_steps=4),
        train_dataset=Sentences(),
        optimizers=_optimizer(model),
    )
    with pytest.warns(CockpitWarning, match="resumed at step 2"):
        second.train(resume_from_checkpoint=True)
    assert History.from_json(first.cockpit.logpath).steps == [0, 1]
    assert second.cockpit.logpath == str(tmp_path / "cockpit_from_step_2.jsonl")
    assert History.from_json(second.cockpit.logpath).steps == [2, 3]
