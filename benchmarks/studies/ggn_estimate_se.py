"""How precise the Monte-Carlo GGN trace is on the zoo, at the cost of the HVP budget.

For each model of ``tests/utils/hf_models.py`` (and the hand-written GPT), batch 4,
float32, one torch thread: the relative standard error of the summed GGN trace and
the median over tensors of each tensor's, from :func:`cockpit.curvature.ggn.
monte_carlo_ggn` with ``--draws`` labels (a draw is one backward pass, a
Hessian-vector product about two: 32 draws cost about what 16 Hutchinson probes
cost), and its CPU time over a plain training step's, medians over ``--steps``
batches. Compare with the HessTrace columns of ``benchmarks/results/curvature_zoo.md``::

    MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=1099511627776 \\
        python -m benchmarks.studies.ggn_estimate_se --steps 3 \\
        --out benchmarks/results/ggn_estimate_se.md
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def measure(name: str, steps: int, draws: int) -> dict:
    """Relative standard errors and time ratio of one model."""
    import torch

    from cockpit.curvature.ggn import monte_carlo_ggn
    from tests.utils import hf_models
    from tests.utils.hand_written import tiny_gpt

    torch.manual_seed(0)
    case = tiny_gpt() if name == "tiny-gpt" else hf_models.ZOO[name]()
    model = case.model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    rows = []
    for step in range(steps):
        kwargs, targets = case.inputs(hf_models.BATCH, step)
        clock = time.process_time()
        model.zero_grad()
        case.loss_fn(case.logits(model(**kwargs)), targets).backward()
        plain = time.process_time() - clock
        loss = case.loss_fn(case.logits(model(**kwargs)), targets)
        clock = time.process_time()
        est = monte_carlo_ggn(loss, params, draws, torch.Generator().manual_seed(step))
        cost = time.process_time() - clock
        traces = est.traces
        errors = traces.std(0) / draws**0.5
        means = traces.mean(0)
        total_se = float(traces.sum(1).std() / draws**0.5)
        rows.append({
            "rel_sum": total_se / float(means.sum()),
            "rel_tensor": statistics.median(
                float(e / m) for e, m in zip(errors, means) if m > 0
            ),
            "ratio": cost / plain,
        })  # fmt: skip
    return {
        key: statistics.median(r[key] for r in rows)
        for key in ("rel_sum", "rel_tensor", "ratio")
    }


def main(argv=None) -> None:
    """Measure every model and write the table."""
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt2,vit,llama,t5,bert,resnet,tiny-gpt")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--draws", type=int, default=32)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                            capture_output=True, text=True).stdout.strip()  # fmt: skip
    cpu = next(line.split(":", 1)[1].strip() for line in
               Path("/proc/cpuinfo").read_text().splitlines()
               if line.startswith("model name"))  # fmt: skip
    lines = [
        "# Monte-Carlo GGN trace on the zoo: relative standard errors",
        "",
        f"`python -m benchmarks.studies.ggn_estimate_se --steps {args.steps} --draws "
        f"{args.draws}` at commit {commit} on {cpu}, one torch thread, batch 4, "
        "float32; medians over the steps. The estimator is not wired into a "
        "quantity yet.",
        "",
        "| model | draws | GGN trace rel. SE (sum) | per-tensor rel. SE | "
        "estimate / plain step (CPU) |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for name in args.models.split(","):
        try:
            r = measure(name, args.steps, args.draws)
            lines.append(f"| {name} | {args.draws} | {r['rel_sum']:.1%} | "
                         f"{r['rel_tensor']:.0%} | {r['ratio']:.1f} |")  # fmt: skip
        except Exception as failure:  # noqa: BLE001 - reported in the table
            why = f"{type(failure).__name__}: {str(failure)[:100]}"
            lines.append(f"| {name} | {args.draws} | – | – | {why} |")
        print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
