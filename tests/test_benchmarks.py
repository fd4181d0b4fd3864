"""The overhead benchmark harness runs end to end (tiny settings)."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run_harness(*args):
    return subprocess.run(
        [sys.executable, "-m", "benchmarks.run", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_harness_measures_time_memory_and_blocks(tmp_path):
    out, raw = tmp_path / "results.md", tmp_path / "results.json"
    proc = run_harness(
        "--problems", "mlp", "--configs", "GradNorm,HVP,NoSuchThing",
        "--repeats", "2", "--warmup", "1", "--min-time", "0", "--memory-steps", "1",
        "--out", str(out), "--json", str(raw), "--analysis", "",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    record = json.loads(raw.read_text())
    grad_norm = record["results"]["mlp"]["GradNorm"]
    assert len(grad_norm["time"]["plain_s"]) == len(grad_norm["time"]["tracked_s"]) == 2
    assert grad_norm["time"]["ratio"] > 0 and grad_norm["time"]["keys"] == ["GradNorm"]
    assert grad_norm["memory"]["peak_rss_mib"] > 0
    assert record["results"]["mlp"]["plain"]["memory"]["peak_rss_mib"] > 0
    hvp = record["results"]["mlp"]["block:HVP"]["time"]
    assert hvp["ratio"] > 0 and hvp["extra_ratio"] > 0
    text = out.read_text()
    assert "| GradNorm |" in text and "one HVP" in text
    assert "'NoSuchThing' is no configuration, quantity or block" in text

    # the report can be rewritten from the record without measuring
    again = tmp_path / "again.md"
    proc = run_harness("--render", str(raw), "--out", str(again), "--analysis", "")
    assert proc.returncode == 0, proc.stderr
    assert again.read_text() == text
