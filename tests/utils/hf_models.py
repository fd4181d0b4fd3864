"""Real architectures built from small configs, for the unchanged 1.0.2 loop.

Each entry of :data:`ZOO` builds a Hugging Face model with random weights (no
download), a batch for it and the loss the 1.0.2 loop computes from its outputs:
a mean-reduced ``loss_fn(outputs, targets)`` and the per-sample losses
``individual_loss_fn(outputs, targets)`` (one value per sample: token losses are
averaged within a sample). ``transformers`` is a test extra; import this module
only where it is installed (``pytest.importorskip("transformers")``).

The models keep their library defaults (attention implementation included), so
what a test meets here is what a user meets.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

BATCH = 4
LENGTH = 6
VOCAB = 23


class SequenceLoss(torch.nn.Module):
    """Cross-entropy of ``[N, T, C]`` logits, the mean over tokens per sample.

    ``reduction="mean"`` averages the per-sample losses, so the mini-batch loss is
    the mean of the per-sample losses, as cockpit's per-sample statistics assume.
    """

    def __init__(self, reduction: str = "mean"):
        super().__init__()
        self.reduction = reduction

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        per_token = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), targets.flatten(), reduction="none"
        ).view(targets.shape)
        per_sample = per_token.mean(1)
        return per_sample.mean() if self.reduction == "mean" else per_sample


@dataclass
class Case:
    """A model, how to call it, and the loss of the 1.0.2 loop.

    Attributes:
        name: Short name (``"bert"``).
        model: The model, in train mode, dropout off.
        inputs: ``batch(n, seed) -> (kwargs of model(...), targets)``.
        logits: ``outputs -> tensor`` the loss reads (``outputs.logits``).
        loss_fn: Mean-reduced loss ``(logits, targets) -> scalar`` (``None``
            where the model computes its loss itself).
        individual_loss_fn: ``(logits, targets) -> [N]`` per-sample losses.
        model_loss: ``outputs -> scalar``, the mean-reduced loss the model
            computed in ``forward`` from ``labels=targets`` (``None``: it does
            not; the loop calls ``loss_fn``).
    """

    name: str
    model: torch.nn.Module
    inputs: Callable[[int, int], tuple[dict, torch.Tensor]]
    logits: Callable[[object], torch.Tensor]
    loss_fn: torch.nn.Module | None
    individual_loss_fn: torch.nn.Module
    model_loss: Callable[[object], torch.Tensor] | None = None

    def batch(self, n: int, seed: int) -> tuple[dict, torch.Tensor]:
        """``inputs(n, seed)`` with floating-point inputs in the model's dtype.

        A model that computes its loss itself (``model_loss``) gets the targets
        as ``labels=`` too.
        """
        dtype = next(self.model.parameters()).dtype
        kwargs, targets = self.inputs(n, seed)
        kwargs = {
            k: v.to(dtype) if torch.is_floating_point(v) else v
            for k, v in kwargs.items()
        }
        if self.model_loss is not None:
            kwargs["labels"] = targets
        return kwargs, targets


def _tokens(n: int, seed: int, classes: int | None = None):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (n, LENGTH), generator=gen)
    if classes is None:  # language modelling: predict the next token
        return {"input_ids": ids}, torch.roll(ids, -1, dims=1)
    return {"input_ids": ids}, torch.randint(0, classes, (n,), generator=gen)


def _images(n: int, seed: int, channels=3, size=8, classes=3):
    gen = torch.Generator().manual_seed(seed)
    pixels = torch.randn(n, channels, size, size, generator=gen)
    return {"pixel_values": pixels}, torch.randint(0, classes, (n,), generator=gen)


def _classification(name, model, inputs):
    return Case(
        name,
        model,
        inputs,
        lambda out: out.logits,
        torch.nn.CrossEntropyLoss(),
        torch.nn.CrossEntropyLoss(reduction="none"),
    )


def _language_model(name, model, inputs):
    return Case(
        name,
        model,
        inputs,
        lambda out: out.logits,
        SequenceLoss(),
        SequenceLoss(reduction="none"),
    )


def bert() -> Case:
    """BERT for sequence classification (child modules named ``output``)."""
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=16, num_labels=3,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    model = BertForSequenceClassification(config)
    return _classification("bert", model, lambda n, s: _tokens(n, s, classes=3))


def gpt2() -> Case:
    """GPT-2 language model (tied input and output embedding, Conv1D layers)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=2, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return _language_model("gpt2", GPT2LMHeadModel(config), _tokens)


def vit() -> Case:
    """Vision transformer for image classification (raw position parameter)."""
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(
        image_size=8, patch_size=4, num_channels=3, hidden_size=16,
        num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
        num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    return _classification("vit", ViTForImageClassification(config), _images)


def resnet() -> Case:
    """ResNet with BatchNorm in train mode (in-place residual ``+=``)."""
    from transformers import ResNetConfig, ResNetForImageClassification

    config = ResNetConfig(
        num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
        layer_type="basic", num_labels=3,
    )  # fmt: skip
    return _classification("resnet", ResNetForImageClassification(config), _images)


def llama() -> Case:
    """Llama language model (RMSNorm, rotary embeddings, gated MLP)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16,
    )  # fmt: skip
    return _language_model("llama", LlamaForCausalLM(config), _tokens)


def t5() -> Case:
    """T5 encoder-decoder (relative position biases, a shared embedding)."""
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(
        vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=1,
        num_decoder_layers=1, num_heads=2, dropout_rate=0.0,
        decoder_start_token_id=0, pad_token_id=0,
    )  # fmt: skip

    def inputs(n: int, seed: int):
        kwargs, targets = _tokens(n, seed)
        kwargs["decoder_input_ids"] = torch.roll(targets, 1, dims=1)
        return kwargs, targets

    return _language_model("t5", T5ForConditionalGeneration(config), inputs)


def bert_own_loss() -> Case:
    """BERT computing its loss itself (``labels=``), as Hugging Face models do."""
    case = bert()
    case.name, case.loss_fn = "bert_own_loss", None
    case.model_loss = lambda out: out.loss
    return case


# --- hand-written models: forward code BackPACK has never seen ------------------------
class AttentionBlock(torch.nn.Module):
    """Pre-norm block with fused attention and children named ``input0``/``output``.

    ``input0`` projects to queries, keys and values, ``output`` back; the residual
    is added in place to ``output``'s result (``h += x``), and the MLP's result
    too. BackPACK would store this block's input as ``input0`` and its output as
    ``output``, the names of two of its children.
    """

    def __init__(self, width: int, heads: int = 2):
        super().__init__()
        self.heads = heads
        self.norm = torch.nn.LayerNorm(width)
        self.input0 = torch.nn.Linear(width, 3 * width)
        self.output = torch.nn.Linear(width, width)
        self.mlp = torch.nn.Sequential(
            torch.nn.LayerNorm(width),
            torch.nn.Linear(width, 2 * width),
            torch.nn.GELU(),
            torch.nn.Linear(2 * width, width),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, width = x.shape
        q, k, v = self.input0(self.norm(x)).split(width, dim=-1)
        q, k, v = (z.view(n, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
        attended = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True
        )
        h = self.output(attended.transpose(1, 2).reshape(n, t, width))
        h += x  # in place, on a layer's output
        out = self.mlp(h)
        out += h
        return out


class TextClassifier(torch.nn.Module):
    """Token classifier of :class:`AttentionBlock` s returning a ``dict``."""

    def __init__(self, width: int = 8, classes: int = 3):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, width)
        self.position = torch.nn.Parameter(0.1 * torch.randn(LENGTH, width))
        self.blocks = torch.nn.ModuleList(AttentionBlock(width) for _ in range(2))
        self.output = torch.nn.Linear(width, classes)

    def forward(self, input_ids: torch.Tensor) -> dict:
        h = self.embed(input_ids) + self.position
        for block in self.blocks:
            h = block(h)
        return {"logits": self.output(h.mean(1)), "hidden": h}


def text_classifier() -> Case:
    """:class:`TextClassifier`: ``dict`` output, ``output``/``input0`` children."""
    return Case(
        "text_classifier",
        TextClassifier(),
        lambda n, s: _tokens(n, s, classes=3),
        lambda out: out["logits"],
        torch.nn.CrossEntropyLoss(),
        torch.nn.CrossEntropyLoss(reduction="none"),
    )


class ConvBlock(torch.nn.Module):
    """Conv-BatchNorm twice; the skip is added in place to BatchNorm's output."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(channels)
        self.conv2 = torch.nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(channels)
        self.act = torch.nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.act(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += x  # as torchvision's BasicBlock
        return self.act(out)


class ConvNetWithLoss(torch.nn.Module):
    """A residual CNN that computes its loss in ``forward``: ``(loss, logits)``.

    The stem is a child named ``input0``, the head one named ``output``, the
    loss an ``nn.CrossEntropyLoss`` child.
    """

    def __init__(self, channels: int = 4, classes: int = 3):
        super().__init__()
        self.input0 = torch.nn.Conv2d(3, channels, 3, padding=1)
        self.block = ConvBlock(channels)
        self.norm = torch.nn.GroupNorm(2, channels)
        self.output = torch.nn.Linear(channels, classes)
        self.loss = torch.nn.CrossEntropyLoss()

    def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor):
        h = self.norm(self.block(self.input0(pixel_values)))
        logits = self.output(h.mean(dim=(2, 3)))
        return self.loss(logits, labels), logits


def conv_with_loss() -> Case:
    """:class:`ConvNetWithLoss`: loss in ``forward``, BatchNorm, in-place skip."""
    return Case(
        "conv_with_loss",
        ConvNetWithLoss(),
        _images,
        lambda out: out[1],
        None,
        torch.nn.CrossEntropyLoss(reduction="none"),
        model_loss=lambda out: out[0],
    )


#: Name -> builder; each call builds the model anew (seed it first).
ZOO: dict[str, Callable[[], Case]] = {
    "bert": bert,
    "gpt2": gpt2,
    "vit": vit,
    "resnet": resnet,
    "llama": llama,
    "t5": t5,
}

#: Models of our own, with forward code BackPACK has never seen (no transformers
#: needed), and BERT computing its loss itself.
MORE: dict[str, Callable[[], Case]] = {
    "text_classifier": text_classifier,
    "conv_with_loss": conv_with_loss,
    "bert_own_loss": bert_own_loss,
}


def build(name: str, seed: int = 0, dtype: torch.dtype = torch.float64) -> Case:
    """Build ``ZOO[name]`` (or ``MORE[name]``), seeded, in ``dtype``, train mode."""
    torch.manual_seed(seed)
    case = {**ZOO, **MORE}[name]()
    case.model = case.model.to(dtype).train()
    return case


def run_loop(case: Case, quantities, steps=2, lr=0.05, batch=None):
    """The 1.0.2 loop, unchanged, on ``case``; parameters and batches per step.

    Args:
        case: The model, its losses and its inputs.
        quantities: The cockpit's quantities.
        steps: Training steps (SGD with learning rate ``lr``).
        lr: The learning rate.
        batch: ``step -> (kwargs, targets)`` (default ``case.inputs(BATCH, step)``).

    Returns:
        The cockpit, and per step ``(parameters during the backward pass, kwargs,
        targets)``.
    """
    from backpack import extend

    from cockpit import Cockpit

    batch = batch or (lambda step: case.inputs(BATCH, step))
    model, loss_fn = extend(case.model), extend(case.loss_fn)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=lr)
    cockpit = Cockpit(params, quantities=quantities)
    records = {}
    for step in range(steps):
        kwargs, targets = batch(step)
        opt.zero_grad()
        logits = case.logits(model(**kwargs))
        loss = loss_fn(logits, targets)
        losses = case.individual_loss_fn(logits, targets)
        info = {"batch_size": BATCH, "individual_losses": losses,
                "loss": loss, "optimizer": opt}  # fmt: skip
        with cockpit(step, info=info):
            loss.backward(create_graph=cockpit.create_graph(step))
        records[step] = ([p.detach().clone() for p in params], kwargs, targets)
        opt.step()
    return cockpit, records
