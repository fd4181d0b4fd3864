"""Hugging Face: cockpit in ``Trainer.train`` of a tiny, randomly initialised BERT.

The model is built from a ``BertConfig`` (no download) and learns a made-up task:
does a sequence of random tokens contain the token 1? The only cockpit change is the
trainer class::

    trainer = CockpitTrainer(model=model, args=args, train_dataset=train,
                             cockpit_quantities=configuration("economy"))

``CockpitTrainer`` computes the loss from the model's logits with a BackPACK-extended
``nn.CrossEntropyLoss`` (the model's own loss is functional code BackPACK cannot
see) and tracks every parameter the optimizer updates (BackPACK serves the
``nn.Linear`` layers; embeddings and LayerNorms get exact per-sample gradients from
the cockpit's own engines). The log streams to ``<out>/cockpit.jsonl``;
``cockpit export <out>/cockpit.jsonl --tensorboard <dir>`` puts it into TensorBoard.

With ``--accumulate k`` the trainer accumulates the gradients of ``k`` micro-batches
per optimizer step (``gradient_accumulation_steps=k``); the cockpit then tracks the
first micro-batch of every optimizer step.

Run: ``python examples/huggingface_tiny_bert.py [--steps 120] [--out hf_output]
[--accumulate 1]``; needs the ``transformers`` extra, installed as
``docs/integrations.md`` says (``.venv/bin/pip install -c constraints.txt -e
".[transformers]" && .venv/bin/pip uninstall -y torchvision``). Writes the log and
``<out>/dashboard.png``.
"""

from __future__ import annotations

import argparse
import sys
import warnings

# before transformers: a torchvision that cannot load is reported with its fix
from cockpit.integrations.transformers import CockpitTrainer  # isort: split

import torch
from transformers import BertConfig, BertForSequenceClassification, TrainingArguments

from cockpit import CockpitPlotter
from cockpit.utils.configuration import configuration


class ContainsToken(torch.utils.data.Dataset):
    """Random token sequences; the label says whether token 1 occurs."""

    def __init__(self, samples: int = 2048, length: int = 12, vocab: int = 30):
        generator = torch.Generator().manual_seed(0)
        self.ids = torch.randint(2, vocab, (samples, length), generator=generator)
        hits = torch.rand(samples, generator=generator) < 0.5
        where = torch.randint(0, length, (samples,), generator=generator)
        self.ids[hits, where[hits]] = 1
        self.labels = hits.long()

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return {
            "input_ids": self.ids[i],
            "attention_mask": torch.ones_like(self.ids[i]),
            "labels": self.labels[i],
        }


def tiny_bert(vocab: int = 30, length: int = 12) -> BertForSequenceClassification:
    """A two-layer BERT with 32 hidden units, randomly initialised."""
    config = BertConfig(
        vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=length, num_labels=2,
    )  # fmt: skip
    return BertForSequenceClassification(config)


def main(
    steps: int = 120,
    out: str = "hf_output",
    config: str = "economy",
    accumulate: int = 1,
) -> dict[str, str]:
    """Train with cockpit; return the paths of the log and the dashboard.

    Args:
        steps: Optimizer steps (a test runs a handful).
        out: The trainer's ``output_dir``.
        config: ``economy`` (curvature quantities need BackPACK to differentiate
            through attention, which it cannot).
        accumulate: Micro-batches per optimizer step
            (``gradient_accumulation_steps``).
    """
    torch.manual_seed(0)
    args = TrainingArguments(
        output_dir=out,
        max_steps=steps,
        per_device_train_batch_size=32,
        gradient_accumulation_steps=accumulate,
        learning_rate=3e-3,
        lr_scheduler_type="linear",
        warmup_steps=max(1, steps // 10),
        report_to=[],
        save_strategy="no",
        logging_steps=20,
        disable_tqdm=not sys.stderr.isatty(),  # the Trainer's bar, on a terminal
        use_cpu=True,
    )
    trainer = CockpitTrainer(
        model=tiny_bert(),
        args=args,
        train_dataset=ContainsToken(),
        cockpit_quantities=configuration(config),
    )
    trainer.train()

    logpath = trainer.cockpit.logpath
    plotter = CockpitPlotter()
    plotter.plot(logpath, show_plot=False, plot_title="Hugging Face: tiny BERT")
    (dashboard,) = plotter.save(f"{out}/dashboard.png")
    return {"log": logpath, "dashboard": dashboard}


if __name__ == "__main__":
    # PyTorch warns when BackPACK's hook fires on the first layer, whose input needs
    # no gradient; that is expected and harmless.
    warnings.filterwarnings("ignore", "Full backward hook is firing")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--out", default="hf_output")
    parser.add_argument("--config", default="economy")
    parser.add_argument("--accumulate", type=int, default=1)
    args = parser.parse_args()
    for name, path in main(args.steps, args.out, args.config, args.accumulate).items():
        print(f"{name}: {path}")
