"""The unchanged 1.0.2 loop on real architectures: tracked / plain time, engines.

Every model of ``tests/utils/hf_models.py`` (Hugging Face BERT, GPT-2, ViT, ResNet,
Llama and T5 from small configs, BERT computing its own loss, and two hand-written
models with in-place residuals and children named ``output``/``input0``), float32,
default attention, in one process with one torch thread:

* **plain**: the model as built (not ``extend``-ed, no cockpit): ``zero_grad``,
  forward, the mean loss, ``backward``, an SGD step;
* **economy**, **business**, **full**: a copy with the same weights,
  ``backpack.extend``-ed, with ``Cockpit(model.parameters(),
  quantities=configuration(label))`` tracking every step, the 1.0.2 loop unchanged.

The variants take turns step by step (the order rotates every round) on the same
batches, after ``--warmup`` rounds; each step's CPU time (``time.process_time``)
and wall time are kept, and the ratio is the median tracked step over the median
plain step. The engines are counted from ``cockpit.coverage()`` after the rounds:
BackPACK, the replay engine (``autograd, replay of <module>``), one batched
backward pass per sample (``autograd, one batched backward ...``), unused.

Run (about ten minutes on two cores)::

    MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=1099511627776 \\
        python -m benchmarks.real_architectures \\
        --out benchmarks/results/real_architectures.json

``--table FILE`` prints the tables of a record again; ``--models bert,gpt2``,
``--batch``, ``--rounds``, ``--warmup`` choose what to measure.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

from benchmarks.driver import RESULTS

VARIANTS = ("plain", "economy", "business", "full")
DEFAULT_OUT = RESULTS / "real_architectures.json"


def _variant(case, label: str):
    """``step(kwargs, targets)`` of one variant and the cockpit (or ``None``)."""
    from backpack import extend

    from benchmarks.internals import make_cockpit, make_quantities

    model = copy.deepcopy(case.model)
    loss_fn = copy.deepcopy(case.loss_fn)
    cockpit = None
    if label != "plain":
        model = extend(model)
        loss_fn = extend(loss_fn) if loss_fn is not None else None
        cockpit = make_cockpit(model.parameters(), make_quantities(label))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    state = {"step": 0}

    def step(kwargs, targets) -> None:
        opt.zero_grad()
        outputs = model(**kwargs)
        logits = case.logits(outputs)
        if case.model_loss is not None:
            loss = case.model_loss(outputs)
        else:
            loss = loss_fn(logits, targets)
        if cockpit is None:
            loss.backward()
        else:
            losses = case.individual_loss_fn(logits, targets)
            info = {"batch_size": targets.shape[0], "individual_losses": losses,
                    "loss": loss, "optimizer": opt}  # fmt: skip
            with cockpit(state["step"], info=info):
                loss.backward(create_graph=cockpit.create_graph(state["step"]))
        opt.step()
        state["step"] += 1

    return step, cockpit


def engines_of(cockpit) -> dict[str, int]:
    """How many parameter tensors each engine (and way) served at the last step."""
    counts: dict[str, int] = {}
    for row in cockpit.coverage().params:
        route = row.route
        name = route.engine
        if name == "autograd":
            name = "replay" if route.method.startswith("replay of") else "per-sample"
        counts[name] = counts.get(name, 0) + 1
    return counts


def measure(name: str, batch: int, rounds: int, warmup: int) -> dict:
    """Interleaved step times of every variant on model ``name``."""
    from tests.utils import hf_models

    case = hf_models.build(name, dtype=torch.float32)
    variants = {label: _variant(case, label) for label in VARIANTS}
    times = {label: {"cpu": [], "wall": []} for label in VARIANTS}
    order = list(VARIANTS)
    for r in range(warmup + rounds):
        kwargs, targets = case.batch(batch, r)
        for label in order:
            step, _ = variants[label]
            wall, cpu = time.perf_counter(), time.process_time()
            step(kwargs, targets)
            cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
            if r >= warmup:
                times[label]["cpu"].append(cpu)
                times[label]["wall"].append(wall)
        order = order[1:] + order[:1]
    medians = {
        label: {clock: statistics.median(values) for clock, values in found.items()}
        for label, found in times.items()
    }
    result = {"tensors": len(list(case.model.parameters())), "median_s": medians}
    for label in VARIANTS[1:]:
        _, cockpit = variants[label]
        result[label] = {
            "ratio_cpu": medians[label]["cpu"] / medians["plain"]["cpu"],
            "ratio_wall": medians[label]["wall"] / medians["plain"]["wall"],
            "engines": engines_of(cockpit),
            "not_exact": sorted(
                {p.split(" for ")[0] for p in cockpit.coverage().problems()}
            ),
        }
    return result


def table(record: dict) -> str:
    """Markdown tables of a record."""
    lines = [
        f"commit {record['machine']['commit']}, {record['machine']['cpu']}, "
        f"{record['machine']['cores']} cores, load {record['machine']['load']}, "
        f"torch {record['machine']['torch']}, batch {record['settings']['batch']}, "
        f"{record['settings']['rounds']} rounds after {record['settings']['warmup']}"
        ", one torch thread, float32",
        "",
        "| model | plain step (CPU) | economy | business | full | engines "
        "(economy) | not exact (full) |",
        "|---|---:|---:|---:|---:|---|---|",
    ]
    for name, found in record["results"].items():
        plain = found["median_s"]["plain"]["cpu"] * 1e3
        ratios = " | ".join(
            f"{found[v]['ratio_cpu']:.1f}x ({found[v]['ratio_wall']:.1f}x wall)"
            for v in VARIANTS[1:]
        )
        engines = ", ".join(
            f"{n} {e}" for e, n in sorted(found["economy"]["engines"].items())
        )
        missing = ", ".join(found["full"]["not_exact"]) or "-"
        lines.append(
            f"| {name} ({found['tensors']} tensors) | {plain:.1f} ms | {ratios} "
            f"| {engines} | {missing} |"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    """Measure (or print a record's tables)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    parser.add_argument("--models", default="")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--table", metavar="FILE", default=None)
    args = parser.parse_args(argv)
    if args.table:
        print(table(json.loads(Path(args.table).read_text())))
        return
    from benchmarks.record import machine
    from tests.utils import hf_models

    torch.set_num_threads(1)
    logging.getLogger("cockpit").setLevel(logging.WARNING)
    warnings.simplefilter("ignore")  # curvature not covered: in the record
    names = args.models.split(",") if args.models else [*hf_models.ZOO, *hf_models.MORE]
    results = {}
    for name in names:
        results[name] = measure(name, args.batch, args.rounds, args.warmup)
        print(name, {v: round(results[name][v]["ratio_cpu"], 1) for v in VARIANTS[1:]},
              file=sys.stderr)  # fmt: skip
    record = {
        "machine": machine(),
        "settings": {"batch": args.batch, "rounds": args.rounds, "warmup": args.warmup},
        "argv": sys.argv,
        "results": results,
    }
    Path(args.out).write_text(json.dumps(record, indent=1))
    print(table(record))


if __name__ == "__main__":
    main()
