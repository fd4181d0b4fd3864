"""The GGN of the cross-entropy as the curvature where BackPACK cannot form it.

The 1.0.2 loop unchanged, default attention, ``business`` plus TICTrace, on models
BackPACK cannot backpropagate through: a hand-written text classifier (children
named ``input0`` and ``output``, residuals added in place, fused attention, a
``dict`` output) and Hugging Face BERT (ViT in ``test_curvature_real_models.py``;
ResNet in ``benchmarks/results/curvature_zoo.md``: its float64 convolutions take
seconds). With few rows times
classes (4 samples, 3 classes) the GGN diagonal is exact: HessTrace, TICTrace and
TICDiag equal their definitions on the brute-force GGN (``tests/utils/dense_ggn.py``,
float64), the step says which curvature it used (the estimate records, one
warning naming ``curvature='hutchinson'``, the coverage line). The Monte-Carlo
GGN's count rule (:func:`cockpit.curvature.source.monte_carlo`) keeps its reported
standard error honest (repeated estimates) and at most 10 %. A loss that is not a
cross-entropy keeps Hutchinson's estimate of the Hessian.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from backpack import extend

from cockpit import Cockpit
from cockpit import quantities as Q
from cockpit.errors import CockpitWarning
from cockpit.utils.configuration import configuration
from cockpit.utils.schedules import linear
from tests.utils import hf_models
from tests.utils.dense_ggn import dense_ggn
from tests.utils.hand_written import tiny_gpt


def check_exact(name, steps):
    case = hf_models.build(name, seed=1)
    quantities = configuration("business") + [Q.TICTrace(linear(1))]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("ignore", UserWarning)  # torch: hooks of frozen inputs
        warnings.simplefilter("always", CockpitWarning)
        batch = lambda step: case.batch(hf_models.BATCH, 50 + step)  # noqa: E731
        cockpit, records = hf_models.run_loop(case, quantities, steps, batch=batch)
    said = [str(w.message) for w in caught]
    said = [text for text in said if "generalised Gauss-Newton" in text]
    assert len(said) == 1 and "curvature='hutchinson'" in said[0], said
    assert "the GGN, in place of the Hessian" in cockpit.coverage().summary()
    history = cockpit.history.to_dict()
    for step, (snapshot, kwargs, targets) in records.items():
        entry = history[step]
        assert "missing" not in entry or not {"HessTrace", "TICDiag", "TICTrace"} & (
            set(entry["missing"])
        ), entry.get("missing")
        truth = dense_ggn(case, snapshot, kwargs, targets)
        got = torch.tensor(entry["HessTrace"], dtype=torch.float64)
        torch.testing.assert_close(got, truth.traces, rtol=1e-8, atol=1e-12)
        assert math.isclose(entry["TICTrace"], truth.tic_trace(), rel_tol=1e-8)
        assert math.isclose(entry["TICDiag"], truth.tic_diag(), rel_tol=1e-6)
        for key in ("HessTrace", "TICDiag", "TICTrace"):
            estimate = entry[f"{key}_estimate"]
            assert estimate["curvature"] == "ggn", key
            assert estimate["method"] == "ggn_exact", key
            assert estimate["probes"] == 12 and estimate["stderr_sum"] == 0, key


def test_hand_written_classifier_reads_the_exact_ggn():
    check_exact("text_classifier", 2)


def test_hugging_face_bert_reads_the_exact_ggn():
    pytest.importorskip("transformers")
    check_exact("bert", 1)


class SpreadKey:
    """Stands in for a quantity, under which the previous spread is kept."""


def test_monte_carlo_count_rule_reports_an_honest_error_of_at_most_ten_percent():
    """The hand-written GPT (20 tokens, 7 classes: 140 products would make it exact;
    the Monte-Carlo estimate draws labels): repeated estimates, each with the count
    rule of a tracked step (the previous estimate's spread, then the top-up to
    10 %), on a batch and seed the rule was not chosen on. Every reported relative
    error is at most 10 %, the mean squared reported error matches the variance of
    the estimates (band [0.7, 1.4]: 120 estimates of a heavy-tailed draw), and their
    mean lies within 4 standard errors of the brute-force GGN's trace."""
    from cockpit.curvature import source as curvature_source
    from cockpit.curvature.ggn import Head

    torch.manual_seed(1)
    case = tiny_gpt()
    case.model = case.model.double()
    params = [p for p in case.model.parameters() if p.requires_grad]
    kwargs, targets = case.inputs(hf_models.BATCH, 70)
    snapshot = [p.detach().clone() for p in params]
    want = float(dense_ggn(case, snapshot, kwargs, targets).traces.sum())
    logits = case.logits(case.model(**kwargs))
    head = Head(case.individual_loss_fn(logits, targets).mean(), params)
    assert head.log_p.numel() > curvature_source.EXACT_MAX_PRODUCTS
    generator = torch.Generator().manual_seed(3)
    keys = [SpreadKey()]  # where the previous spread is kept (the quantities)
    values, squared = [], []
    for _ in range(120):
        estimate = curvature_source.monte_carlo(head, keys, generator)
        sums = estimate.traces.sum(1)
        value, error = float(sums.mean()), float(sums.std() / len(sums) ** 0.5)
        assert error <= curvature_source.GOAL_RELATIVE_SE * value
        torch.testing.assert_close(
            sum(float(d.sum()) for d in estimate.diagonals), value, rtol=1e-9, atol=0
        )
        values.append(value)
        squared.append(error**2)
    values = torch.tensor(values, dtype=torch.float64)
    ratio = sum(squared) / len(squared) / float(values.var())
    assert 0.7 < ratio < 1.4, ratio
    assert abs(float(values.mean()) - want) <= 4 * float(values.std()) / 120**0.5


@pytest.mark.parametrize("loss", ["squared error", "squared cross-entropy"])
def test_a_loss_that_is_not_a_cross_entropy_keeps_the_hessian(loss):
    """Squared error on the hand-written classifier (no log_softmax: seen when the
    step is routed) or the square of the cross-entropy (not linear in the
    log-probabilities: seen when the GGN is formed, the step falls back): HessTrace
    stays Hutchinson's estimate of the Hessian, without the GGN's warning, and the
    GGN choices have no value."""
    torch.manual_seed(0)
    case = hf_models.text_classifier()
    case.model = case.model.double()

    def squared(logits, targets, reduction="mean"):
        if loss == "squared error":
            onehot = torch.nn.functional.one_hot(targets, logits.shape[1])
            per_sample = ((logits - onehot) ** 2).sum(1)
        else:
            ce = torch.nn.functional.cross_entropy(logits, targets, reduction="none")
            per_sample = ce**2
        return per_sample.mean() if reduction == "mean" else per_sample

    case.loss_fn = torch.nn.Identity()  # extend() needs a module; not called
    model = extend(case.model)
    params = [p for p in model.parameters() if p.requires_grad]
    quantities = [
        Q.HessTrace(linear(1)),
        Q.HessTrace(linear(1), curvature="diag_ggn_exact", key="GGNTrace"),
    ]
    cockpit = Cockpit(params, quantities=quantities)
    kwargs, targets = case.inputs(hf_models.BATCH, 0)
    logits = case.logits(model(**kwargs))
    info = {"batch_size": hf_models.BATCH, "loss": squared(logits, targets),
            "individual_losses": squared(logits, targets, "none")}  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("ignore", UserWarning)
        warnings.simplefilter("always", CockpitWarning)
        with cockpit(0, info=info):
            info["loss"].backward()
    assert not [w for w in caught if "generalised Gauss-Newton" in str(w.message)]
    entry = cockpit.history.to_dict()[0]
    assert entry["HessTrace_estimate"]["method"] == "hutchinson"
    assert entry["HessTrace_estimate"]["curvature"] == "hessian"
    assert "GGNTrace" in entry["missing"] and "GGNTrace" not in entry
    if loss != "squared error":
        assert "not linear in the log-probabilities" in entry["missing"]["GGNTrace"]


def test_dashboard_says_the_ggn_stood_in_for_the_hessian():
    """The Trace and TIC gauges' titles and legends name the GGN where the estimates
    say ``"curvature": "ggn"``; a Hutchinson run's say only "(estimated)"."""
    from matplotlib.figure import Figure

    from cockpit.history import History
    from cockpit.plotting import instruments

    def estimate(curvature, stderr):
        return {"method": "m", "probes": 4, "curvature": curvature,
                "stderr": stderr, "stderr_sum": sum(stderr)}  # fmt: skip

    def history(curvature):
        return History({
            step: {"HessTrace": [1.0 + step, 2.0],
                   "HessTrace_estimate": estimate(curvature, [0.1, 0.2]),
                   "TICTrace": 3.0 - step,
                   "TICTrace_estimate": estimate(curvature, [0.3])}
            for step in range(3)
        })  # fmt: skip

    for curvature, suffix in (("ggn", "(estimated, GGN)"), ("hessian", "(estimated)")):
        fig = Figure()
        trace, tic = fig.subplots(1, 2)
        instruments.plot_trace(trace, history(curvature))
        instruments.plot_tic(tic, history(curvature))
        for ax in (trace, tic):
            assert ax.get_title().endswith(suffix), ax.get_title()
            labels = [t.get_text() for t in ax.get_legend().get_texts()]
            assert any(suffix in label for label in labels), labels


def test_a_resumed_monte_carlo_ggn_is_bit_identical():
    """The hand-written GPT, HessTrace by the Monte-Carlo GGN: a run resumed from
    ``state_dict()`` after step 1 draws the labels (and the count) of the
    uninterrupted run, so steps 2-3 hold the same values and errors, bit for bit."""
    import copy

    torch.manual_seed(2)
    case = tiny_gpt()
    case.model = case.model.double()
    batches = [case.inputs(hf_models.BATCH, 80 + step) for step in range(4)]

    def steps(model, cockpit, first, last):
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.SGD(params, lr=0.05)
        for step in range(first, last):
            kwargs, targets = batches[step]
            opt.zero_grad()
            logits = case.logits(model(**kwargs))
            losses = case.individual_loss_fn(logits, targets)
            info = {"batch_size": hf_models.BATCH, "individual_losses": losses,
                    "loss": losses.mean()}  # fmt: skip
            with cockpit(step, info=info):
                info["loss"].backward()
            opt.step()

    def fresh(model):
        params = [p for p in model.parameters() if p.requires_grad]
        return Cockpit(params, quantities=[Q.HessTrace(linear(1))])

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = extend(case.model)
        whole = fresh(model)
        steps(model, whole, 0, 2)
        state, saved = whole.state_dict(), copy.deepcopy(model)
        steps(model, whole, 2, 4)
        resumed = fresh(saved)
        resumed.load_state_dict(state)
        steps(saved, resumed, 2, 4)
    want, got = whole.history.to_dict(), resumed.history.to_dict()
    for step in (2, 3):
        assert want[step]["HessTrace_estimate"]["method"] == "ggn_monte_carlo"
        assert got[step]["HessTrace"] == want[step]["HessTrace"], step
        assert got[step]["HessTrace_estimate"] == want[step]["HessTrace_estimate"]
