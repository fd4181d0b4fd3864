"""Randomised Hessian trace/diagonal estimators: ours against curvlinops (issue 11).

Measures, at equal budgets of Hessian-vector products, the error and the wall
time of cockpit's hand-written Hutchinson estimator
(:func:`cockpit.engines.autograd.hutchinson_diagonals`) and of curvlinops'
``hutchinson_trace``, ``hutchpp_trace``, ``xtrace``, ``hutchinson_diag`` and
``xdiag`` on its ``HessianLinearOperator``, against the exact (dense, float64)
Hessian of the mean loss of three tiny any-model test problems.

Run from the repository root::

    python -m benchmarks.studies.estimators    # ours only; curvlinops "not installed"
    /tmp/curvenv/bin/python -m benchmarks.studies.estimators   # with curvlinops

(``/tmp/curvenv`` is a throwaway virtual environment holding
``curvlinops-for-pytorch``; curvlinops is *not* a dependency of cockpit.)
Options: ``--seeds N`` (default 50), ``--budgets 6,12,16,24,48`` (Hutch++ runs
only where a budget is divisible by 3, XTrace/XDiag where it is even; all below
the smallest model's dimension, 50),
``--output PATH`` for the JSON record (default
``benchmarks/results/estimators.json``; ``--output -`` writes none).
Everything runs with one thread.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.attention

from benchmarks import internals
from benchmarks.driver import RESULTS
from tests.utils.any_model import make_any_problem

MODELS = ("transformer", "tied-custom", "rmsnorm-mlp")
BUDGETS = (6, 12, 16, 24, 48)
SEEDS = 50
BATCH_SIZE = 8

try:  # optional: only in the throwaway environment
    import curvlinops
except ImportError:  # pragma: no cover - depends on the environment
    curvlinops = None


def curvlinops_version() -> str:
    """The installed curvlinops version, or ``"not installed"``."""
    if curvlinops is None:
        return "not installed"
    try:
        from importlib.metadata import version

        return version("curvlinops-for-pytorch")
    except Exception:  # noqa: BLE001
        return getattr(curvlinops, "__version__", "unknown")


def setup(arch: str, batch_size: int = BATCH_SIZE):
    """``(problem, params, x, y)`` for one model and its first batch.

    ``make_any_problem`` extends the model with BackPACK, whose module hooks
    curvlinops' functorch transforms reject; both sides therefore use the same
    plain model (the hooks removed), so neither pays for them.
    """
    problem = make_any_problem(arch, batch_size=batch_size)
    for module in problem.model.modules():
        for hooks in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks"):
            getattr(module, hooks).clear()
        module._backward_pre_hooks.clear()
        module._is_full_backward_hook = None
    x, y = problem.make_batch(0)
    return problem, problem.params, x, y


def mean_loss(problem, x, y):
    return problem.individual_loss_fn(problem.model(x), y).mean()


def exact_hessian(problem, params, x, y) -> torch.Tensor:
    """Dense Hessian ``[D, D]`` of the mean loss (double backward, row by row)."""
    grads = torch.autograd.grad(mean_loss(problem, x, y), params, create_graph=True)
    flat = torch.cat([g.reshape(-1) for g in grads])
    rows = []
    for i in range(flat.numel()):
        row = torch.autograd.grad(flat[i], params, retain_graph=True, allow_unused=True)
        rows.append(
            torch.cat(
                [
                    torch.zeros(p.numel(), dtype=flat.dtype)
                    if r is None
                    else r.reshape(-1)
                    for p, r in zip(params, row, strict=True)
                ]
            )
        )
    return torch.stack(rows).detach()


# --- estimators: each returns (trace, standard error or None, diagonal or None) ----
def ours(problem, params, x, y, budget, seed):
    generator = torch.Generator().manual_seed(seed)
    losses = problem.individual_loss_fn(problem.model(x), y)
    diagonals, table, error = internals.hutchinson_estimate(
        losses, params, budget, generator
    )
    diagonal = torch.cat([d.reshape(-1) for d in diagonals])
    return table.sum(1).mean().item(), error.item(), diagonal


def _operator(problem, params, x, y):
    return curvlinops.HessianLinearOperator(
        problem.model,
        torch.nn.CrossEntropyLoss(reduction="mean"),
        params,
        [(x, y)],
        check_deterministic=False,
    )


def _curvlinops(name):
    def estimate(problem, params, x, y, budget, seed):
        torch.manual_seed(seed)  # curvlinops draws from the global generator
        op = _operator(problem, params, x, y)  # built inside the timing: cheap
        result = getattr(curvlinops, name)(op, budget)
        if name.endswith("diag"):
            return None, None, result.detach().reshape(-1)
        return result.item(), None, None

    return estimate


def estimators() -> dict:
    """Name -> estimator; curvlinops ones only when it is importable."""
    table = {"ours (hutchinson_diagonals)": ours}
    if curvlinops is not None:
        for name in ("hutchinson_trace", "hutchpp_trace", "xtrace"):
            table[f"curvlinops.{name}"] = _curvlinops(name)
        for name in ("hutchinson_diag", "xdiag"):
            if hasattr(curvlinops, name):
                table[f"curvlinops.{name}"] = _curvlinops(name)
    return table


def valid(name: str, budget: int) -> bool:
    """Hutch++ needs a budget divisible by 3, XTrace and XDiag an even one."""
    if name.endswith("hutchpp_trace"):
        return budget % 3 == 0
    if name.endswith(("xtrace", "xdiag")):
        return budget % 2 == 0
    return True


def measure_model(arch, budgets=BUDGETS, seeds=SEEDS, batch_size=BATCH_SIZE):
    """The record of one model: exact trace, and per budget and estimator the stats."""
    problem, params, x, y = setup(arch, batch_size)
    hessian = exact_hessian(problem, params, x, y)
    exact_diag = hessian.diagonal()
    exact = exact_diag.sum().item()
    record = {
        "model": arch,
        "dimension": hessian.shape[0],
        "exact_trace": exact,
        "hessian_frobenius": hessian.norm().item(),
        "diag_mean_square": (exact_diag**2).mean().item(),
        "budgets": {},
    }
    record["theory_hutchinson_std"] = {}
    for budget in budgets:
        # Rademacher Hutchinson: Var = 2 (||H||_F^2 - ||diag H||^2) / budget
        theory = (2 * (hessian.norm() ** 2 - (exact_diag**2).sum()) / budget) ** 0.5
        record["theory_hutchinson_std"][str(budget)] = theory.item()
        rows = {}
        for name, estimate in estimators().items():
            traces, errors, diag_mse, times = [], [], [], []
            if not valid(name, budget):
                rows[name] = {"skipped": "budget not divisible by 3 / 2"}
                continue
            for seed in range(seeds):
                start = time.perf_counter()
                trace, error, diagonal = estimate(problem, params, x, y, budget, seed)
                times.append(time.perf_counter() - start)
                if trace is not None:
                    traces.append(trace)
                if error is not None:
                    errors.append(error)
                if diagonal is not None:
                    diag_mse.append(((diagonal - exact_diag) ** 2).mean().item())
            row = {"median_time_s": statistics.median(times), "seeds": seeds}
            if traces:
                spread = statistics.stdev(traces)
                mean = statistics.fmean(traces)
                row.update(
                    mean=mean,
                    std=spread,
                    bias=mean - exact,
                    # mean minus exact in standard errors of the mean over seeds
                    bias_in_se=(mean - exact) / (spread / seeds**0.5)
                    if spread > 0
                    else 0.0,
                    rmse=statistics.fmean([(t - exact) ** 2 for t in traces]) ** 0.5,
                )
            if errors:
                row["mean_reported_se"] = statistics.fmean(errors)
                row["se_over_std"] = row["mean_reported_se"] / row["std"]
            if diag_mse:
                row["diag_mse"] = statistics.fmean(diag_mse)
            rows[name] = row
        record["budgets"][str(budget)] = rows
    return record


def run(models=MODELS, budgets=BUDGETS, seeds=SEEDS) -> dict:
    """All models; the attention's second derivative needs the math SDPA kernel."""
    torch.set_num_threads(1)
    with (
        torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH),
        warnings.catch_warnings(),
    ):
        warnings.filterwarnings("ignore", message="Full backward hook")
        measured = [measure_model(m, budgets, seeds) for m in models]
    return {
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "curvlinops": curvlinops_version(),
        },
        "threads": torch.get_num_threads(),
        "seeds": seeds,
        "budgets": list(budgets),
        "models": measured,
    }


def markdown(result) -> str:
    lines = []
    for model in result["models"]:
        lines += [
            f"### {model['model']} (D = {model['dimension']}, exact trace "
            f"{model['exact_trace']:.6g}, ||H||_F {model['hessian_frobenius']:.4g}, "
            f"mean diag^2 {model['diag_mean_square']:.4g})",
            "",
            "| HVPs | estimator | std | bias / SE(mean) | RMSE | reported SE / std "
            "| diag MSE | median time [ms] |",
            "|---:|---|---:|---:|---:|---:|---:|---:|",
        ]
        for budget, rows in model["budgets"].items():
            theory = model["theory_hutchinson_std"][budget]
            lines.append(
                f"| {budget} | (theory: Rademacher Hutchinson) | {theory:.4g} "
                "| | | | | |"
            )
            for name, row in rows.items():
                if "skipped" in row:
                    lines.append(
                        f"| {budget} | {name} | ({row['skipped']}) | | | | | |"
                    )
                    continue

                def cell(key, fmt, row=row):
                    return format(row[key], fmt) if key in row else "-"

                lines.append(
                    f"| {budget} | {name} | {cell('std', '.4g')} | "
                    f"{cell('bias_in_se', '+.2f')} | {cell('rmse', '.4g')} | "
                    f"{cell('se_over_std', '.2f')} | {cell('diag_mse', '.3g')} | "
                    f"{row['median_time_s'] * 1e3:.2f} |"
                )
        lines.append("")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=SEEDS)
    parser.add_argument("--budgets", default=",".join(map(str, BUDGETS)))
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--output", default=str(RESULTS / "estimators.json"))
    args = parser.parse_args(argv)
    start = time.perf_counter()
    result = run(
        args.models.split(","),
        [int(b) for b in args.budgets.split(",")],
        args.seeds,
    )
    result["total_time_s"] = time.perf_counter() - start
    result["command"] = " ".join([Path(sys.executable).as_posix(), *sys.argv])
    print(markdown(result))
    print(f"versions: {result['versions']}; total {result['total_time_s']:.1f} s")
    if args.output != "-":
        Path(args.output).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
