"""Curvature on real architectures, the 1.0.2 loop unchanged, default attention.

Hugging Face GPT-2, ViT, Llama and T5 (``tests/utils/hf_models.py``) and a
hand-written GPT that calls ``F.scaled_dot_product_attention`` itself use the fused
attention kernel, whose backward pass has no derivative. With the ``full``
configuration (and TICTrace) every curvature quantity that can be formed honestly
has a value:

* HessMaxEV equals the eigenvalue of largest magnitude of the dense float64
  Hessian (Llama, the hand-written GPT: ``eigvalsh``) or of ARPACK run on
  Hessian-vector products of the model with the math kernel (GPT-2, ViT, T5), and
  ``HessMaxEV_largest`` the largest eigenvalue where the two differ;
* HessTrace and TICTrace read the GGN of the cross-entropy in place of the Hessian
  (BackPACK cannot form these models' Hessian diagonal, and Hutchinson's estimate
  of the Hessian trace is too noisy to read): the GGN formed by brute force
  (``tests/utils/dense_ggn.py``: Jacobian of the logits times the loss Hessian in
  the logits, float64) equals the exact one (ViT: 4 samples, 3 classes) and lies
  within 4 reported standard errors of the Monte-Carlo one (the language models),
  whose reported relative standard error of the summed trace is at most 10 %;
* TICDiag, which divides elementwise by the curvature diagonal, has a value where
  the GGN diagonal is exact (ViT) and equals the brute-force one there; elsewhere it
  is missing with that reason and a fix.

On main HessMaxEV and HessTrace were missing on every one of these models ("PyTorch
has no double backward ..."); before the GGN, HessTrace was a Hutchinson estimate of
the Hessian with a relative error of 17-270 % and TICTrace mostly missing.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from torch.func import functional_call
from torch.nn.attention import SDPBackend, sdpa_kernel

from cockpit import quantities as Q
from cockpit.errors import CockpitWarning
from cockpit.utils.configuration import configuration
from cockpit.utils.schedules import linear
from tests.utils.lazy import module_or_skip

transformers = module_or_skip("transformers", reason="transformers is not installed")
from tests.utils import expected_warnings as expected  # noqa: E402
from tests.utils import hf_models  # noqa: E402
from tests.utils.dense_ggn import dense_ggn  # noqa: E402
from tests.utils.hand_written import tiny_gpt  # noqa: E402

pytestmark = [expected.HF_ROOT_BACKWARD_HOOK]

CURVATURE = ("HessMaxEV", "HessTrace", "TICTrace")


def build(name: str) -> hf_models.Case:
    if name == "tiny-gpt":
        torch.manual_seed(0)
        case = tiny_gpt()
        case.model = case.model.double().train()
        return case
    return hf_models.build(name)


def math_hvp(case, snapshot, kwargs, targets):
    """``v -> H v`` (flat, float64) of the mini-batch loss with the math kernel."""
    names = [n for n, p in case.model.named_parameters() if p.requires_grad]
    leaves = [p.clone().requires_grad_() for p in snapshot]
    with sdpa_kernel(SDPBackend.MATH):
        out = functional_call(case.model, dict(zip(names, leaves)), (), kwargs)
        losses = case.individual_loss_fn(case.logits(out), targets)
        grads = torch.autograd.grad(losses.mean(), leaves, create_graph=True)
    flat = torch.cat([g.reshape(-1) for g in grads])

    def hvp(vectors):  # [k, D] -> [k, D]
        with sdpa_kernel(SDPBackend.MATH):
            rows = torch.autograd.grad(flat, leaves, vectors, retain_graph=True,
                                       is_grads_batched=True)  # fmt: skip
        return torch.cat([r.reshape(vectors.shape[0], -1) for r in rows], 1)

    return hvp, sum(p.numel() for p in snapshot)


def dense_hessian(hvp, dim, chunk=512):
    rows = [hvp(torch.eye(dim, dtype=torch.float64)[s : s + chunk])
            for s in range(0, dim, chunk)]  # fmt: skip
    hessian = torch.cat(rows)
    return (hessian + hessian.T) / 2


def arpack(hvp, dim, which):
    from scipy.sparse.linalg import LinearOperator, eigsh

    def matvec(v):
        vector = torch.as_tensor(np.asarray(v).reshape(1, -1), dtype=torch.float64)
        return hvp(vector)[0].numpy()

    operator = LinearOperator((dim, dim), matvec=matvec, dtype=np.float64)
    v0 = np.random.default_rng(0).standard_normal(dim)
    return float(eigsh(operator, k=1, which=which, tol=1e-10, v0=v0)[0][0])


def tracked(name, steps):
    case = build(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CockpitWarning)
        warnings.simplefilter("ignore", UserWarning)  # torch: hooks of frozen inputs
        quantities = configuration("full") + [Q.TICTrace(linear(1))]
        cockpit, records = hf_models.run_loop(case, quantities, steps)
    history = cockpit.history.to_dict()
    for step in records:
        entry = history[step]
        missing = entry.get("missing", {})
        for key in CURVATURE:
            assert key in entry, (step, key, missing.get(key))
        assert "double backward" not in str(missing)
        for key in ("HessTrace", "TICTrace"):  # the GGN in place of the Hessian
            assert entry[f"{key}_estimate"]["curvature"] == "ggn"
        if entry["HessTrace_estimate"]["method"] != "ggn_exact":
            # no exact diagonal: TICDiag says so, and how
            assert "TICDiag" in missing and "Fix:" in missing["TICDiag"]
    return case, history, records


def check_ggn(case, entry, snapshot, kwargs, targets):
    """HessTrace, TICTrace and TICDiag against the brute-force GGN (float64)."""
    truth = dense_ggn(case, snapshot, kwargs, targets)
    estimate = entry["HessTrace_estimate"]
    got = torch.tensor(entry["HessTrace"], dtype=torch.float64)
    want = truth.traces
    tic_trace = truth.tic_trace()
    if estimate["method"] == "ggn_exact":
        torch.testing.assert_close(got, want, rtol=1e-8, atol=1e-12)
        assert math.isclose(entry["TICTrace"], tic_trace, rel_tol=1e-8)
        assert math.isclose(entry["TICDiag"], truth.tic_diag(), rel_tol=1e-6)
        assert estimate["stderr_sum"] == 0 == entry["TICTrace_estimate"]["stderr_sum"]
        return None
    assert estimate["method"] == "ggn_monte_carlo"
    total_error = estimate["stderr_sum"]
    assert abs(float(got.sum() - want.sum())) <= 4 * total_error
    # issue 26's goal: the summed trace's relative standard error at most 10 %
    assert total_error <= 0.10 * float(got.sum()), total_error / float(got.sum())
    stderr = torch.tensor(estimate["stderr"], dtype=torch.float64)
    deviation = (got - want).abs() / stderr
    assert float((deviation > 4).double().mean()) <= 0.1, deviation
    tic_error = entry["TICTrace_estimate"]["stderr_sum"]
    assert abs(entry["TICTrace"] - tic_trace) <= 4 * tic_error
    return total_error / float(got.sum())


def check_largest(entry, largest_magnitude, largest):
    value = entry["HessMaxEV"]
    assert math.isclose(value, largest_magnitude, rel_tol=1e-3), value
    if largest_magnitude < 0:
        got = entry["HessMaxEV_largest"]
        assert abs(got - largest) <= 1e-3 * abs(value) + 1e-6, (got, largest)
    else:
        assert "HessMaxEV_largest" not in entry


# GPT-2's second step has a negative eigenvalue of largest magnitude
@pytest.mark.parametrize("name, steps", [("gpt2", 2), ("vit", 1), ("llama", 1),
                                         ("t5", 1)])  # fmt: skip
def test_hugging_face_models_have_curvature_under_fused_attention(name, steps):
    case, history, records = tracked(name, steps)
    for step, (snapshot, kwargs, targets) in records.items():
        hvp, dim = math_hvp(case, snapshot, kwargs, targets)
        largest_magnitude = arpack(hvp, dim, "LM")
        largest = arpack(hvp, dim, "LA") if largest_magnitude < 0 else None
        check_largest(history[step], largest_magnitude, largest)
        check_ggn(case, history[step], snapshot, kwargs, targets)
    if name == "vit":  # 4 samples, 3 classes: the exact GGN diagonal
        assert all("TICDiag" in history[step] for step in records)


def test_hand_written_gpt_against_the_dense_hessian_and_ggn():
    case, history, records = tracked("tiny-gpt", 3)
    for step, (snapshot, kwargs, targets) in records.items():
        entry = history[step]
        hessian = dense_hessian(*math_hvp(case, snapshot, kwargs, targets))
        eigenvalues = torch.linalg.eigvalsh(hessian)
        largest_magnitude = float(eigenvalues[eigenvalues.abs().argmax()])
        check_largest(entry, largest_magnitude, float(eigenvalues[-1]))
        # 20 tokens, 7 classes: the Monte-Carlo GGN, within 10 % (check_ggn)
        assert entry["HessTrace_estimate"]["method"] == "ggn_monte_carlo"
        relative = check_ggn(case, entry, snapshot, kwargs, targets)
        assert 0 < relative <= 0.10, relative
