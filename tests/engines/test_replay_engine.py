"""The replay engine: per-sample gradients by re-running one module per sample.

Every value is compared with the definition, ``d l_i / d theta`` by plain autograd on
the full batch's graph, one sample at a time (float64), and every case says which
parameters must be replayed and which must be left to the autograd engine (random
operations, samples that mix, inputs changed in place, a module reading a tensor of
the graph that is not its input, operators ``vmap`` cannot batch).
"""

import pickle
import warnings

import pytest
import torch
from backpack import extend

from cockpit import Cockpit
from cockpit import quantities as Q
from cockpit.engines.backpack.api import quiet_backward
from cockpit.engines.replay import ReplayEngine, Replayer
from cockpit.engines.routing import PER_SAMPLE_BACKWARD, REPLAY, Router
from cockpit.needs import Need
from cockpit.quantities.base import SingleStepQuantity
from cockpit.utils.schedules import linear
from tests.utils.any_model import ARCHITECTURES, Gate, make_any_problem

DTYPE = torch.float64
N = 5


class SeqFirstAttention(torch.nn.Module):
    """Sequence-first attention with a causal mask whose length equals the batch."""

    def __init__(self, vocab=6, width=4, length=N, classes=3):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.attention = torch.nn.MultiheadAttention(width, 2)
        self.register_buffer(
            "mask", torch.triu(torch.full((length, length), float("-inf")), 1)
        )
        self.head = torch.nn.Linear(width, classes)

    def forward(self, tokens):  # tokens [N, T]; attention sees [T, N, width]
        h = self.embed(tokens).transpose(0, 1)
        h = h + self.attention(h, h, h, attn_mask=self.mask, need_weights=False)[0]
        return self.head(h.mean(0))


class SharedGate(torch.nn.Module):
    """One gate applied twice: its parameter's uses span two calls."""

    def __init__(self, width=4, classes=3):
        super().__init__()
        self.inp = torch.nn.Linear(3, width)
        self.gate = Gate(width)
        self.head = torch.nn.Linear(width, classes)

    def forward(self, x):
        return self.head(self.gate(self.gate(self.inp(x))))


class CheckpointedGate(SharedGate):
    """The gate runs once, under activation checkpointing (recomputed in backward
    passes); the layers are SharedGate's."""

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        h = checkpoint(self.gate, torch.tanh(self.inp(x)), use_reentrant=False)
        return self.head(h)


class DropoutGate(torch.nn.Module):
    """A gate followed by dropout inside one custom module (random: no replay)."""

    def __init__(self, width=4, classes=3):
        super().__init__()
        self.inp = torch.nn.Linear(3, width)
        self.w = torch.nn.Parameter(torch.randn(width, width) / width)
        self.drop = torch.nn.Dropout(0.5)
        self.head = torch.nn.Linear(width, classes)

    def forward(self, x):
        h = self.inp(x)
        return self.head(self.drop(h * torch.sigmoid(h @ self.w)))


class ReadsContext(torch.nn.Module):
    """A layer that reads a graph tensor set on it instead of taking an input."""

    def __init__(self, width):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(width) / width)
        self.context = None

    def forward(self, x):
        return x * torch.tanh(self.context * self.w)


class OutsideRead(torch.nn.Module):
    def __init__(self, width=4, classes=3):
        super().__init__()
        self.inp = torch.nn.Linear(3, width)
        self.layer = ReadsContext(width)
        self.head = torch.nn.Linear(width, classes)

    def forward(self, x):
        h = self.inp(x)
        self.layer.context = 2 * h
        return self.head(self.layer(h))


class Shift(torch.nn.Module):
    """``x + b`` (its backward keeps no input, so the input may change later)."""

    def __init__(self, width):
        super().__init__()
        self.b = torch.nn.Parameter(0.1 * torch.randn(width))

    def forward(self, x):
        return x + self.b


class InPlaceAfter(torch.nn.Module):
    """The shift's input is changed in place after the shift ran."""

    def __init__(self, width=4, classes=3):
        super().__init__()
        self.inp = torch.nn.Linear(3, width)
        self.shift = Shift(width)
        self.head = torch.nn.Linear(width, classes)

    def forward(self, x):
        h = self.inp(x)
        s = torch.tanh(self.shift(h))
        h.mul_(2)  # the shift's recorded input is no longer what it saw
        return self.head(s + h)


class BatchNormBeforeGate(torch.nn.Module):
    """BatchNorm in train mode mixes the samples: nothing can be replayed."""

    def __init__(self, width=4, classes=3):
        super().__init__()
        self.inp = torch.nn.Linear(3, width)
        self.bn = torch.nn.BatchNorm1d(width)
        self.gate = Gate(width)
        self.head = torch.nn.Linear(width, classes)

    def forward(self, x):
        return self.head(self.gate(self.bn(self.inp(x))))


def features(gen, n):
    return torch.randn(n, 3, generator=gen, dtype=DTYPE)


def tokens(gen, n):
    return torch.randint(0, 6, (n, N), generator=gen)


def transformer_tokens(gen, n):
    return torch.randint(0, 7, (n, 5), generator=gen)


GRU = ["gru.weight_ih_l0", "gru.weight_hh_l0", "gru.bias_ih_l0", "gru.bias_hh_l0"]
LINEARS = ["inp.weight", "inp.bias", "head.weight", "head.bias"]

#: name -> (model, inputs, parameters that must be replayed ("all": every one),
#: those that must be left to the autograd engine, {parameter: replaying module})
CASES = {
    "transformer": (ARCHITECTURES["transformer"][0], transformer_tokens, "all", [], {}),
    "seq-first-attention-T=N": (SeqFirstAttention, tokens, "all", [], {}),
    "tied-custom": (
        ARCHITECTURES["tied-custom"][0],
        tokens,
        "all",
        [],
        {"embed.weight": "TiedCustom"},  # tied: its uses span the whole model
    ),
    "shared-gate": (SharedGate, features, "all", [], {"gate.w": "SharedGate"}),
    # activation checkpointing around the gate
    "checkpointed": (CheckpointedGate, features, "all", [], {"gate.w": "Gate"}),
    "dropout": (DropoutGate, features, LINEARS, ["w"], {}),
    "outside-read": (OutsideRead, features, LINEARS, ["layer.w"], {}),
    # the shift's input and inp's output changed in place: the whole model replays
    "in-place-after": (
        InPlaceAfter,
        features,
        "all",
        [],
        {"shift.b": "InPlaceAfter", "inp.weight": "InPlaceAfter"},
    ),
    # samples mix in BatchNorm: only what comes after it replays
    "batchnorm-train": (
        BatchNormBeforeGate,
        features,
        ["gate.w", "head.weight", "head.bias"],
        ["inp.weight", "inp.bias", "bn.weight", "bn.bias"],
        {},
    ),
    # vmap has no batching rule for aten::gru
    "gru": (ARCHITECTURES["gru"][0], ARCHITECTURES["gru"][1], ["head.weight"], GRU, {}),
}
SEED = 3


def reference(model, x, y):
    """``d l_i / d theta`` from the batch's graph, sample by sample (definition)."""
    params = list(model.parameters())
    torch.manual_seed(SEED)  # the dropout mask of the replayed steps
    losses = torch.nn.functional.cross_entropy(model(x), y, reduction="none")
    return [
        torch.autograd.grad(losses[i], params, retain_graph=True, allow_unused=True)
        for i in range(losses.shape[0])
    ]


def replay(model, x, y, steps=2):
    """``steps`` forward passes watched by a :class:`Replayer`; the last's results.

    Returns:
        ``position -> [N, *shape]`` and ``position -> class of the replayed module``.
    """
    params = list(model.parameters())
    replayer = Replayer(Router(params).chain)
    replayer.watch_chains(params)
    for _ in range(steps):
        torch.manual_seed(SEED)
        losses = torch.nn.functional.cross_entropy(model(x), y, reduction="none")
        with quiet_backward():
            found = dict(replayer.per_sample_gradients(losses, params, 1 << 26))
        who = dict(replayer.module_of)
        replayer.forget()
    replayer.close()
    return found, who


@pytest.mark.parametrize("case", sorted(CASES))
def test_replayed_gradients_are_the_per_sample_gradients(case):
    factory, make_input, replayed, left, modules = CASES[case]
    torch.manual_seed(0)
    model = factory().to(DTYPE)
    gen = torch.Generator().manual_seed(1)
    x, y = make_input(gen, N), torch.randint(0, 3, (N,), generator=gen)
    names = [n for n, _ in model.named_parameters()]
    found, who = replay(model, x, y)
    expected = reference(model, x, y)
    got = {names[i] for i in found}
    assert got == set(names) if replayed == "all" else set(replayed) <= got
    assert not got & set(left), f"replayed what it must not: {got & set(left)}"
    for name, module in modules.items():
        assert who[names.index(name)] == module
    for i, grads in found.items():
        want = torch.stack(
            [
                torch.zeros_like(model.get_parameter(names[i]))
                if row[i] is None
                else row[i]
                for row in expected
            ]
        )
        torch.testing.assert_close(grads, want, rtol=1e-10, atol=1e-12)


def test_replay_leaves_no_hook_state_behind():
    factory, make_input, *_ = CASES["transformer"]
    torch.manual_seed(0)
    model = extend(factory().to(DTYPE))
    gen = torch.Generator().manual_seed(1)
    x, y = make_input(gen, N), torch.randint(0, 3, (N,), generator=gen)
    before = {
        id(m): (len(m._forward_hooks), len(m._backward_hooks)) for m in model.modules()
    }
    cockpit = Cockpit(model.parameters(), quantities=[Q.Variance(linear(1))])
    loss_fn = extend(torch.nn.CrossEntropyLoss())
    for step in range(2):
        model.zero_grad()
        out = model(x)
        stored = {id(m): m.output for m in model.modules() if hasattr(m, "output")}
        loss = loss_fn(out, y)
        losses = torch.nn.functional.cross_entropy(out, y, reduction="none")
        with cockpit(step, info={"batch_size": N, "individual_losses": losses}):
            # BackPACK's stored outputs are the forward pass's, not the replay's
            for m in model.modules():
                if id(m) in stored:
                    assert m.output is stored[id(m)]
            loss.backward()
        assert not cockpit._router.engine(
            ReplayEngine
        ).replayer.recorder.calls  # nothing held between steps
    methods = {row.route.method for row in cockpit.coverage().params}
    assert f"{REPLAY} TransformerBlock" in methods
    cockpit.close()
    after = {
        id(m): (len(m._forward_hooks), len(m._backward_hooks)) for m in model.modules()
    }
    assert after == before
    assert "replay of TransformerBlock" in str(cockpit.coverage())


def test_a_watched_model_still_pickles():
    torch.manual_seed(0)
    model = ARCHITECTURES["tied-custom"][0]().to(DTYPE)
    Cockpit(model.parameters(), quantities=[Q.Variance(linear(1))])
    copy = pickle.loads(pickle.dumps(model))  # e.g. torch.save(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        copy(torch.randint(0, 6, (2, 3)))  # its hooks do nothing


def test_coverage_names_the_method_of_each_autograd_parameter():
    problem = make_any_problem("lstm-seq-first-t3")
    model = problem.model
    cockpit = Cockpit(model.named_parameters(), quantities=[Q.Variance(linear(1))])
    optimizer = problem.make_optimizer(model.parameters())
    for step in range(2):
        x, y = problem.make_batch(step)
        optimizer.zero_grad()
        out = model(x)
        loss = problem.loss_fn(out, y)
        losses = problem.individual_loss_fn(out, y)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with cockpit(
                step, info={"batch_size": len(y), "individual_losses": losses}
            ):
                loss.backward()
        optimizer.step()
    rows = {row.label: row.route for row in cockpit.coverage().params}
    lstm = [r for label, r in rows.items() if "lstm" in label]
    per_step = [r for label, r in rows.items() if "per_step" in label]
    # vmap cannot batch aten::lstm: the LSTM stays with the backward per sample;
    # the Linear on the sequence-first output is watched from the second step on
    assert lstm and all(r.method == PER_SAMPLE_BACKWARD for r in lstm)
    assert per_step and all(r.method == f"{REPLAY} Linear" for r in per_step)


class Remembers(torch.nn.Module):
    """Keeps its last attention-like weights on ``self`` (as code that plots does)."""

    def __init__(self, width):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(width, width) / width)
        self.last = None

    def forward(self, x):
        self.last = torch.softmax(x @ self.w, dim=-1)
        return x * self.last


class StatefulModel(torch.nn.Module):
    """BatchNorm in train mode inside the module that holds a raw scale."""

    def __init__(self, width=4, classes=3):
        super().__init__()
        self.bn = torch.nn.BatchNorm2d(1, affine=False)
        self.conv = torch.nn.Conv2d(1, width, 3)
        self.scale = torch.nn.Parameter(torch.ones(width))
        self.remember = Remembers(width)
        self.head = torch.nn.Linear(width, classes)

    def forward(self, x):
        h = self.conv(self.bn(x)).mean(dim=(2, 3)) * self.scale
        return self.head(self.remember(h))


def test_a_replay_leaves_no_trace_on_the_model():
    """Buffers (BatchNorm's statistics and counter) and attributes a forward sets on
    ``self`` are the training's own after tracked steps, not the replay's."""
    torch.manual_seed(0)
    model = extend(StatefulModel().to(DTYPE))
    twin = StatefulModel().to(DTYPE)
    twin.load_state_dict(model.state_dict())
    cockpit = Cockpit(model.parameters(), quantities=[Q.Variance(linear(1))])
    loss_fn = extend(torch.nn.CrossEntropyLoss())
    gen = torch.Generator().manual_seed(1)
    for step in range(3):
        x = torch.randn(N, 1, 5, 5, generator=gen, dtype=DTYPE)
        y = torch.randint(0, 3, (N,), generator=gen)
        model.zero_grad()
        out = model(x)
        kept = model.remember.last
        losses = torch.nn.functional.cross_entropy(out, y, reduction="none")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with cockpit(step, info={"batch_size": N, "individual_losses": losses}):
                loss_fn(out, y).backward()
        assert model.remember.last is kept  # not a tensor of the replay
        twin(x)
        for name, buffer in twin.named_buffers():
            torch.testing.assert_close(model.get_buffer(name), buffer, rtol=0, atol=0)
    methods = {row.route.module: row.route.method for row in cockpit.coverage().params}
    # the remembering layer is replayed alone (after the BatchNorm, samples do not
    # mix); the module holding the BatchNorm changes buffers and is refused
    assert methods["Remembers.w"] == f"{REPLAY} Remembers"
    assert methods["StatefulModel.scale"] == PER_SAMPLE_BACKWARD


class Split(torch.nn.Module):
    """Two outputs from raw parameters: ``(x * a, x * b)``."""

    def __init__(self, width):
        super().__init__()
        self.a = torch.nn.Parameter(torch.randn(width))
        self.b = torch.nn.Parameter(torch.randn(width))

    def forward(self, x):
        return x * self.a, x * self.b


class Branches(torch.nn.Module):
    def __init__(self, width=4, classes=3):
        super().__init__()
        self.inp = torch.nn.Linear(3, width)
        self.split = Split(width)
        self.head = torch.nn.Linear(width, classes)
        self.both = True

    def forward(self, x):
        first, second = self.split(torch.tanh(self.inp(x)))
        return self.head(first + second if self.both else first)


def test_an_output_the_losses_stop_using_gets_zero_gradients():
    """A layout found while both outputs mattered is reused when one no longer
    does (same shapes): that output's gradient is zero, not an error."""
    torch.manual_seed(0)
    model = Branches().to(DTYPE)
    names = [n for n, _ in model.named_parameters()]
    params = list(model.parameters())
    replayer = Replayer(Router(params).chain)
    replayer.watch_chains(params)
    gen = torch.Generator().manual_seed(1)
    x, y = features(gen, N), torch.randint(0, 3, (N,), generator=gen)
    for both in (True, False):
        model.both = both
        losses = torch.nn.functional.cross_entropy(model(x), y, reduction="none")
        found = dict(replayer.per_sample_gradients(losses, params, 1 << 26))
        who = dict(replayer.module_of)
        replayer.forget()
        expected = reference(model, x, y)
        assert who[names.index("split.a")] == "Split"
        for i, grads in found.items():
            want = torch.stack(
                [
                    torch.zeros_like(params[i]) if row[i] is None else row[i]
                    for row in expected
                ]
            )
            torch.testing.assert_close(grads, want, rtol=1e-10, atol=1e-12)
    # at the second step split.b is unused (the router gives it zeros); split.a
    # was replayed with the first step's layout, the second output's gradient zero
    assert names.index("split.a") in found and names.index("split.b") not in found


# --- the layout search: once per module, shapes and modes; never for BatchNorm -------
class _Gated(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(3, 4))

    def forward(self, x):
        return torch.tanh(x @ self.w)


class _Middle(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.gated = _Gated()

    def forward(self, x):
        return self.gated(x) + 1.0


class _Outer(torch.nn.Module):
    """Runs the batch in reverse order through ``middle`` and restores the order
    (as code that sorts a batch by length does): ``w``'s owner and the module around
    it see sample ``i``'s loss in slice ``N - 1 - i`` and cannot replay; the whole
    model can."""

    def __init__(self):
        super().__init__()
        self.middle = _Middle()
        self.head = torch.nn.Linear(4, 3)

    def forward(self, x):
        return self.head(self.middle(x.flip(0)).flip(0))


def _count_layout_searches(monkeypatch) -> list:
    searched = []
    original = Replayer._find_layout

    def counted(self, module, *args):
        searched.append(type(module).__name__)
        return original(self, module, *args)

    monkeypatch.setattr(Replayer, "_find_layout", counted)
    return searched


def test_a_refused_module_is_searched_once_and_its_container_at_the_same_step(
    monkeypatch,
):
    """``w``'s owner and the module around it cannot replay, the outer module can:
    all three are searched at the first step, which already replays ``w`` exactly;
    later steps search nothing."""
    searched = _count_layout_searches(monkeypatch)
    torch.manual_seed(0)
    model = _Outer().to(DTYPE)
    params = list(model.parameters())
    replayer = Replayer(Router(params).chain)
    replayer.watch_chains(params)
    gen = torch.Generator().manual_seed(1)
    per_step = []
    for _ in range(3):
        x, y = features(gen, N), torch.randint(0, 3, (N,), generator=gen)
        losses = torch.nn.functional.cross_entropy(model(x), y, reduction="none")
        with quiet_backward():
            found = dict(replayer.per_sample_gradients(losses, params, 1 << 26))
        assert replayer.module_of[0] == "_Outer"  # w, from the first step on
        want = torch.stack(
            [
                torch.autograd.grad(loss, params[0], retain_graph=True)[0]
                for loss in losses
            ]
        )
        torch.testing.assert_close(found[0], want, rtol=1e-10, atol=1e-12)
        replayer.forget()
        per_step.append(len(searched))
        searched.clear()
    replayer.close()
    assert per_step[0] >= 3 and per_step[1:] == [0, 0], per_step


class _NestedBatchNorms(torch.nn.Module):
    """conv-BN-ReLU-conv-BN with a residual, a second block, a head (nested BNs)."""

    def __init__(self, width=3):
        super().__init__()
        self.stem = torch.nn.Conv2d(1, width, 3, padding=1)

        def block():
            return torch.nn.ModuleDict(
                {
                    "conv1": torch.nn.Conv2d(width, width, 3, padding=1, bias=False),
                    "bn1": torch.nn.BatchNorm2d(width),
                    "conv2": torch.nn.Conv2d(width, width, 3, padding=1, bias=False),
                    "bn2": torch.nn.BatchNorm2d(width),
                }
            )

        self.blocks = torch.nn.ModuleList([block(), block()])
        self.head = torch.nn.Linear(width, 3)

    def forward(self, x):
        h = self.stem(x)
        for b in self.blocks:
            out = torch.relu(b["bn1"](b["conv1"](h)))
            h = torch.relu(b["bn2"](b["conv2"](out)) + h)
        return self.head(h.mean((2, 3)))


def test_parameters_before_a_train_mode_batch_norm_are_never_searched(monkeypatch):
    """Replaying a module sample by sample cannot reproduce mini-batch statistics:
    no layout is searched for the parameters before a batch norm, at any step, and
    every per-sample gradient is exact (the batched backward per sample)."""
    searched = _count_layout_searches(monkeypatch)
    torch.manual_seed(0)
    model = extend(_NestedBatchNorms().to(DTYPE))
    params = list(model.parameters())
    kept = {}

    class Keep(SingleStepQuantity):
        needs = frozenset({Need.INDIVIDUAL_GRADIENTS})
        Accumulator = Q.PerParameter

        def accumulate(self, global_step, view):
            kept[view.index] = self.acc.entries[view.index] = (
                view.individual_gradients()
            )

        def _compute(self, global_step, ctx):
            return len(self.acc.entries)

    cockpit = Cockpit(params, quantities=[Keep(linear(1))])
    loss_fn = extend(torch.nn.CrossEntropyLoss())
    gen = torch.Generator().manual_seed(1)
    for step in range(3):
        x = torch.randn(N, 1, 4, 4, generator=gen, dtype=DTYPE)
        y = torch.randint(0, 3, (N,), generator=gen)
        model.zero_grad()
        out = model(x)
        losses = torch.nn.functional.cross_entropy(out, y, reduction="none")
        info = {"batch_size": N, "individual_losses": losses, "loss": loss_fn(out, y)}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with cockpit(step, info=info):
                info["loss"].backward()
        assert searched == [], (step, searched)
        losses = torch.nn.functional.cross_entropy(model(x), y, reduction="none")
        for index, p in enumerate(params):  # by definition, sample by sample
            w = torch.stack(
                [torch.autograd.grad(li, p, retain_graph=True)[0] for li in losses]
            )
            torch.testing.assert_close(kept[index], w, rtol=1e-10, atol=1e-12)
    cockpit.close()
