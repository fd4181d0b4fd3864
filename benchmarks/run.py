"""Overhead benchmark: how much slower and larger a training step gets with cockpit.

Run from the repository root::

    python -m benchmarks.run    # everything; writes benchmarks/results/overhead.md
    python -m benchmarks.run --quick --problems mlp --configs economy,GradNorm

This module is the command line only. The work is done by

* :mod:`benchmarks.measure`: one configuration in a fresh child process (step times
  of plain against tracked steps, peak RSS), with :mod:`benchmarks.blocks` (the
  BackPACK building blocks) and :mod:`benchmarks.problems` (the models);
* :mod:`benchmarks.retry`: re-measuring what ran on a busy machine (``--fix``);
* :mod:`benchmarks.record` and :mod:`benchmarks.report`: the JSON record
  (``--json``) and the Markdown made from it (``--out``, ``--render``);
* :mod:`benchmarks.reference`: the same run with cockpit-for-pytorch 1.0.2
  (``--reference``);
* :mod:`benchmarks.internals`: the only module that imports cockpit.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks import blocks, internals, measure, record, reference, report, retry
from benchmarks.driver import RESULTS

DEFAULT_OUT = RESULTS / "overhead.md"
#: Hand-written analysis appended to the results (floors of the missed targets).
DEFAULT_ANALYSIS = RESULTS / "overhead_analysis.md"


def plan(args) -> tuple[list[str], list[str]]:
    """Turn ``--configs`` into a list of specs to measure, plus notes."""
    wanted = [c.strip() for c in args.configs.split(",") if c.strip()]
    configs, config_notes = internals.discover_configurations()
    quantities, quantity_notes = internals.discover_quantities()
    every_block = [blocks.PREFIX + b for b in blocks.BLOCKS]
    specs, notes = [], config_notes + quantity_notes
    for item in wanted:
        if item == "all":
            specs += configs + quantities + every_block
        elif item == "configs":
            specs += configs
        elif item == "quantities":
            specs += quantities
        elif item == "blocks":
            specs += every_block
        elif item in internals.CONFIGURATIONS:
            if item in configs:
                specs.append(item)
            else:
                notes.append(f"{item!r} requested but not available")
        elif item in blocks.BLOCKS or blocks.is_block(item):
            specs.append(item if blocks.is_block(item) else blocks.PREFIX + item)
        elif item in quantities:
            specs.append(item)
        else:
            notes.append(f"{item!r} is no configuration, quantity or block: skipped")
    return list(dict.fromkeys(specs)), notes


def parse(argv=None):
    """Parse the command line."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.run",
        description="Measure cockpit's step-time and memory overhead.",
    )
    parser.add_argument(
        "--problems", default="mlp,3c3d", help="comma list of mlp, 3c3d"
    )
    parser.add_argument(
        "--configs",
        default="all",
        help="comma list: all, configs, quantities, blocks, economy, business, full, "
        "quantity class names, block names (BatchGrad, ..., vmap_grad, HVP)",
    )
    parser.add_argument("--repeats", type=int, default=None, help="timed pairs")
    parser.add_argument("--warmup", type=int, default=None, help="untimed pairs")
    parser.add_argument(
        "--memory-steps", type=int, default=None, help="steps of a memory run"
    )
    parser.add_argument("--no-memory", action="store_true", help="skip memory runs")
    parser.add_argument("--no-time", action="store_true", help="skip timing runs")
    parser.add_argument(
        "--quick", action="store_true", help="few repeats, for development"
    )
    parser.add_argument(
        "--min-time",
        type=float,
        default=None,
        help="keep adding timed pairs until they took this many seconds",
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--clock",
        choices=sorted(measure.CLOCKS),
        default="wall",
        help="wall (default; what results.md reports) or cpu: process CPU time, "
        "steadier on a busy machine, meaningful with --threads 1",
    )
    parser.add_argument("--timeout", type=float, default=3600, help="seconds/child")
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="Markdown output")
    parser.add_argument("--json", default=None, help="also write raw results here")
    parser.add_argument(
        "--busy-factor",
        type=float,
        default=3.0,
        help="re-measure a configuration whose median plain step is this many times "
        "the fastest of its problem (another process was running)",
    )
    parser.add_argument("--retries", type=int, default=2, help="re-measurements")
    parser.add_argument(
        "--fix",
        default=None,
        metavar="JSON",
        help="re-measure the busy configurations of a --json record, update it and "
        "rewrite --out",
    )
    parser.add_argument(
        "--remeasure",
        default=None,
        metavar="PROBLEM:SPEC,...",
        help="with --fix: also measure these again, e.g. mlp:block:DiagGGNMC",
    )
    parser.add_argument(
        "--render",
        default=None,
        metavar="JSON",
        help="measure nothing: rewrite --out from a record written with --json",
    )
    parser.add_argument(
        "--analysis",
        default=str(DEFAULT_ANALYSIS),
        help="Markdown appended to the output if it exists ('' for none)",
    )
    parser.add_argument(
        "--reference",
        action="store_true",
        help="also measure every configuration and quantity with cockpit-for-pytorch "
        "1.0.2 (installed into a throwaway virtual environment), interleaved with "
        "ours, and report its ratios next to ours",
    )
    parser.add_argument(
        "--reference-venv",
        default=None,
        metavar="DIR",
        help="with --reference: create (or reuse) the environment here and keep it",
    )
    parser.add_argument(
        "--reference-package",
        default=reference.PACKAGE,
        metavar="REQUIREMENT",
        help="with --reference: what to install (default %(default)s)",
    )
    args = parser.parse_args(argv)
    if args.repeats is None:
        args.repeats = 3 if args.quick else 9
    if args.warmup is None:
        args.warmup = 1 if args.quick else 2
    if args.min_time is None:
        args.min_time = 1.0 if args.quick else 4.0
    if args.memory_steps is None:
        args.memory_steps = 2 if args.quick else 3
    return args


@dataclass
class Variant:
    """One cockpit to measure: where its children run and where results go.

    Attributes:
        results: problem -> spec -> mode -> result, filled in by :func:`measure_all`.
        interpreter: How its children start.
        label: Put before specs in progress lines and notes ('' for ours).
        offers: The specs it can measure (None: all).
    """

    results: dict = field(default_factory=dict)
    interpreter: measure.Interpreter = measure.OURS
    label: str = ""
    offers: set | None = None

    def measures(self, spec: str) -> bool:
        """Whether this variant measures ``spec``."""
        return self.offers is None or spec in self.offers


def measure_all(problem: str, specs: list[str], args, variants: list) -> None:
    """Measure every spec on one problem with every variant, alternating their order.

    Each spec is measured by all variants one after the other (time, then memory),
    ours first for even specs and last for odd ones, so that drift in the machine's
    speed does not favour one of them.
    """
    for variant in variants:
        variant.results.setdefault(problem, {})
    if not args.no_memory:
        for variant in variants:
            variant.results[problem]["plain"] = {
                "memory": measure.run_child(
                    problem, "plain", "memory", args, variant.interpreter
                )
            }
    for index, spec in enumerate(specs):
        for variant in variants if index % 2 == 0 else variants[::-1]:
            if not variant.measures(spec):
                continue
            entry = variant.results[problem].setdefault(spec, {})
            if not args.no_time:
                entry["time"] = measure.run_child(
                    problem, spec, "time", args, variant.interpreter
                )
            if not args.no_memory and not blocks.is_block(spec):
                entry["memory"] = measure.run_child(
                    problem, spec, "memory", args, variant.interpreter
                )
            print(
                f"[{problem}] {variant.label}{spec}: {measure.summary(entry)}",
                file=sys.stderr,
                flush=True,
            )


def _reference_variant(args, stack, specs: list[str], notes: list[str]) -> Variant:
    """Set up the reference package's environment (closed by ``stack``)."""
    interpreter, name, about = stack.enter_context(
        reference.interpreter(args.reference_venv, args.reference_package)
    )
    offers = set(internals.CONFIGURATIONS) | set(about["quantities"])
    missing = [s for s in specs if s not in offers and not blocks.is_block(s)]
    if missing:
        notes.append(f"{name} has no {', '.join(missing)}: not measured with it")
    return Variant(interpreter=interpreter, label=name + " ", offers=offers)


def main(argv=None) -> None:
    """Run every requested configuration in child processes and write the report."""
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    if args.render:
        saved = record.read(args.render)
        Path(args.out).write_text(report.render(saved, args.analysis) + "\n")
        print(f"wrote {args.out} from {args.render}", file=sys.stderr)
        return
    if args.fix:
        retry.fix(args)
        return
    args.problems = [p.strip() for p in args.problems.split(",") if p.strip()]
    specs, notes = plan(args)
    variants = [Variant()]
    with contextlib.ExitStack() as stack:
        if args.reference:
            variants.append(_reference_variant(args, stack, specs, notes))
        for problem in args.problems:
            measure_all(problem, specs, args, variants)
        for variant in variants:
            notes += retry.retry_busy(
                variant.results, args, variant.interpreter, variant.label
            )
    theirs = None
    if args.reference:
        theirs = {
            "package": variants[1].label.strip(),
            "requirement": args.reference_package,
            "results": variants[1].results,
        }
    saved = record.new(variants[0].results, notes, argv, args, theirs)
    Path(args.out).write_text(report.render(saved, args.analysis) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    if args.json:
        record.write(args.json, saved)


if __name__ == "__main__":
    main()
