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
        loss_fn: Mean-reduced loss ``(logits, targets) -> scalar``.
        individual_loss_fn: ``(logits, targets) -> [N]`` per-sample losses.
    """

    name: str
    model: torch.nn.Module
    inputs: Callable[[int, int], tuple[dict, torch.Tensor]]
    logits: Callable[[object], torch.Tensor]
    loss_fn: torch.nn.Module
    individual_loss_fn: torch.nn.Module


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


#: Name -> builder; each call builds the model anew (seed it first).
ZOO: dict[str, Callable[[], Case]] = {
    "bert": bert,
    "gpt2": gpt2,
    "vit": vit,
    "resnet": resnet,
    "llama": llama,
    "t5": t5,
}


def build(name: str, seed: int = 0, dtype: torch.dtype = torch.float64) -> Case:
    """Build ``ZOO[name]`` with a fixed seed in ``dtype``, in train mode."""
    torch.manual_seed(seed)
    case = ZOO[name]()
    case.model = case.model.to(dtype).train()
    return case
