"""The overhead benchmark harness: end to end at tiny settings, and its parts."""

import ast
import contextlib
import importlib
import io
import json
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import pytest

from benchmarks import measure, record, report, retry, run
from tests.utils import expected_warnings as expected

pytestmark = [expected.JIT_SCRIPT_DEPRECATED]

REPO = Path(__file__).resolve().parent.parent
BENCHMARKS = REPO / "benchmarks"
RESULTS = BENCHMARKS / "results"


def run_harness(*args):
    return subprocess.run(
        [sys.executable, "-m", "benchmarks.run", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _in_process(module: str, *argv: str) -> str:
    """What ``python -m module *argv`` prints, run in this process (no new interpreter).

    For the commands that only read a record and print or write tables.
    """
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = importlib.import_module(module).main(list(argv))
    assert status in (0, None), (module, argv, status)
    return out.getvalue()


def test_harness_measures_time_memory_and_blocks(tmp_path):
    out, raw = tmp_path / "results.md", tmp_path / "results.json"
    proc = run_harness(
        "--problems", "mlp", "--configs", "GradNorm,HVP,NoSuchThing",
        "--repeats", "2", "--warmup", "1", "--min-time", "0", "--memory-steps", "1",
        "--out", str(out), "--json", str(raw), "--analysis", "",
        "--threads", "1",  # two threads beside the other test worker: much slower
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "[mlp] GradNorm: time: " in proc.stderr
    saved = json.loads(raw.read_text())
    assert set(saved) == {"machine", "results", "notes", "argv", "settings"}
    assert saved["settings"]["problems"] == ["mlp"]
    grad_norm = saved["results"]["mlp"]["GradNorm"]
    assert len(grad_norm["time"]["plain_s"]) == len(grad_norm["time"]["tracked_s"]) == 2
    assert grad_norm["time"]["ratio"] > 0 and grad_norm["time"]["keys"] == ["GradNorm"]
    assert grad_norm["memory"]["peak_rss_mib"] > 0
    assert saved["results"]["mlp"]["plain"]["memory"]["peak_rss_mib"] > 0
    hvp = saved["results"]["mlp"]["block:HVP"]["time"]
    assert hvp["ratio"] > 0 and hvp["extra_ratio"] > 0
    assert "memory" not in saved["results"]["mlp"]["block:HVP"]
    text = out.read_text()
    assert "| GradNorm |" in text and "one HVP" in text
    assert "'NoSuchThing' is no configuration, quantity or block" in text

    # the report can be rewritten from the record without measuring
    again = tmp_path / "again.md"
    run.main(["--render", str(raw), "--out", str(again), "--analysis", ""])
    assert again.read_text() == text


def test_committed_results_are_the_rendering_of_the_committed_record(tmp_path):
    """results/overhead.md is overhead.json rendered, overhead_analysis.md appended."""
    out = tmp_path / "results.md"
    status = run.main(["--render", str(RESULTS / "overhead.json"), "--out", str(out)])
    assert status in (0, None)
    assert out.read_text() == (RESULTS / "overhead.md").read_text(), (
        "benchmarks/results/overhead.md is stale: run "
        "`python -m benchmarks.run --render benchmarks/results/overhead.json`"
    )


def test_only_internals_imports_cockpit():
    """Core names used by the benchmarks live in one module, for one place to fix."""
    offenders = []
    for path in sorted(BENCHMARKS.rglob("*.py")):
        if path.name in (
            "internals.py",
            "diagnosis_validation.py",
            "kernels.py",
            "step_trace.py",
            "curvature_cost.py",
            "ggn_estimate_se.py",
            "big_logs.py",
            "real_models_speed.py",
            "after_step_floor.py",
            "tracker_overhead.py",
            "centered_spread.py",
            "serve.py",
            "fsdp_hvp_designs.py",
        ):
            continue  # validation, step trace: the public API; kernels, curvature_cost
            # (a converged Lanczos reference) and ggn_estimate_se measure internals;
            # big_logs writes its logs with cockpit's own writers; real_models_speed
            # and after_step_floor time the per-sample parts alone; tracker_overhead
            # times the trackers' public API (log_to) on the demo's digits run;
            # centered_spread times the old spread (internals) against the new;
            # serve writes its logs with cockpit's own stream writer;
            # fsdp_hvp_designs forms products with cockpit's FSDP layout (Sharding)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            offenders += [
                f"{path.name}:{node.lineno} {name}"
                for name in names
                if name == "cockpit" or name.startswith("cockpit.")
            ]
    assert not offenders, offenders


def test_plan_expands_groups_and_reports_unknown_names():
    specs, notes = run.plan(Namespace(configs="economy, blocks,GradNorm,Nope,HVP"))
    assert specs[0] == "economy" and "GradNorm" in specs
    assert specs.count("block:HVP") == 1 and "block:BatchGrad" in specs
    assert "'Nope' is no configuration, quantity or block: skipped" in notes


def _timing(plain_ms, tracked_ms=2.0):
    return {
        "plain_s": [plain_ms / 1000] * 3,
        "tracked_s": [tracked_ms / 1000] * 3,
        "ratio": tracked_ms / plain_ms,
    }


def _timing_entry(plain_ms, tracked_ms=2.0):
    return {"time": _timing(plain_ms, tracked_ms)}


def _machine():
    keys = ("cpu", "platform", "python", "torch", "backpack", "commit", "date", "load")
    return dict.fromkeys(keys, "x") | {"cores": 2}


def _settings(**extra):
    return Namespace(busy_factor=3.0, retries=2, **extra)


def test_retry_measures_busy_specs_again_and_keeps_the_faster_run(monkeypatch):
    calls = []

    def fake_run_child(problem, spec, mode, args, interpreter=measure.OURS):
        calls.append((problem, spec, mode))
        return _timing(1.2)

    monkeypatch.setattr(measure, "run_child", fake_run_child)
    results = {
        "mlp": {
            "plain": {"memory": {"peak_rss_mib": 300.0}},
            "Loss": _timing_entry(1.0),
            "Alpha": _timing_entry(10.0),  # busy: 10x the fastest plain step
            "block:HVP": _timing_entry(5.0),  # blocks are compared separately
        }
    }
    notes = retry.retry_busy(results, _settings())
    assert calls == [("mlp", "Alpha", "time")]
    assert results["mlp"]["Alpha"]["time"]["plain_s"][0] == 0.0012
    assert notes == [
        "mlp Alpha: measured again (plain step median 10.0 ms, 10.0x the fastest of "
        "this problem: machine busy); kept 1.2 ms"
    ]


def test_retry_says_when_the_machine_stays_busy(monkeypatch):
    monkeypatch.setattr(measure, "run_child", lambda *a, **k: _timing(20.0))
    results = {"mlp": {"Loss": _timing_entry(1.0), "Alpha": _timing_entry(10.0)}}
    notes = retry.retry_busy(results, _settings(), label="ref ")
    assert notes == [
        "mlp ref Alpha: plain steps still 10.0x slower than the fastest of this "
        "problem after retries (machine busy); its ratio is unreliable"
    ]


def test_fix_remeasures_on_request_and_rewrites_record_and_report(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(measure, "run_child", lambda *a, **k: _timing(1.0, 3.0))
    monkeypatch.setattr(record, "machine", _machine)
    results = {"mlp": {"GradNorm": _timing_entry(1.0)}}
    args = _settings(
        problems=["mlp"], repeats=3, warmup=1, min_time=0.0, memory_steps=1,
        threads=2, clock="wall",
    )  # fmt: skip
    saved = record.new(results, [], ["--quick"], args)
    raw, out = tmp_path / "r.json", tmp_path / "r.md"
    record.write(raw, saved)
    retry.fix(
        _settings(fix=str(raw), remeasure="mlp:GradNorm", out=str(out), analysis="")
    )
    fixed = json.loads(raw.read_text())
    assert fixed["results"]["mlp"]["GradNorm"]["time"]["ratio"] == 3.0
    assert fixed["notes"][0].startswith("mlp GradNorm: measured again after the run")
    assert "--remeasure mlp:GradNorm" in fixed["notes"][-1]
    assert "| GradNorm | 1.0 | 3.0 | 3.00 |" in out.read_text()


def test_variants_alternate_and_the_reference_skips_what_it_lacks(monkeypatch):
    calls = []

    def fake_run_child(problem, spec, mode, args, interpreter=measure.OURS):
        calls.append((interpreter.python, spec, mode))
        if mode == "memory":
            return {"peak_rss_mib": 400.0 if spec == "plain" else 450.0}
        return _timing(1.0, 5.0 if interpreter is measure.OURS else 50.0)

    monkeypatch.setattr(measure, "run_child", fake_run_child)
    ours = run.Variant()
    theirs = run.Variant(
        interpreter=measure.Interpreter(python="ref"), label="ref 1.0 ", offers={"A"}
    )
    args = Namespace(no_time=False, no_memory=False)
    run.measure_all("mlp", ["A", "B", "block:HVP", "C"], args, [ours, theirs])
    me = measure.OURS.python
    assert calls == [
        (me, "plain", "memory"), ("ref", "plain", "memory"),
        (me, "A", "time"), (me, "A", "memory"), ("ref", "A", "time"),
        ("ref", "A", "memory"),
        (me, "B", "time"), (me, "B", "memory"),
        (me, "block:HVP", "time"),
        (me, "C", "time"), (me, "C", "memory"),
    ]  # fmt: skip
    assert set(theirs.results["mlp"]) == {"plain", "A"}

    text = report.render(
        {
            "machine": _machine(),
            "results": ours.results,
            "notes": [],
            "argv": ["--reference"],
            "settings": {
                "problems": ["mlp"],
                "repeats": 3,
                "warmup": 1,
                "min_time": 0.0,
                "memory_steps": 1,
                "threads": 2,
                "clock": "wall",
            },  # fmt: skip
            "reference": {
                "package": "ref 1.0",
                "requirement": "ref==1.0",
                "results": theirs.results,
            },
        }
    )
    assert "### Same run: ref 1.0" in text
    assert "| A | 5.00 | 50.0 | 10.0 | 50.0 | 50.0 |" in text


def test_ddp_benchmark_runs_two_processes_and_counts_cockpits_collectives(tmp_path):
    """benchmarks/ddp.py at tiny settings: two gloo processes, a record, the tables."""
    raw = tmp_path / "ddp.json"
    proc = subprocess.run(
        [
            sys.executable, "-m", "benchmarks.ddp", "--quick", "--problems", "mlp",
            "--configs", "economy", "--min-rounds", "2", "--out", str(raw),
        ],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    saved = json.loads(raw.read_text())
    case = saved["cases"]["mlp/economy"]
    assert case["rounds"] == 2 and saved["settings"]["world"] == 2
    assert set(case["median_s"]) == {"plain", "plain_local", "dp", "local", "unaware"}
    assert "data_parallel_extra_s" in case and "bookkeeping_s" in case
    # one header all-gather (3 int64) and one float64 bucket per tracked step
    assert case["cockpit_calls_per_step"] == 2
    assert case["cockpit_bytes_by_kind"]["header"] == 24
    assert case["cockpit_bytes_per_step"] > 24 + 8 * 128  # loss, 128 losses, sums
    assert case["ddp_bytes_per_step"] == 4 * case["num_params"] == 4 * 101_770
    assert "| mlp/economy |" in proc.stdout
    again = _in_process("benchmarks.ddp", "--table", str(raw))
    assert again.strip() == proc.stdout.strip()


def test_any_model_benchmark_checks_the_engine_and_records_goals(tmp_path):
    """benchmarks/any_model.py at tiny settings: the record, the checks, the tables."""
    raw = tmp_path / "any_model.json"
    proc = subprocess.run(
        [
            sys.executable, "-m", "benchmarks.any_model", "--quick",
            "--configs", "economy", "--members", "", "--memory-batches", "8",
            "--memory-kinds", "economy", "--no-default-kernel", "--out", str(raw),
        ],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    saved = json.loads(raw.read_text())
    assert {"machine", "settings", "steps", "members", "engine", "memory", "goals"} <= (
        set(saved)
    )
    steps = saved["steps"]
    assert set(steps) == {"economy"}  # full: too slow; the default kernel: left out
    for label, result in steps.items():
        assert result["ratio"] > 0 and len(result["tracked_s"]) >= 2, label
        # the engine share: the parameters the cockpit routed to autograd, timed
        assert "autograd" in result["routes"].values(), label
        assert result["engine_share"]["ratio"] > 0, label
    assert {"Alpha", "GradNorm", "NormTest"} <= set(steps["economy"]["keys"])
    engine = saved["engine"]
    assert engine["agreement"]["checked"] and engine["agreement"]["close"]
    assert engine["agreement"]["tensors"] == engine["num_tensors"] == 17
    assert engine["agreement"]["max_abs_diff"] <= engine["agreement"]["atol"]
    assert engine["default"]["ratio"] > 0 and engine["default"]["fwd_bwd_ratio"] > 0
    assert set(engine["chunks"]) == {"1"}
    assert set(saved["memory"]) == {"8"}
    for row in saved["memory"].values():  # the engine and vmap children: left out
        assert set(row) == {"plain", "economy"}
        assert all(r["peak_rss_mib"] > 0 for r in row.values())
    goals = {g["goal"]: g for g in saved["goals"]}
    assert set(goals) == {
        "economy <= 4x a plain step",
        "full <= 25x a plain step",
        "engine no slower than vmap(grad)",
        "engine beyond the training step's forward pass no slower than vmap(grad)",
    }
    assert goals["full <= 25x a plain step"]["met"] is None  # not measured here
    assert all(isinstance(g["met"], bool) for k, g in goals.items() if "full" not in k)
    # the fallback alone and the training step's forward were timed too
    assert engine["backward"]["ratio"] > 0 and engine["forward"]["ratio"] > 0
    chunk = engine["settings"]["chunk"]
    assert "| economy |" in proc.stdout
    assert "| cockpit's engines as a cockpit runs them" in proc.stdout
    assert f"| fallback alone: one batched backward pass per sample | {chunk} |" in (
        proc.stdout
    )
    assert "beyond the training step's forward pass" in proc.stdout
    assert _in_process("benchmarks.any_model", "--table", str(raw)) == proc.stdout
    with pytest.raises(SystemExit):  # a memory kind it does not know
        importlib.import_module("benchmarks.any_model").parse(["--memory-kinds", "x"])


def test_hvp_counts_compare_warm_starts_against_a_tight_reference():
    """`benchmarks.studies.kernels --hvp-steps`: products and errors per warm start."""
    from benchmarks.studies.kernels import hvp_counts

    out = hvp_counts("mlp", 2, lr=0.05, momentum=0.9)
    assert set(out) == {"warm start from 3", "warm start from 1", "reference"}
    assert len(out["reference"]) == 2 and all(v > 0 for v in out["reference"])
    for label in ("warm start from 3", "warm start from 1"):
        row = out[label]
        assert len(row["products"]) == 2 and all(n > 1 for n in row["products"])
        assert max(row["errors"]) < 1e-3, (label, row)
        # the errors are against the reference of the same step
        for value, exact, error in zip(
            row["values"], out["reference"], row["errors"], strict=True
        ):
            assert error == pytest.approx(abs(value - exact) / abs(exact))


def test_small_block_times_compare_two_exact_paths():
    """`benchmarks.studies.kernels --small-blocks`: both paths timed, counts equal."""
    from benchmarks.studies.kernels import small_block_times
    from cockpit.quantities import histogram_kernels as kernels

    limit = kernels.SEARCH_AT_MOST
    rows = small_block_times(sizes=(64, 3000), repeats=1)
    assert kernels.SEARCH_AT_MOST == limit  # restored
    assert [(n, s) for n, s, *_ in rows] == [
        (64, 1e-3), (64, 0.3), (3000, 1e-3), (3000, 0.3)
    ]  # fmt: skip
    assert all(search > 0 and general > 0 for *_, search, general in rows)


def test_hvp_modes_agree_and_are_timed(monkeypatch):
    """`benchmarks.studies.hvp_modes`: four ways to the same Hessian-vector products."""
    from benchmarks.studies import hvp_modes

    result = hvp_modes.measure("mlp", probes=3, repeats=1)
    assert result["parameters"] == 101_770 and result["probes"] == 3
    assert list(result["modes"]) == list(hvp_modes.MODES)
    assert all(seconds > 0 for seconds in result["modes"].values())
    assert 0 <= result["max_deviation"] < 1e-4
    table = hvp_modes.markdown([result])
    assert table.count("| mlp |") == len(hvp_modes.MODES)
    # a mode whose products disagree fails the run instead of being timed
    wrong = hvp_modes.Problem.forward_over_reverse_loop
    monkeypatch.setattr(
        hvp_modes.Problem,
        "forward_over_reverse_loop",
        lambda self: wrong(self) * (1 + 1e-3),
    )
    with pytest.raises(AssertionError, match="forward-over-reverse, loop"):
        hvp_modes.measure("mlp", probes=2, repeats=1)
