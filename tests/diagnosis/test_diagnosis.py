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
    collect,
    diagnose,
    settled,
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


def test_step_size_too_large_from_the_median_and_from_a_blow_up():
    n = 60
    # overshooting later in the run only: the whole run's median (the report)
    alpha = np.r_[np.full(30, -0.2), np.full(n - 30, 0.8)]
    history = made_up(n, alpha=alpha)
    finding = next(f for f in diagnose(history) if f.id == "step_size_too_large")
    assert finding.severity == "warning"
    assert finding.evidence["median_alpha"] == pytest.approx(0.3)
    assert finding.evidence["threshold_median"] == Thresholds().alpha_large
    assert settled(collect(history)) == []  # not settled: nothing said live
    # from the start: settled after the first 30 tracked values
    (early,) = settled(collect(made_up(n, alpha=np.full(n, 0.8))))
    assert early.id == "step_size_too_large" and early.steps == (0, 29)
    # an unstable start that settles: the loss at 10 times its start
    alpha = np.r_[np.full(10, 2.0), np.full(n - 10, -0.2)]
    loss = np.r_[np.linspace(2, 20, 10), np.linspace(2, 0.1, n - 10)]
    finding = next(
        f for f in diagnose(made_up(n, alpha=alpha, loss=loss))
        if f.id == "step_size_too_large"
    )  # fmt: skip
    assert finding.severity == "error"
    assert finding.steps[0] == 0 and finding.steps[1] <= 8
    assert finding.evidence["loss_rise"] >= Thresholds().loss_rise


def test_a_stretch_of_overshooting_steps_counts_only_without_progress():
    n = 80
    alpha = np.r_[np.full(20, -0.2), np.full(40, 1.5), np.full(n - 60, -0.2)]
    stuck = np.r_[np.linspace(2.3, 1.0, 20), 1.0 + 0.1 * np.sin(np.arange(60))]
    found = settled(collect(made_up(n, alpha=alpha, loss=stuck)))
    assert [f.id for f in found] == ["step_size_too_large"]
    assert found[0].evidence["median_alpha_in_stretch"] == 1.5
    falling = np.linspace(2.3, 0.2, n)  # overshooting, yet the loss goes down
    assert settled(collect(made_up(n, alpha=alpha, loss=falling))) == []


def test_step_size_too_small_and_plateau():
    n = 60
    history = made_up(n, loss=np.full(n, 2.3), update=np.full(n, 1e-4))
    assert reported(diagnose(history)) == {
        "step_size_too_small": "warning",
        "loss_plateau": "warning",
    }
    # settled from the first 30 steps: too small at a learning rate that held
    (small,) = settled(collect(history))
    assert small.id == "step_size_too_small" and small.steps == (0, 29)


def test_a_warm_up_is_not_a_step_size_too_small():
    """Tiny steps at a rising learning rate say nothing yet; the report reads the
    whole run, whose median step is not small."""
    n = 100
    update = np.r_[np.linspace(1e-5, 0.1, 40), np.full(n - 40, 0.1)]
    history = made_up(n, update=update)
    for t in range(n):
        history.add(t, "learning_rates", [0.1 * min(1.0, (t + 1) / 40)])
    assert settled(collect(history)) == []
    assert reported(diagnose(history)) == {}


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
    # a transformer at initialisation: query and key gradients are tiny (uniform
    # attention), the value's next to them is not; a converged head dominates late
    query_key_value = [1e-6, 1e-7, 1e-6, 0.05]  # weights (and the query's bias)
    tensors = query_key_value + [0.02, 0.3, 0.3, 0.2, 0.1, 0.4, 0.1, 0.2] + [0.5] * 4
    transformer = np.outer(np.ones(n), tensors)
    transformer[20:, :8] *= 1e-4
    assert reported(diagnose(made_up(n, grad_norms=transformer))) == {}
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


def test_settled_checks_with_too_few_steps_say_so():
    checks = next(f for f in diagnose(made_up(6)) if f.id == NOT_CHECKED).evidence[
        "checks"
    ]
    assert checks["vanishing_gradients"] == "at least 10 GradNorm values"
    assert checks["exploding_gradients"] == "at least 10 GradNorm values"


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
def test_live_diagnosis_warns_once_per_id():
    history = made_up(120, alpha=np.full(120, 1.5))
    live = LiveDiagnosis()
    assert live.postfix() == "ok"
    with pytest.warns(CockpitWarning) as caught:
        for step, values in history.items():
            live.on_record(step, values)
    texts = [str(w.message) for w in caught]
    assert sum("[step_size_too_large" in t for t in texts) == 1
    assert live.postfix().startswith("step_size_too_large")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning for a known id
        live.on_record(200, {"Loss": 1.0, "Alpha": 2.0})
        live.check()


def test_live_diagnosis_reports_nonfinite_at_once():
    live = LiveDiagnosis()
    live.on_record(0, {"Loss": 2.0})
    with pytest.warns(CockpitWarning, match="nonfinite"):
        live.on_record(1, {"Loss": math.nan, "nonfinite": ["loss"]})
    assert live.postfix() == "nonfinite"


def _live_ids(history, split=False) -> set[str]:
    """What a live diagnosis announces for the steps of ``history``. With
    ``split`` the values arrive as the cockpit sends them: a step's Alpha and
    UpdateSize one step later, Cockpit.log's values in a call of their own."""
    live = LiveDiagnosis(warn=False)
    late: dict[str, object] = {}
    for step, values in history.items():
        values = dict(values)
        if split:
            for key in ("Alpha", "UpdateSize"):
                if key in values:
                    late[key] = values.pop(key)
            logged = {k: values.pop(k) for k in ("learning_rate",) if k in values}
            live.on_record(step, values)
            if logged:
                live.on_record(step, logged)
            if late and step + 1 in history.steps:
                live.on_record(step, dict(late))
                late = {}
        else:
            live.on_record(step, values)
    return {f.id for f in live.findings}


RUN_SHAPES = {
    "healthy": {},
    "plateau at the start, then learning (the quickstart's live false alarm)": {
        "loss": np.r_[np.full(25, 1.6), np.linspace(1.6, 0.9, 35)]
    },
    "lr too large from the start": {"alpha": np.full(60, 0.8)},
    "overshooting late only": {"alpha": np.r_[np.full(30, -0.2), np.full(30, 0.8)]},
    "tiny steps": {"update": np.full(60, 1e-5)},
    "noise throughout": {"norm_test": np.full(60, 1.0)},
    "blow-up": {"loss": np.r_[np.linspace(2, 9, 20), np.full(40, np.nan)]},
    "edge histograms": {"edge": 0.2},
}


@pytest.mark.parametrize("shape", list(RUN_SHAPES))
def test_the_report_holds_every_id_the_live_diagnosis_announced(shape):
    history = made_up(60, **RUN_SHAPES[shape])
    final = set(reported(diagnose(history)))
    assert _live_ids(history) <= final
    assert _live_ids(history, split=True) == _live_ids(history)  # arrival order
    assert {f.id for f in settled(collect(history))} == _live_ids(history)
    if shape.startswith(("healthy", "plateau")):
        assert final == set() and _live_ids(history) == set()


# --- small real runs with injected bugs (the benchmark's tuning runs) ---------------
def _spec(family, scenario):
    from benchmarks.diagnosis_validation import SPECS

    first = {"mlp-digits": "SGD lr 0.1, batch 32", "quickstart": "the example"}
    (spec,) = [
        s
        for s in SPECS
        if (s.which, s.family, s.scenario) == ("tuning", family, scenario)
        and (scenario != "healthy" or s.setting.startswith(first[family]))
        and "logarithmic" not in s.setting
    ]
    return spec


REAL_RUNS = {  # 40 steps: every settled check has its evidence by then
    ("mlp-digits", "healthy"): set(),
    ("quickstart", "healthy"): set(),
    ("quickstart", "lr-too-large"): {"step_size_too_large"},
    ("mlp-digits", "lr-too-small"): {"step_size_too_small"},
    ("mlp-digits", "unnormalised-inputs"): {"inputs_misscaled"},
    ("mlp-digits", "vanishing"): {"vanishing_gradients"},
    ("mlp-digits", "exploding"): {"exploding_gradients", "nonfinite"},
}


@pytest.mark.parametrize("run", list(REAL_RUNS), ids="-".join)
def test_real_runs_live_and_final(run):
    """The live diagnosis of a real cockpit run finds the injected bug (a healthy
    run: nothing), and the report of the log holds what it announced."""
    from benchmarks.diagnosis_validation import train

    cockpit, live = train(_spec(*run).make(0), 40, seed=0)
    assert REAL_RUNS[run] <= set(live) <= set(reported(diagnose(cockpit.history)))
    if not REAL_RUNS[run]:
        assert live == {} and reported(diagnose(cockpit.history)) == {}


def test_a_log_on_disk_gives_the_same_findings(tmp_path):
    history = made_up(60, loss=np.full(60, 2.3), update=np.full(60, 1e-4))
    path = history.write_json(tmp_path / "run.json")
    assert diagnose(path) == diagnose(history)


def test_the_live_warning_points_at_the_users_with_line():
    """Raw pixels: inputs_misscaled is announced at the first step; the warning
    names this file and the line of the ``with cockpit(...)`` block, not cockpit's
    recorder."""
    import torch
    from backpack import extend

    from cockpit import Cockpit
    from cockpit.utils.configuration import configuration

    setup = _spec("mlp-digits", "unnormalised-inputs").make(0)
    cockpit = Cockpit(setup.model.parameters(), quantities=configuration("economy"))
    loss_fn = extend(torch.nn.CrossEntropyLoss())
    x, y = setup.x[:32], setup.y[:32]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            setup.optimizer.zero_grad()
            out = setup.model(x)
            loss = loss_fn(out, y)
            losses = torch.nn.functional.cross_entropy(out, y, reduction="none")
            info = {"batch_size": 32, "loss": loss, "optimizer": setup.optimizer,
                    "individual_losses": losses}  # fmt: skip
            with cockpit(step, info=info):
                loss.backward()
            setup.optimizer.step()
    (said,) = [w for w in caught if "cockpit diagnosis [" in str(w.message)]
    assert "[inputs_misscaled" in str(said.message)
    assert said.filename == __file__
    with open(__file__, encoding="utf-8") as handle:
        line = handle.read().splitlines()[said.lineno - 1]
    assert "with cockpit(step, info=info)" in line
