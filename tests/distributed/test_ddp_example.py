"""``examples/ddp.py``: started by ``torchrun`` on two CPU processes, and as one."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from cockpit.history import History
from tests.test_examples import EXAMPLES, assert_png, load_example

ROOT = EXAMPLES.parent

needs_gloo = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()),
    reason="torch.distributed with the gloo backend is not available",
)


def _finite(values) -> bool:
    values = values if isinstance(values, list) else [values]
    return all(isinstance(v, float) and math.isfinite(v) for v in values)


@needs_gloo
def test_ddp_example_under_torchrun_two_processes(tmp_path):
    out = tmp_path / "run"
    env = dict(os.environ)
    env["CUDA_VISIBLE_DEVICES"] = ""  # CPU and gloo, whatever the machine has
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), env.get("PYTHONPATH")) if p
    )
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    done = subprocess.run(
        [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc_per_node=2", str(EXAMPLES / "ddp.py"),
            "--steps", "3", "--out", str(out),
        ],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    # rank 0 alone printed, wrote the log and drew; rank 1 wrote nothing anywhere
    assert "2 process(es) on cpu" in done.stdout
    assert "data-parallel cockpit: True" in done.stdout
    assert done.stdout.count("log: ") == 1
    assert done.stderr.count("cockpit coverage at step 0:") == 1  # rank 0's line
    assert sorted(os.listdir(tmp_path)) == ["run"]
    assert sorted(os.listdir(out)) == ["dashboard.png", "log.json"]
    assert_png(out / "dashboard.png")
    history = History.from_json(str(out / "log.json"))
    assert history.steps == [0, 1, 2]
    values = history.to_dict()
    for step in (0, 1, 2):
        assert _finite(values[step]["Loss"]) and _finite(values[step]["GradNorm"])
        assert "InnerTest" in values[step] and "GradHist1d" in values[step]
    assert {"train_loss", "valid_accuracy", "learning_rate"} <= set(history.keys)


def test_ddp_example_runs_as_one_process(tmp_path, monkeypatch):
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    paths = load_example("ddp").main(steps=2, out=str(tmp_path / "one"))
    assert paths == {
        "log": str(tmp_path / "one" / "log.json"),
        "dashboard": str(tmp_path / "one" / "dashboard.png"),
    }
    assert not dist.is_initialized()
    history = History.from_json(paths["log"])
    assert history.steps == [0, 1]
    assert _finite(history.to_dict()[1]["Loss"])


def test_ddp_example_documents_how_to_run_it():
    module = load_example("ddp")
    assert "torchrun --nproc_per_node=2 examples/ddp.py" in module.__doc__
    assert "python examples/ddp.py" in module.__doc__
    assert "torchvision" not in Path(EXAMPLES / "ddp.py").read_text()
