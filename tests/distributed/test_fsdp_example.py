"""``examples/fsdp.py``: two CPU processes (``mp.spawn``), a ``fully_shard`` MLP."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch.distributed as dist

from cockpit.history import History
from tests.test_examples import EXAMPLES

ROOT = EXAMPLES.parent


@pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()),
    reason="torch.distributed with the gloo backend is not available",
)
def test_fsdp_example_two_processes(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), env.get("PYTHONPATH")) if p
    )
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "fsdp.py"), "--steps", "3", "--out", "run"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("wrote ") == 1  # rank 0 alone
    history = History.from_json(str(tmp_path / "run" / "log.json"))
    assert history.steps == [0, 1, 2]
    values = history.to_dict()
    for step in (0, 1, 2):
        for key in ("Loss", "GradNorm", "Variance", "InnerTest", "NormTest"):
            value = values[step][key]
            value = value if isinstance(value, list) else [value]
            assert all(math.isfinite(v) for v in value), (step, key, value)
