"""``examples/fsdp.py``: two CPU processes (``mp.spawn``), a ``fully_shard`` MLP."""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys

import pytest
import torch
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
    # HessMaxEV (every fifth step): the dense Hessian of the joined batch's loss
    assert [s for s in (0, 1, 2) if "HessMaxEV" in values[s]] == [0]
    example = _load_example()
    model = example.make_model().double()
    x, y = next(example.joined_batches(1))
    names = [n for n, _ in model.named_parameters()]
    shapes = [p.shape for _, p in model.named_parameters()]
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])

    def loss(f):
        pieces = (
            t.view(s) for t, s in zip(f.split([s.numel() for s in shapes]), shapes)
        )
        out = torch.func.functional_call(model, dict(zip(names, pieces)), (x.double(),))
        return torch.nn.functional.cross_entropy(out, y)

    eigenvalues = torch.linalg.eigvalsh(torch.autograd.functional.hessian(loss, flat))
    want = float(eigenvalues[eigenvalues.abs().argmax()])
    # Lanczos' tolerance: rtol 1e-3 of the residual; float32 products
    assert math.isclose(values[0]["HessMaxEV"], want, rel_tol=2e-3), (values[0], want)
    assert f"HessMaxEV at step 0: {values[0]['HessMaxEV']}" in done.stdout


def _load_example():
    spec = importlib.util.spec_from_file_location("fsdp_example", EXAMPLES / "fsdp.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
