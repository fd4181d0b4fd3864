"""What forming MeanGSNR's and EarlyStopping's variances centred costs (issue 37).

Run from the repository root (CPU, one thread; about a minute)::

    MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=1099511627776 \\
        python -m benchmarks.studies.centered_spread --rounds 15 \\
        --out benchmarks/results/centered_spread.json

The variances of MeanGSNR and EarlyStopping are now formed from the per-sample
gradients with the mean subtracted first (two-pass, block by block:
:meth:`cockpit.per_sample.IndividualGradients.centered`); before, they were the
difference ``sum_i g_i^2 - N g^2`` of the elementwise second moment (for a
``Linear`` weight one product of the squared factors, no per-sample gradient
formed). One process times, interleaved round by round (the order alternates;
CPU time, medians):

* ``plain``: zero_grad, forward, mean loss, backward, SGD step (no cockpit);
* ``centred``: the same step tracked by a cockpit with MeanGSNR and
  EarlyStopping (this code);
* ``difference``: the same, with the hook's reduction replaced by the former
  one (``sum_i g_i^2 - N g^2``, clamped at 0).

on two models of the 1.0.2 examples' kind: an MLP on MNIST-sized inputs
(784-512-256-10, batch 128) and a small CNN on CIFAR-sized ones (batch 64).
Writes the JSON record and a Markdown report next to it (``.md``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks import record
from benchmarks.measure import REPO

DEFAULT_OUT = REPO / "benchmarks" / "results" / "centered_spread.json"
VARIANTS = ("plain", "centred", "difference")


def _models():
    mlp = torch.nn.Sequential(
        torch.nn.Flatten(), torch.nn.Linear(784, 512), torch.nn.ReLU(),
        torch.nn.Linear(512, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10),
    )  # fmt: skip
    cnn = torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Flatten(), torch.nn.Linear(32 * 8 * 8, 10),
    )  # fmt: skip
    return {"mlp": (mlp, (128, 1, 28, 28)), "cnn": (cnn, (64, 3, 32, 32))}


def _difference_entry(view, epsilon, unbiased):
    """The former reduction: the variance as ``sum_i g_i^2 - N g^2``."""
    from cockpit.quantities import defined
    from cockpit.quantities import functional as F

    n = view.batch_size
    mean = view.mean_gradient().detach()
    spread = (view.sum_grad_squared().detach() - n * mean**2).clamp(min=0)
    snr = F.snr_sum_centered(mean, spread, n, epsilon, unbiased=unbiased)
    return snr, view.param.numel(), n, defined.snr_flag(mean, spread)


def _stepper(name: str, variant: str):
    from backpack import extend

    from cockpit import Cockpit
    from cockpit import quantities as Q
    from cockpit.utils.schedules import linear

    torch.manual_seed(0)
    model, shape = _models()[name]
    loss_fn = torch.nn.CrossEntropyLoss()
    x, y = torch.randn(shape), torch.randint(0, 10, (shape[0],))
    cockpit = None
    if variant != "plain":
        model, loss_fn = extend(model), extend(loss_fn)
        quantities = [Q.MeanGSNR(linear(1)), Q.EarlyStopping(linear(1))]
        cockpit = Cockpit(model.parameters(), quantities)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    state = {"step": 0}

    def step() -> None:
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        if cockpit is None:
            loss.backward()
        else:
            info = {"loss": loss, "batch_size": shape[0], "optimizer": opt}
            with cockpit(state["step"], info=info):
                loss.backward()
        opt.step()
        state["step"] += 1

    return step


def _timed(step) -> float:
    start = time.process_time()
    step()
    return time.process_time() - start


def measure(rounds: int, warmup: int = 2) -> dict:
    """Median CPU seconds per step of every variant, interleaved, per model."""
    from cockpit.quantities import batch_statistics

    centred_entry = batch_statistics.snr_entry
    results = {}
    for name in _models():
        steppers = {}
        for variant in VARIANTS:
            batch_statistics.snr_entry = (
                _difference_entry if variant == "difference" else centred_entry
            )
            steppers[variant] = _stepper(name, variant)
        times = {variant: [] for variant in VARIANTS}
        for r in range(warmup + rounds):
            order = VARIANTS if r % 2 == 0 else VARIANTS[::-1]
            for variant in order:
                batch_statistics.snr_entry = (
                    _difference_entry if variant == "difference" else centred_entry
                )
                seconds = _timed(steppers[variant])
                if r >= warmup:
                    times[variant].append(seconds)
        batch_statistics.snr_entry = centred_entry
        medians = {v: statistics.median(t) for v, t in times.items()}
        results[name] = {
            "median_s": medians,
            "centred_over_difference": medians["centred"] / medians["difference"],
            "centred_over_plain": medians["centred"] / medians["plain"],
            "difference_over_plain": medians["difference"] / medians["plain"],
            "times_s": times,
        }
        print(f"[{name}] " + ", ".join(f"{v} {m * 1e3:.1f} ms" for v, m in
                                        medians.items()), file=sys.stderr)  # fmt: skip
    return results


def _markdown(saved: dict) -> str:
    machine = saved["machine"]
    lines = [
        "# MeanGSNR/EarlyStopping: centred variances vs the difference of sums",
        "",
        f"Commit {machine['commit']}, {machine['cpu']} ({machine['cores']} cores, "
        f"load {machine['load']}), torch {machine['torch']}; "
        f"one thread; {saved['settings']['rounds']} interleaved rounds, CPU time "
        "medians per step (`python -m benchmarks.studies.centered_spread`).",
        "",
        "| model | plain ms | centred ms | difference ms | centred / difference "
        "| centred / plain |",
        "|---|---|---|---|---|---|",
    ]
    for name, result in saved["results"].items():
        m = result["median_s"]
        lines.append(
            f"| {name} | {m['plain'] * 1e3:.1f} | {m['centred'] * 1e3:.1f} | "
            f"{m['difference'] * 1e3:.1f} | {result['centred_over_difference']:.2f} "
            f"| {result['centred_over_plain']:.2f} |"
        )
    lines += ["", *saved["notes"], ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    """Measure, write the JSON record and the Markdown report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    results = measure(args.rounds)
    notes = [
        "The machine is shared (about eight agents on 2 cores): medians of "
        "interleaved rounds, ratios within one round's conditions.",
    ]
    saved = {
        "machine": record.machine(),
        "results": results,
        "notes": notes,
        "argv": list(sys.argv if argv is None else argv),
        "settings": {"rounds": args.rounds},
    }
    args.out.write_text(json.dumps(saved, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(_markdown(saved))
    return 0


if __name__ == "__main__":
    sys.exit(main())
