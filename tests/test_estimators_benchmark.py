"""Smoke test of ``benchmarks/studies/estimators.py`` at a tiny setting (ours only)."""

import torch

from benchmarks.studies import estimators


def test_estimators_benchmark_smoke():
    threads = torch.get_num_threads()
    try:
        result = estimators.run(models=("rmsnorm-mlp",), budgets=(6, 12), seeds=12)
    finally:
        torch.set_num_threads(threads)

    assert set(result) >= {"versions", "threads", "seeds", "budgets", "models"}
    assert result["versions"]["torch"] == torch.__version__
    assert result["budgets"] == [6, 12]
    (model,) = result["models"]
    assert model["model"] == "rmsnorm-mlp"
    assert model["dimension"] == 57
    assert set(model["budgets"]) == {"6", "12"}
    assert set(model["theory_hutchinson_std"]) == {"6", "12"}
    for rows in model["budgets"].values():
        ours = rows["ours (hutchinson_diagonals)"]
        assert set(ours) >= {
            "mean",
            "std",
            "bias_in_se",
            "mean_reported_se",
            "se_over_std",
            "diag_mse",
            "median_time_s",
        }
        # unbiased: the mean over seeds lies within 4 standard errors of exact
        assert abs(ours["mean"] - model["exact_trace"]) < 4 * ours["std"] / 12**0.5
        assert ours["std"] > 0 and ours["median_time_s"] > 0
        if estimators.curvlinops is None:
            assert list(rows) == ["ours (hutchinson_diagonals)"]
    assert "rmsnorm-mlp" in estimators.markdown(result)


def test_exact_hessian_is_symmetric():
    """The dense Hessian of the mean loss is square and symmetric."""
    problem, params, x, y = estimators.setup("tied-custom", batch_size=4)
    hessian = estimators.exact_hessian(problem, params, x, y)
    assert hessian.shape == (50, 50)
    assert torch.allclose(hessian, hessian.T, atol=1e-10)
