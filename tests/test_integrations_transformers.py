"""CockpitTrainer: a Hugging Face ``Trainer.train`` logs what the plain loop logs."""

from __future__ import annotations

import warnings

import pytest
import torch
from backpack import extend
from torch import nn

from cockpit import Cockpit
from cockpit.errors import CockpitWarning
from cockpit.history import History
from cockpit.utils.configuration import configuration
from tests.test_integrations_lightning import assert_same_history

transformers = pytest.importorskip("transformers")
from transformers import (  # noqa: E402
    BertConfig,
    BertForSequenceClassification,
    TrainingArguments,
)

from cockpit.integrations.transformers import CockpitTrainer  # noqa: E402

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
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CockpitWarning)  # the untracked LayerNorms
        trainer.train()
    return trainer


def _plain_loop(quantities, epochs: int = 2, attention="sdpa") -> Cockpit:
    """The README's loop: same model, data order, optimizer, schedule, clipping."""
    model = _model(attention)
    for module in model.modules():
        if isinstance(module, nn.Linear):  # BERT's attention has a child "output",
            extend(module)  # which BackPACK's extend of the whole model overwrites
    loss_fn = extend(nn.CrossEntropyLoss())
    individual_loss_fn = nn.CrossEntropyLoss(reduction="none")
    opt, scheduler = _optimizer(model)
    tracked = [
        (name, p)
        for name, p in model.named_parameters()
        if name.endswith((".weight", ".bias"))
        and isinstance(model.get_submodule(name.rsplit(".", 1)[0]), nn.Linear)
    ]
    cockpit = Cockpit(tracked, quantities=quantities)
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
    trainer = _fit(tmp_path, configuration("economy"))
    assert trainer.cockpit.logpath == str(tmp_path / "cockpit.jsonl")
    logged = History.from_json(trainer.cockpit.logpath)
    expected = _plain_loop(configuration("economy")).history
    assert logged.steps == list(range(2 * SAMPLES // BATCH))
    assert {"GradHist1d", "NormTest"} <= set(logged.keys)
    # the trainer tracks the Linear layers only, so the optimizer's update (which
    # also moves LayerNorm and embeddings) is not what Alpha would see: missing
    assert "does not track" in logged[0]["missing"]["Alpha"]
    assert_same_history(logged, expected, skip=("Time", "epoch_count"))
    lrs = logged.series("learning_rate")[1]
    assert lrs[0] == pytest.approx(1e-2) and lrs[-1] < lrs[0]


def test_untracked_layers_are_named_once(tmp_path):
    with pytest.warns(CockpitWarning, match="LayerNorm"):
        trainer = CockpitTrainer(
            model=_model(),
            args=_args(tmp_path, max_steps=1),
            train_dataset=Sentences(),
            cockpit_quantities=configuration("economy"),
        )
        trainer.train()
    assert History.from_json(trainer.cockpit.logpath).steps == [0]


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


def test_gradient_accumulation_warns_and_tracks_nothing(tmp_path):
    model = _model()
    trainer = CockpitTrainer(
        model=model,
        args=_args(tmp_path, gradient_accumulation_steps=2, max_steps=1),
        train_dataset=Sentences(),
    )
    with pytest.warns(CockpitWarning, match="gradient_accumulation_steps=1"):
        trainer.train()
    assert len(trainer.cockpit.history) == 0


def test_the_huggingface_example_runs(tmp_path):
    from tests.test_examples import load_example

    module = load_example("huggingface_tiny_bert")
    assert "python examples/huggingface_tiny_bert.py" in module.__doc__
    paths = module.main(steps=3, out=str(tmp_path / "out"))
    history = History.from_json(paths["log"])
    assert history.steps == [0, 1, 2]
    assert {"GradNorm", "learning_rate"} <= set(history.keys)
    assert "Alpha" in history[0]["missing"]  # a subset of the optimizer's params


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
    assert "cockpit/NormTest" in scalars
    assert "cockpit/GradNorm/classifier.weight" in scalars


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
