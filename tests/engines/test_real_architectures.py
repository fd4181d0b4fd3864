"""The unchanged 1.0.2 loop on real architectures, first-order values by brute force.

Hugging Face BERT, GPT-2, ViT, ResNet (BatchNorm), Llama and T5 built from small
configs (``tests/utils/hf_models.py``, default attention), BERT computing its own
loss, and two models of our own whose forward code BackPACK has never seen
(children named ``output`` and ``input0``, residuals added in place to a layer's
output, ``dict`` and tuple outputs, fused attention, the loss inside ``forward``).
The loop is 1.0.2's: ``extend(model)``, ``extend(loss_fn)``, ``Cockpit(...)``,
``with cockpit(step, info=...): loss.backward(create_graph=...)``.

First-order values are compared in float64 with per-sample brute force: each
sample's loss of one full forward pass, differentiated alone by plain autograd
(so BatchNorm's mixing of the samples is part of the definition).
"""

from __future__ import annotations

import logging
import pickle
import warnings

import numpy as np
import pytest
import torch
from backpack import extend
from torch.func import functional_call

from cockpit import Cockpit
from cockpit import quantities as Q
from cockpit.errors import CockpitWarning
from cockpit.history import History
from cockpit.utils.configuration import configuration
from cockpit.utils.schedules import linear
from tests.utils.any_model import alpha_reference, first_order_reference

pytest.importorskip("transformers")

from tests.utils import hf_models  # noqa: E402 (needs transformers)

MODELS = [*hf_models.ZOO, *hf_models.MORE]
N = 3
RTOL, ATOL = 1e-8, 1e-12
BINS, RANGE = 24, (-0.2, 0.2)
BINS_2D, RANGE_2D = (8, 6), ((-0.2, 0.2), (-1.0, 1.0))


def build(name):
    case = hf_models.build(name)
    case.model = extend(case.model)
    if case.loss_fn is not None:
        case.loss_fn = extend(case.loss_fn)
    return case


def train(case, quantities, steps=2, lr=0.05):
    """The 1.0.2 loop; returns the cockpit and, per step, batch and parameters."""
    model = case.model
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    cockpit = Cockpit(model.parameters(), quantities=quantities)
    records = {}
    for step in range(steps):
        kwargs, targets = case.batch(N, step)
        opt.zero_grad()
        outputs = model(**kwargs)
        logits = case.logits(outputs)
        if case.model_loss is not None:
            loss = case.model_loss(outputs)
        else:
            loss = case.loss_fn(logits, targets)
        losses = case.individual_loss_fn(logits, targets)
        info = {"batch_size": N, "individual_losses": losses, "loss": loss,
                "optimizer": opt}  # fmt: skip
        with cockpit(step, info=info):
            loss.backward(create_graph=cockpit.create_graph(step))
        params = [p.detach().clone() for p in model.parameters()]
        records[step] = (kwargs, targets, params)
        opt.step()
    return cockpit, records


def brute_force(case, record):
    """``(G, losses)``: ``G[i] = d l_i / d theta`` ``[N, D]``, one sample at a time."""
    kwargs, targets, params = record
    names = [name for name, _ in case.model.named_parameters()]
    leaves = [p.clone().requires_grad_(True) for p in params]
    outputs = functional_call(case.model, dict(zip(names, leaves)), (), kwargs)
    losses = case.individual_loss_fn(case.logits(outputs), targets)
    rows = []
    for i in range(losses.shape[0]):
        grads = torch.autograd.grad(
            losses[i], leaves, retain_graph=True, allow_unused=True
        )
        rows.append(
            torch.cat(
                [
                    (torch.zeros_like(p) if g is None else g).reshape(-1)
                    for g, p in zip(grads, leaves)
                ]
            )
        )
    return torch.stack(rows), losses.detach()


def close(actual, expected, what):
    torch.testing.assert_close(
        torch.as_tensor(actual, dtype=torch.float64),
        torch.as_tensor(expected, dtype=torch.float64),
        rtol=RTOL,
        atol=ATOL,
        msg=lambda m: f"{what}: {m}",
    )


def histogram_1d(G):
    """numpy's histogram of the clamped values, and how many lie near an edge."""
    values = np.clip(G.reshape(-1).numpy(), *RANGE)
    counts, edges = np.histogram(values, bins=BINS, range=RANGE)
    near = np.abs(values[:, None] - edges[None, 1:-1]).min(axis=1) < 1e-9
    return counts, int(near.sum())


def histogram_2d(G, params):
    """numpy's 2-D histogram of (per-sample gradient, parameter) element pairs."""
    x = G.reshape(-1).numpy()
    y = np.broadcast_to(torch.cat([p.reshape(-1) for p in params]).numpy(), G.shape)
    y = y.reshape(-1)
    clamped = []
    for values, bins, (lo, hi) in zip((x, y), BINS_2D, RANGE_2D):
        half = (hi - lo) / bins / 2
        clamped.append(np.clip(values, lo + half, hi - half))
    counts, xedges, _ = np.histogram2d(*clamped, bins=BINS_2D, range=RANGE_2D)
    near = np.abs(clamped[0][:, None] - xedges[None, 1:-1]).min(axis=1) < 1e-9
    return counts.astype(np.int64), int(near.sum())


def first_order(*, lean: bool):
    """First-order quantities: ``lean`` ones need no per-sample gradient tensors.

    Without histograms or inner products the cockpit runs BackPACK's
    ``BatchL2Grad`` and ``SumGradSquared`` (cockpit's lean rules); with them,
    per-sample gradients.
    """
    every = linear(1)
    found = [Q.GradNorm(every), Q.Variance(every), Q.NormTest(every),
             Q.MeanGSNR(every)]  # fmt: skip
    if not lean:
        found += [
            Q.InnerTest(every),
            Q.OrthoTest(every),
            Q.GradHist1d(every, bins=BINS, range=RANGE),
            Q.GradHist2d(every, bins=BINS_2D, range=RANGE_2D),
            Q.Alpha(every),
        ]
    return found


def no_torch_warnings(caught):
    """Warnings other than cockpit's (e.g. PyTorch's on hooks of module outputs)."""
    return [
        str(w.message)[:200]
        for w in caught
        if not issubclass(w.category, CockpitWarning)
        and "Cockpit set inplace=False" not in str(w.message)
    ]


def _rms_norm_in_input_dtype(self, hidden_states):
    """Llama's and T5's RMSNorm, with the statistics in the input's dtype."""
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


@pytest.fixture
def float64_norms(monkeypatch):
    """Llama's and T5's RMSNorm compute in float64 for float64 inputs.

    Both compute the norm's statistics in float32 whatever the input's dtype, so
    in a float64 model two exact autograd paths differ in the eighth digit: the
    gradient of the mean loss and the mean of the per-sample gradients disagree
    by up to 5e-8 (Llama) and 2e-8 (T5) relative. Computed in float64 (the same
    formula), they agree to rounding, and the comparison can be at 1e-8.
    """
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.t5.modeling_t5 import T5LayerNorm

    for cls in (LlamaRMSNorm, T5LayerNorm):
        monkeypatch.setattr(cls, "forward", _rms_norm_in_input_dtype)


@pytest.mark.parametrize("lean", [False, True], ids=["per_sample", "lean"])
@pytest.mark.parametrize("name", MODELS)
def test_first_order_quantities_equal_per_sample_brute_force(name, lean, float64_norms):
    case = build(name)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cockpit, records = train(case, first_order(lean=lean), steps=1 if lean else 2)
    assert no_torch_warnings(caught) == []
    assert cockpit.coverage().problems() == []
    output = cockpit.get_output()
    params = records[0][2]
    observed = {s: brute_force(case, records[s]) for s in records}
    for step in range(1):
        G, _ = observed[step]
        values = output[step]
        for key in ["NormTest", "MeanGSNR"] + (
            [] if lean else ["InnerTest", "OrthoTest"]
        ):
            close(values[key], first_order_reference(key, G, params), key)
        for key in ["GradNorm", "Variance"]:
            want = torch.stack(first_order_reference(key, G, params))
            close(values[key], want, key)
        if lean:
            continue
        counts, near = histogram_1d(G)
        got = np.array(values["GradHist1d"]["hist"])
        assert got.sum() == counts.sum() == G.numel()
        assert np.abs(got - counts).sum() <= 2 * near, (got, counts)
        counts, near = histogram_2d(G, params)
        got = np.array(values["GradHist2d"]["hist"])
        assert got.sum() == counts.sum() == G.numel()
        assert np.abs(got - counts).sum() <= 2 * near, (got, counts)
    if not lean:
        want = alpha_reference(observed[0], observed[1], records[0][2], records[1][2])
        close(output[0]["Alpha"], want, "Alpha")


@pytest.mark.parametrize("label", ["economy", "business", "full"])
def test_the_102_loop_runs_with_every_configuration_on_every_model(label, caplog):
    """Every configuration runs; each quantity has a value or a recorded reason.

    The coverage line is said once, at the first tracked step, and agrees with
    ``cockpit.coverage()``: the engines' counts, and every quantity not exact
    named with its reason.
    """
    for name in MODELS:
        case = build(name)
        caplog.clear()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with caplog.at_level(logging.INFO, logger="cockpit"):
                cockpit, _ = train(case, configuration(label), steps=2)
        assert no_torch_warnings(caught) == [], name
        lines = [r.getMessage() for r in caplog.records if "coverage" in r.getMessage()]
        assert len(lines) == 1, (name, lines)
        check_coverage_line(lines[0], cockpit, name)
        for step in (0, 1):
            values = cockpit.history.view(step)
            missing = cockpit.history.missing_at(step) or {}
            for q in cockpit.quantities:
                if step == 1 and q.key in ("Alpha", "UpdateSize"):
                    continue  # their values of step 1 need step 2
                has = q.key in values or q.key in missing
                assert has, (name, label, step, q.key)
                if q.key in missing:
                    assert "Fix" in missing[q.key] or "fix" in missing[q.key]
            first = {"Loss", "GradNorm", "NormTest", "InnerTest", "OrthoTest",
                     "GradHist1d", "Distance"}  # fmt: skip
            assert not first & set(missing), (name, step, missing)
            # curvature with a value on every model (issue 26): the traces from
            # BackPACK, the GGN or Hutchinson; HessMaxEV from Hessian-vector
            # products (under fused attention too); TICDiag may be missing where
            # only an estimate of the diagonal exists (the reason names TICTrace)
            assert not {"HessTrace", "HessMaxEV"} & set(missing), (name, step, missing)
            if "TICDiag" in missing:
                assert "TICTrace" in missing["TICDiag"], (name, missing["TICDiag"])


def check_coverage_line(line, cockpit, name):
    """The line names the engines' counts and each quantity not exact, with why."""
    coverage = cockpit.coverage()
    for engine, count in coverage.engines().items():
        assert f"{count} from {engine}" in line, (name, line)
    worst = {}
    for row in coverage.params:
        for key, status in row.quantities.items():
            if status.kind != "exact":
                worst.setdefault(key, status)
    for key, status in worst.items():
        assert key in line, (name, key, line)
        if status.kind == "not covered":  # with its fix (or the reason)
            fix = status.how.partition("Fix: ")[2].rstrip(".")
            assert (fix or status.how) in line, (name, key, line)


def test_the_bert_example_writes_log_dashboard_and_coverage(tmp_path):
    from tests.test_examples import assert_png, load_example

    module = load_example("bert_docstrings")
    assert "python examples/bert_docstrings.py" in module.__doc__
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CockpitWarning)  # curvature not covered
        found = module.main(
            steps=3, out=str(tmp_path / "bert"), batch_size=8, track_every=2
        )
    assert_png(found["dashboard"])
    history = History.from_json(found["log"])
    assert history.steps == [0, 2]  # tracked (and logged)
    assert {"Alpha", "GradNorm", "GradHist2d", "Loss"} <= set(history.keys)
    assert found["sentences"][0] > 200 and found["sentences"][1] > 50
    assert "(40 from backpack, 1 from ghost)" in found["coverage"]


def _hooks(model):
    """BackPACK's hooks, in order (each cockpit's ghost engine adds its own)."""

    def theirs(hooks):
        return [h for h in hooks.values() if type(h).__module__ not in (GHOST, CALLS)]

    return [
        (theirs(m._forward_hooks), theirs(m._backward_hooks)) for m in model.modules()
    ]


GHOST = "cockpit.engines.ghost"
CALLS = "cockpit.engines.calls"  # the watch hook ghost and replay share


def test_the_rewiring_is_undone_when_the_last_cockpit_closes():
    """Two cockpits share the rewiring; BackPACK's hooks come back in their order."""
    case = build("bert")
    extended = _hooks(case.model)
    first = Cockpit(case.model.parameters(), quantities=first_order(lean=True))
    rewired = _hooks(case.model)
    assert rewired != extended
    second = Cockpit(case.model.parameters(), quantities=first_order(lean=True))
    assert _hooks(case.model) == rewired  # not rewired twice
    first.close()
    assert _hooks(case.model) == rewired  # the second still holds it
    copy = pickle.loads(pickle.dumps(case.model))  # e.g. torch.save(model)
    kwargs, _ = case.batch(N, 0)
    copy(**kwargs).logits.sum().backward()  # its moved hooks run, nothing breaks
    second.close()
    assert _hooks(case.model) == extended
    with pytest.raises(TypeError, match="child module 'output'"):
        case.model(**kwargs)  # BackPACK's own hooks again
