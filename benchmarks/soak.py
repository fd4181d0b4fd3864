"""Soak run: does resident memory stay flat over a long tracked training run?

Run from the repository root (takes a few minutes on a laptop CPU)::

    python -m benchmarks.soak          # 5,000 steps -> benchmarks/results/soak.md
    python -m benchmarks.soak --steps 500 --out /tmp/soak.md

The benchmark MLP (784-128-10, batch 32, random data; :mod:`benchmarks.problems`) is
trained with SGD while the ``full`` configuration is tracked: its cheap quantities
(Loss, GradNorm, Distance, UpdateSize; no BackPACK extension) at every step, all
others (per-sample gradients, curvature, HessMaxEV with ``create_graph``, 1-D and 2-D
histograms) every ``--interval`` steps. The history is streamed to a log file as in a
real run. Every ``--sample-every`` steps the resident set size (``/proc/self/statm``)
and the size of the in-memory history (``History.memory_bytes()``)
are recorded. Memory is flat if the RSS grows by no more than the history does.
By default the run is repeated in a child process with a fixed glibc mmap threshold
(``--mmap-threshold``), to tell allocator retention from memory in use.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import gc
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks import internals
from benchmarks.driver import RESULTS
from benchmarks.measure import REPO, tracked_step
from benchmarks.problems import make

DEFAULT_OUT = RESULTS / "soak.md"
CHEAP = ("Loss", "GradNorm", "Distance", "UpdateSize")
MIB = 2**20


def rss_bytes() -> int:
    """Current resident set size of this process."""
    with open("/proc/self/statm") as handle:
        resident_pages = int(handle.read().split()[1])
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


def settled_rss_bytes() -> int:
    """RSS after collecting garbage and returning free heap pages to the system.

    Without this, glibc keeps freed memory of the last expensive step mapped, and
    the raw RSS jumps by tens of MiB from sample to sample.
    """
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: report the raw value
        pass
    return rss_bytes()


def quantities(interval: int):
    """The ``full`` configuration: cheap quantities every step, others sparser."""
    made = []
    for cls in internals.configuration_classes("full"):
        every = 1 if cls.__name__ in CHEAP else interval
        made.append(cls(internals.schedule_every(every)))
    return made


def soak(
    steps: int, interval: int, sample_every: int, batch_size: int, logdir: str
) -> dict:
    """Train ``steps`` steps with cockpit; return the memory samples.

    Samples are taken after cheap steps (halfway between two expensive ones) and
    after the last step.
    """
    bench = make("mlp", batch_size=batch_size, need_plain=False)
    model = bench.extended
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    cockpit = internals.make_cockpit(
        model.named_parameters(),
        quantities(interval),
        logpath=os.path.join(logdir, "soak"),
    )
    samples = []
    start = time.perf_counter()
    for step in range(steps):
        tracked_step(cockpit, model, bench.loss_fn, optimizer, bench.batch(step), step)
        if step % sample_every == interval // 2 or step == steps - 1:
            seconds = time.perf_counter() - start
            samples.append(
                {
                    "step": step,
                    "raw_rss": rss_bytes(),
                    "rss": settled_rss_bytes(),
                    "history": internals.history_bytes(cockpit),
                    "seconds": seconds,
                }
            )
    cockpit.close()
    return {
        "samples": samples,
        "log_bytes": os.path.getsize(cockpit.logpath),
        "tracked_steps": len(cockpit.history),
        "params": sum(p.numel() for p in model.parameters()),
    }


def _row(sample: dict) -> str:
    return (
        f"| {sample['step']} | {sample['rss'] / MIB:.1f} | "
        f"{sample['raw_rss'] / MIB:.1f} | {sample['history'] / MIB:.2f} | "
        f"{sample['seconds']:.0f} |"
    )


def _summary(result: dict, steps: int) -> list[str]:
    """First, middle and last sample, and the growth beyond the history."""
    samples = result["samples"]
    first, middle, last = samples[0], samples[len(samples) // 2], samples[-1]
    lines = [
        "| point | step | RSS (MiB) | raw RSS (MiB) | history (MiB) |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for name, sample in (("first", first), ("middle", middle), ("last", last)):
        lines.append(
            f"| {name} | {sample['step']} | {sample['rss'] / MIB:.1f} | "
            f"{sample['raw_rss'] / MIB:.1f} | {sample['history'] / MIB:.2f} |"
        )
    history = (last["history"] - first["history"]) / MIB
    lines += [
        "",
        f"From step {first['step']} to step {last['step']} the in-memory history "
        f"grew by {history:.2f} MiB, the RSS by "
        f"{(last['rss'] - first['rss']) / MIB:.2f} MiB (growth beyond the history: "
        f"{(last['rss'] - first['rss']) / MIB - history:.2f} MiB) and the raw RSS by "
        f"{(last['raw_rss'] - first['raw_rss']) / MIB:.2f} MiB (beyond the history: "
        f"{(last['raw_rss'] - first['raw_rss']) / MIB - history:.2f} MiB). Wall time "
        f"{last['seconds']:.0f} s ({1e3 * last['seconds'] / steps:.1f} ms per step "
        "on average).",
    ]
    return lines


def report(result: dict, args: argparse.Namespace, fixed: dict | None) -> str:
    """Render the results (and those of the fixed-threshold run) as Markdown."""
    lines = [
        "# Soak run: resident memory over a long tracked run",
        "",
        f"Generated by `python -m benchmarks.soak --steps {args.steps} --interval "
        f"{args.interval} --sample-every {args.sample_every} --batch-size "
        f"{args.batch_size} --mmap-threshold {args.mmap_threshold}` on "
        f"{datetime.date.today().isoformat()} ({platform.machine()}, "
        f"{platform.python_implementation()} {platform.python_version()}, torch "
        f"{torch.__version__}, {torch.get_num_threads()} thread(s)).",
        "",
        f"Model: 784-128-10 MLP ({result['params']:,} parameters), batch "
        f"{args.batch_size}, SGD, random data. Tracked: the `full` configuration, "
        f"{', '.join(CHEAP)} at every step, the others every {args.interval} steps "
        f"({result['tracked_steps']} steps in the history); the history is streamed "
        f"to a log file ({result['log_bytes'] / MIB:.1f} MiB at the end).",
        "",
        "RSS: resident set size after `gc.collect()` and glibc's `malloc_trim(0)`, "
        "i.e. memory in use. Raw RSS: before them; it also counts freed heap that "
        "glibc keeps for reuse. History: `History.memory_bytes()`.",
        "",
        "## Default allocator settings",
        "",
    ]
    lines += _summary(result, args.steps)
    if fixed is not None:
        lines += [
            "",
            f"## With `MALLOC_MMAP_THRESHOLD_={args.mmap_threshold}`",
            "",
            "glibc raises its mmap threshold after large blocks are freed, so later "
            "large tensors (per-sample gradients, Hessian-vector products) come from "
            "the heap, whose freed pages can stay resident between the long-lived "
            "small objects of the history: the raw RSS may drift up while the memory "
            "in use does not. The same run in a fresh process with a fixed threshold, "
            "where large tensors are always mapped and unmapped:",
            "",
        ]
        lines += _summary(fixed, args.steps)
    lines += [
        "",
        "## Curve",
        "",
        "| step | RSS (MiB) | raw RSS (MiB) | history (MiB) | elapsed (s) |"
        + (" raw RSS, fixed threshold (MiB) |" if fixed else ""),
        "| ---: | ---: | ---: | ---: | ---: |" + (" ---: |" if fixed else ""),
    ]
    other = {s["step"]: s for s in fixed["samples"]} if fixed else {}
    for sample in result["samples"]:
        row = _row(sample)
        if fixed:
            twin = other.get(sample["step"])
            row += f" {twin['raw_rss'] / MIB:.1f} |" if twin else " |"
        lines.append(row)
    return "\n".join(lines) + "\n"


def _run_with_fixed_threshold(args: argparse.Namespace) -> dict:
    """Repeat the soak in a child process with a fixed glibc mmap threshold."""
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "fixed.json")
        command = [sys.executable, "-m", "benchmarks.soak", "--json", out]
        for flag in ("steps", "interval", "sample_every", "batch_size", "threads"):
            command += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(args.mmap_threshold))
        subprocess.run(command, cwd=REPO, env=env, check=True)
        with open(out) as handle:
            return json.load(handle)


def main(argv: list[str] | None = None) -> int:
    """Run the soak and write the report."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5000, help="training steps")
    parser.add_argument(
        "--interval", type=int, default=10, help="track expensive quantities every k"
    )
    parser.add_argument(
        "--sample-every", type=int, default=250, help="record RSS every k steps"
    )
    parser.add_argument("--batch-size", type=int, default=32, help="samples per step")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument(
        "--mmap-threshold",
        type=int,
        default=2**20,
        help="also run with this fixed glibc mmap threshold in bytes (0: skip)",
    )
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="Markdown report")
    parser.add_argument("--json", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as logdir:
        result = soak(
            args.steps, args.interval, args.sample_every, args.batch_size, logdir
        )
    if args.json is not None:  # the child of _run_with_fixed_threshold
        with open(args.json, "w") as handle:
            json.dump(result, handle)
        return 0
    fixed = _run_with_fixed_threshold(args) if args.mmap_threshold > 0 else None
    text = report(result, args, fixed)
    Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
