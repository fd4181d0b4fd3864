"""Fine-tune a small BERT on Python's own docstrings, with the 1.0.2 loop unchanged.

Which standard-library module is a docstring sentence from: ``math``,
``statistics``, ``pathlib`` or ``threading``? The sentences are the docstrings of
the functions and classes these modules define (they ship with Python; the exact
text depends on its version), lower-cased and split into words; the vocabulary is
built here. The model is Hugging Face's ``BertForSequenceClassification`` built
from a ``BertConfig`` (random weights, nothing downloaded), with its default
attention (``F.scaled_dot_product_attention``), dropout and padding masks.

The training loop is cockpit-for-pytorch 1.0.2's, unchanged::

    model = extend(bert)
    loss_fn = extend(nn.CrossEntropyLoss())
    cockpit = Cockpit(model.parameters(), quantities=configuration("full"))
    ...
    with cockpit(step, info={"batch_size": ..., "individual_losses": ...,
                             "loss": loss, "optimizer": opt}):
        loss.backward(create_graph=cockpit.create_graph(step))

BERT's attention blocks have a child module named ``output``, where BackPACK would
store a module's output; cockpit takes BackPACK's hooks off such containers when it
is made, and the coverage line (printed once) says which engine computes what.

Run: ``python examples/bert_docstrings.py [--steps 150] [--out bert_docstrings]
[--config full]``; needs ``transformers`` (the test extra). Writes
``<out>/log.json`` and ``<out>/dashboard.png``; a progress bar shows on a terminal.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import logging
import re
import sys
import warnings
from collections import Counter
from pathlib import Path

import torch
from backpack import extend
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from cockpit import Cockpit, CockpitPlotter
from cockpit.utils.configuration import configuration
from cockpit.utils.schedules import linear

MODULES = ("math", "statistics", "pathlib", "threading")
LENGTH = 16  # tokens per sentence, [CLS] included
PAD, UNKNOWN, CLS = 0, 1, 2


def docstring_sentences(names=MODULES) -> list[tuple[list[str], int]]:
    """``(words, label)`` of every sentence of the modules' own docstrings.

    Docstrings of what each module defines (functions, classes and their
    methods); sentences of four words or more; duplicates dropped.
    """
    found: dict[tuple[str, ...], int] = {}
    for label, name in enumerate(names):
        module = importlib.import_module(name)
        for _, member in inspect.getmembers(module):
            if getattr(member, "__module__", None) != name:
                continue
            docs = [inspect.getdoc(member)]
            if inspect.isclass(member):
                docs += [inspect.getdoc(m) for m in vars(member).values()]
            for doc in filter(None, docs):
                for sentence in re.split(r"(?<=[.!?])\s+|\n\s*\n", doc):
                    words = tuple(re.findall(r"[a-z]+", sentence.lower()))
                    if len(words) >= 4:
                        found.setdefault(words, label)
    return [(list(words), label) for words, label in found.items()]


def encode(sentences, vocabulary=None):
    """Token ids ``[S, LENGTH]``, attention masks and the vocabulary.

    The vocabulary holds the words seen at least twice (others are unknown).
    """
    if vocabulary is None:
        counts = Counter(w for words, _ in sentences for w in words)
        common = sorted(w for w, c in counts.items() if c >= 2)
        vocabulary = {w: i + 3 for i, w in enumerate(common)}
    ids = torch.full((len(sentences), LENGTH), PAD)
    for row, (words, _) in enumerate(sentences):
        tokens = [CLS] + [vocabulary.get(w, UNKNOWN) for w in words][: LENGTH - 1]
        ids[row, : len(tokens)] = torch.tensor(tokens)
    labels = torch.tensor([label for _, label in sentences])
    return ids, (ids != PAD).long(), labels, vocabulary


def small_bert(vocab: int, classes: int):
    """A two-layer BERT with 32 hidden units from a config (no download)."""
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=LENGTH, num_labels=classes,
    )  # fmt: skip
    return BertForSequenceClassification(config)


def main(
    steps: int = 150,
    out: str = "bert_docstrings",
    config: str = "full",
    batch_size: int = 32,
    track_every: int = 10,
    seed: int = 0,
) -> dict:
    """Train, write the log and the dashboard; return paths, accuracy, coverage.

    Args:
        steps: Optimizer steps.
        out: Output folder.
        config: Cockpit configuration (``economy``, ``business``, ``full``).
        batch_size: Sentences per step.
        track_every: Track every this many steps (``linear(track_every)``).
        seed: Seed of the model, the split and the batches.
    """
    torch.manual_seed(seed)
    sentences = docstring_sentences()
    order = torch.randperm(len(sentences), generator=torch.Generator().manual_seed(0))
    held_out = set(order[: len(sentences) // 5].tolist())
    train = [s for i, s in enumerate(sentences) if i not in held_out]
    test = [s for i, s in enumerate(sentences) if i in held_out]
    ids, masks, labels, vocabulary = encode(train)
    test_ids, test_masks, test_labels, _ = encode(test, vocabulary)

    model = extend(small_bert(len(vocabulary) + 3, len(MODULES)))
    loss_fn = extend(torch.nn.CrossEntropyLoss())
    individual_loss_fn = torch.nn.CrossEntropyLoss(reduction="none")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    quantities = configuration(config, track_schedule=linear(track_every))
    cockpit = Cockpit(model.parameters(), quantities=quantities)

    generator = torch.Generator().manual_seed(seed)
    bar = tqdm(range(steps), desc="bert_docstrings", disable=None)
    logger = logging.getLogger("cockpit")  # the coverage line above the bar
    redirect = logging_redirect_tqdm([logger], tqdm_class=type(bar))
    with redirect, warnings.catch_warnings():
        # expected with create_graph=True (HessMaxEV): cockpit breaks the cycle
        warnings.filterwarnings("ignore", r"Using backward\(\) with create_graph")
        for step in bar:
            model.train()
            batch = torch.randint(0, len(labels), (batch_size,), generator=generator)
            opt.zero_grad()
            logits = model(input_ids=ids[batch], attention_mask=masks[batch]).logits
            loss = loss_fn(logits, labels[batch])
            losses = individual_loss_fn(logits, labels[batch])
            info = {"batch_size": batch_size, "individual_losses": losses,
                    "loss": loss, "optimizer": opt}  # fmt: skip
            with cockpit(step, info=info):
                loss.backward(create_graph=cockpit.create_graph(step))
            opt.step()
            bar.set_postfix(loss=f"{loss.item():.3f}", refresh=False)
            if step % 25 == 0 or step == steps - 1:
                accuracy = _accuracy(model, test_ids, test_masks, test_labels)
                cockpit.log(step, 0, None, None, None, None, accuracy, None,
                            opt.param_groups[0]["lr"])  # fmt: skip

    Path(out).mkdir(parents=True, exist_ok=True)
    logpath = cockpit.write(f"{out}/log")
    plotter = CockpitPlotter()
    plotter.plot(cockpit, show_plot=False, plot_title="BERT on Python's docstrings")
    (dashboard,) = plotter.save(f"{out}/dashboard.png")
    return {
        "log": str(logpath),
        "dashboard": dashboard,
        "accuracy": accuracy,
        "sentences": (len(train), len(test)),
        "coverage": cockpit.coverage().summary(),
    }


@torch.no_grad()
def _accuracy(model, ids, masks, labels) -> float:
    model.eval()
    logits = model(input_ids=ids, attention_mask=masks).logits
    return float((logits.argmax(1) == labels).float().mean())


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--out", default="bert_docstrings")
    parser.add_argument("--config", default="full")
    args = parser.parse_args()
    found = main(args.steps, args.out, args.config)
    print(f"held-out accuracy: {found['accuracy']:.2f} "
          f"({found['sentences'][0]} training, {found['sentences'][1]} held-out "
          f"sentences, {len(MODULES)} classes)")  # fmt: skip
    print(f"log: {found['log']}\ndashboard: {found['dashboard']}", file=sys.stdout)
