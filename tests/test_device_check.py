"""The device check (``bash benchmarks/device_check.sh``) end to end on the CPU.

At its smallest (one configuration, no 1.0.2, no CUDA tests; the packages present,
``COCKPIT_DEVICE_PYTHON``): the report a GPU run writes, in the same format.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks import device

REPO = Path(__file__).resolve().parent.parent


def test_the_device_check_runs_on_the_cpu_and_writes_its_report(tmp_path):
    out = tmp_path / "device_cpu.md"
    env = dict(os.environ, COCKPIT_DEVICE_PYTHON=sys.executable, PYTHONPATH=str(REPO))
    args = ["--quick", "--no-reference", "--no-tests", "--configs", "economy"]
    proc = subprocess.run(
        ["bash", "benchmarks/device_check.sh", *args, "--out", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "device check:" in proc.stdout and "s in all, status 0" in proc.stdout
    text = out.read_text()
    data = json.loads(out.with_suffix(".json").read_text())
    assert data["device"]["device"] == "cpu" and data["sizes"]["batch"] == 8
    # the report is the rendering of its record, with every table a GPU run has
    assert device.render(data) == text
    assert text.startswith("# Device check: cpu\n")
    for heading in ("## Tests: the CUDA cases", "## Overhead on 3C3D", "## GPT-2"):
        assert heading in text
    rows = [line for line in text.splitlines() if line.startswith("| economy |")]
    assert [row.split(" | ")[1] for row in rows] == ["every step", "every 16th step"]
    ours = data["overhead"]["ours"]["economy"]
    assert ours["windows"] == {"plain": 1, "every": 1, "sparse": 1}
    assert all(ratio > 0 for ratio in ours["ratio"].values())
    gpt2 = data["gpt2"]["ratio"]
    assert set(gpt2) == set(device.GPT2_VARIANTS) and gpt2["plain"] == 1.0
    assert "Variance + NormTest over `vmap(grad)`" in text


def test_the_report_names_its_device_and_failures():
    assert device.slug("NVIDIA H200") == "nvidia-h200"
    record = {
        "machine": {"commit": "abc", "date": "d", "cpu": "c", "cores": 1},
        "argv": ["python -m benchmarks.device"],
        "device": {"device": "cuda", "name": "NVIDIA H200", "torch": "t", "cuda": "12"},
        "sizes": {"batch": 128, "every_window": 16, "rounds": 5, "gpt2_batch": 8},
        "tests": {"summary": "1 failed, 3 passed", "failed": ["FAILED tests/x::y"]},
        "reference": "not installed: no network",
        "overhead": {"ours": {"economy": {"error": "timed out"}}, "reference": {}},
        "gpt2": {"error": "out of memory"},
    }
    record["machine"] |= {"load": "0", "torch": "t"}
    text = device.render(record)
    assert "# Device check: NVIDIA H200" in text and "* FAILED tests/x::y" in text
    assert "| economy | every step | timed out | – |" in text
    assert "against not installed: no network" in text
    assert "error: out of memory" in text
