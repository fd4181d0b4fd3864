"""Diagnosis: findings on small runs with injected bugs, on made-up histories, live."""

from __future__ import annotations

import dataclasses
import json
import math
import warnings

import numpy as np
import pytest

from cockpit.diagnosis import (
    CHECK_IDS,
    NOT_CHECKED,
    Finding,
    LiveDiagnosis,
    Thresholds,
    diagnose,
    step_signals,
)
from cockpit.errors import CockpitWarning
from cockpit.history import History


def reported(findings) -> dict[str, str]:
    """``{id: severity}`` of the findings at warning or error."""
    return {f.id: f.severity for f in findings if f.severity != "info"}


# --- made-up histories -------------------------------------------------------------
def made_up(
    n: int = 60,
    loss=None,
    alpha=None,
    grad_norms=None,
    update=None,
    edge: float = 0.0,
    norm_test=None,
    seed: int = 0,
) -> History:
    """A history that looks like a healthy economy run unless told otherwise."""
    rng = np.random.default_rng(seed)
    steps = np.arange(n)
    loss = 2.3 * np.exp(-steps / 30) + 0.1 if loss is None else np.asarray(loss)
    alpha = rng.normal(-0.2, 0.3, n) if alpha is None else np.asarray(alpha)
    if grad_norms is None:
        grad_norms = np.outer(np.ones(n), [0.5, 0.2, 0.4, 0.1])
    update = np.full(n, 0.1) if update is None else np.asarray(update)
    norm_test = rng.uniform(0.7, 0.9, n) if norm_test is None else norm_test
    data = {}
    for t in steps:
        hist = np.zeros(20)
        hist[10] = 1000 * (1 - edge)
        hist[0] = hist[-1] = 500 * edge
        data[int(t)] = {
            "Loss": float(loss[t]),
            "Alpha": float(alpha[t]),
            "GradNorm": [float(v) for v in grad_norms[t]],
            "UpdateSize": [float(update[t]), 0.0],
            "GradHist1d": {"hist": hist.tolist(), "edges": np.linspace(-2, 2, 21)},
            "NormTest": float(norm_test[t]),
            "InnerTest": 0.3,
            "OrthoTest": 0.8,
            "Distance": [1.0, 1.0],
        }
        if t % 10 == 0:
            data[int(t)]["learning_rate"] = 0.1
    return History(data)


def test_a_healthy_made_up_run_has_no_finding():
    findings = diagnose(made_up())
    assert reported(findings) == {}
    assert [f.id for f in findings] == []


def test_nonfinite_is_an_error_with_the_first_step():
    history = made_up()
    history.add(40, "nonfinite", ["loss", "gradients"])
    history.add(41, "Loss", math.nan)
    finding = next(f for f in diagnose(history) if f.id == "nonfinite")
    assert finding.severity == "error"
    assert finding.steps == (40, 41)
    assert finding.evidence["first_nonfinite_step"] == 40
    assert finding.evidence["learning_rate"] == 0.1


def test_step_size_too_large_from_the_median_and_from_a_stretch():
    n = 60
    high = made_up(n, alpha=np.full(n, 0.8))
    finding = next(f for f in diagnose(high) if f.id == "step_size_too_large")
    assert finding.severity == "warning"
    assert finding.evidence["median_alpha"] == 0.8
    assert finding.evidence["threshold_median"] == Thresholds().alpha_large
    # an unstable start that settles: a stretch of Alpha > 1 while the loss rises
    alpha = np.r_[np.full(10, 2.0), np.full(n - 10, -0.2)]
    loss = np.r_[np.linspace(2, 20, 10), np.linspace(2, 0.1, n - 10)]
    finding = next(
        f for f in diagnose(made_up(n, alpha=alpha, loss=loss))
        if f.id == "step_size_too_large"
    )  # fmt: skip
    assert finding.severity == "error"
    assert finding.steps[0] == 0 and finding.steps[1] <= 12


def test_step_size_too_small_and_plateau():
    n = 60
    history = made_up(n, loss=np.full(n, 2.3), update=np.full(n, 1e-4))
    assert reported(diagnose(history)) == {
        "step_size_too_small": "warning",
        "loss_plateau": "warning",
    }


def test_inputs_misscaled_reads_the_first_histograms_only():
    assert "inputs_misscaled" in reported(diagnose(made_up(edge=0.1)))
    history = made_up(edge=0.0)
    hist = np.zeros(20)
    hist[0] = hist[-1] = 500
    history.add(50, "GradHist1d", {"hist": hist, "edges": np.linspace(-2, 2, 21)})
    assert "inputs_misscaled" not in reported(diagnose(history))


def test_vanishing_and_exploding_gradients():
    n = 60
    vanishing = np.outer(np.ones(n), [1e-6, 1e-7, 0.4, 0.1])
    assert reported(diagnose(made_up(n, grad_norms=vanishing))) == {
        "vanishing_gradients": "warning"
    }
    growing = np.outer(np.logspace(0, 4, n), [0.5, 0.2, 0.4, 0.1])
    finding = next(
        f for f in diagnose(made_up(n, grad_norms=growing))
        if f.id == "exploding_gradients"
    )  # fmt: skip
    assert finding.evidence["growth"] > Thresholds().growth


def test_gradient_noise_dominates():
    n = 60
    history = made_up(n, norm_test=np.full(n, 1.0))
    assert "gradient_noise_dominates" in reported(diagnose(history))
    # noise only at the end (a converged run) is fine
    late = np.r_[np.full(40, 0.7), np.full(20, 1.0)]
    assert "gradient_noise_dominates" not in reported(
        diagnose(made_up(n, norm_test=late))
    )


def test_a_plateau_after_progress_is_only_info():
    n = 60
    loss = np.r_[np.linspace(2.3, 0.2, 25), np.full(n - 25, 0.2)]
    finding = next(f for f in diagnose(made_up(n, loss=loss)) if f.id == "loss_plateau")
    assert finding.severity == "info"


def test_missing_quantities_are_named_instead_of_guessed():
    history = History({t: {"Loss": 2.0 - 0.01 * t} for t in range(40)})
    findings = diagnose(history)
    assert reported(findings) == {}
    (not_checked,) = [f for f in findings if f.id == NOT_CHECKED]
    checks = not_checked.evidence["checks"]
    assert set(checks) == set(CHECK_IDS) - {"nonfinite", "loss_plateau"}
    assert checks["step_size_too_large"] == "Alpha"
    assert checks["inputs_misscaled"] == "GradHist1d"
    assert "UpdateSize" in checks["step_size_too_small"]


def test_finding_is_frozen_data_with_a_json_form():
    finding = Finding("loss_plateau", "warning", (3, 9), "m", {"x": math.inf}, "a")
    with pytest.raises(dataclasses.FrozenInstanceError):
        finding.id = "other"
    with pytest.raises(TypeError):
        finding.evidence["y"] = 1
    data = finding.to_dict()
    assert data == {
        "id": "loss_plateau",
        "severity": "warning",
        "steps": [3, 9],
        "message": "m",
        "evidence": {"x": "inf"},
        "advice": "a",
    }
    json.dumps(data, allow_nan=False)
    with pytest.raises(ValueError, match="severity"):
        Finding("x", "fatal", (0, 0), "m")


def test_step_signals_reads_tensors_and_arrays():
    torch = pytest.importorskip("torch")
    signals = step_signals(
        {
            "Loss": torch.tensor(1.5),
            "GradNorm": np.array([3.0, 4.0]),
            "GradHist1d": {"hist": np.array([1, 8, 1]), "edges": [0, 1, 2, 3]},
            "nonfinite": ["loss"],
        }
    )
    assert signals["loss"] == 1.5 and signals["grad_norm"] == 5.0
    assert signals["edge_fraction"] == pytest.approx(0.2)
    assert signals["nonfinite"] == ["loss"] and "layer_ratio" not in signals


# --- live --------------------------------------------------------------------------
def test_live_diagnosis_warns_once_per_id_and_keeps_little():
    history = made_up(120, alpha=np.full(120, 1.5))
    live = LiveDiagnosis(every=10, head=5, window=30)
    assert live.postfix() == "ok"
    with pytest.warns(CockpitWarning) as caught:
        for step, values in history.items():
            live.on_record(step, values)
    texts = [str(w.message) for w in caught]
    assert sum("[step_size_too_large" in t for t in texts) == 1
    assert len(live._head) == 5 and len(live._tail) == 30
    assert live.postfix().startswith("step_size_too_large")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning for a known id
        live.on_record(200, {"Loss": 1.0, "Alpha": 2.0})
        live.check()


def test_live_diagnosis_reports_nonfinite_at_once():
    live = LiveDiagnosis(every=1000)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        live.on_record(0, {"Loss": 2.0})
    with pytest.warns(CockpitWarning, match="nonfinite"):
        live.on_record(1, {"Loss": math.nan, "nonfinite": ["loss"]})
    assert live.postfix() == "nonfinite"


# --- small real runs with injected bugs (tuning set, seed 0) ----------------------
RUNS = {
    "healthy-sgd": {},
    "healthy-adam": {},
    "lr-too-large": {"step_size_too_large": "error", "nonfinite": "error"},
    "lr-too-small": {"step_size_too_small": "warning", "loss_plateau": "warning"},
    "unnormalised-inputs": {"inputs_misscaled": "warning"},
    "deep-saturating": {"vanishing_gradients": "warning"},
    "exploding": {"exploding_gradients": "warning", "nonfinite": "error"},
    "gradient-noise": {"gradient_noise_dominates": "warning"},
}


@pytest.fixture(scope="module")
def runs():
    from benchmarks.diagnosis_validation import train

    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = train(name, "tuning", seed=0).history
        return cache[name]

    return get


@pytest.mark.parametrize("name", list(RUNS))
def test_injected_bugs_are_found(runs, name):
    found = reported(diagnose(runs(name)))
    expected = RUNS[name]
    for check_id, severity in expected.items():
        assert found.get(check_id) == severity, (name, found)
    if not expected:
        assert found == {}


def test_a_log_on_disk_gives_the_same_findings(runs, tmp_path):
    history = runs("lr-too-small")
    path = history.write_json(tmp_path / "run.json")
    assert diagnose(path) == diagnose(history)


def test_live_diagnosis_agrees_with_the_log(runs):
    history = runs("lr-too-large")
    live = LiveDiagnosis()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CockpitWarning)
        for step, values in history.items():
            live.on_record(step, values)
    assert {"nonfinite", "step_size_too_large"} <= {f.id for f in live.findings}


def test_live_diagnosis_merges_calls_for_one_step():
    live = LiveDiagnosis(head=2, window=3)
    for step in range(6):
        live.on_record(step, {"Loss": 2.0, "GradNorm": [1.0, 1.0]})
        live.on_record(step, {"learning_rate": 0.1})
    assert [s for s, _ in [*live._head, *live._tail]] == [0, 1, 3, 4, 5]
    assert live._tail[-1][1]["learning_rate"] == 0.1
