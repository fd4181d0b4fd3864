"""``cockpit plot --html`` on 20,000-step logs: time, peak memory, file size.

Run from the repository root (a few minutes on two CPU cores)::

    python -m benchmarks.html_dashboard --out benchmarks/results/html_dashboard.md
    python -m benchmarks.html_dashboard --steps 2000 --repeats 1 --out /tmp/h.md

Two logs of ``--steps`` tracked steps each are written, with what the
``economy`` configuration records at every step of a 4-tensor network (loss,
per-tensor gradient norms, distance and update size, Alpha, the three gradient
tests, a 100-bin gradient histogram, the learning rate) plus train/validation
loss and accuracy every 10th step; values are random walks (the reading and
writing cost does not depend on them). Then, each command in a fresh process
under ``/usr/bin/time -v`` (wall time, CPU time and peak resident memory, median
of ``--repeats``, the variants interleaved), with ``MALLOC_MMAP_MAX_=0`` and a
huge ``MALLOC_TRIM_THRESHOLD_`` as in :mod:`benchmarks.measure`:

* ``cockpit plot A --html a.html`` (one run),
* ``cockpit plot A B --html ab.html`` (two runs side by side),
* ``cockpit plot A -o a.png`` (the PNG, for comparison),

and the size of each HTML file.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile

import numpy as np

from benchmarks.driver import RESULTS
from benchmarks.internals import new_history
from benchmarks.measure import CHILD_ENV, REPO

DEFAULT_OUT = RESULTS / "html_dashboard.md"
MIB = 2**20


def economy_steps(steps: int, seed: int, accuracies: bool = True):
    """``(step, values)`` shaped like what ``economy`` records at every step.

    Every tenth step adds train and valid losses (and, with ``accuracies``, the
    accuracies) as a user's ``Cockpit.log`` would.
    """
    rng = np.random.default_rng(seed)
    edges = np.linspace(-2, 2, 101).tolist()
    norms = np.abs(rng.normal(1, 0.1, 4))
    distance = np.zeros(4)
    for step in range(steps):
        norms = np.abs(norms + rng.normal(0, 0.01, 4))
        distance = distance + np.abs(rng.normal(0, 0.01, 4))
        values = {
            "Loss": float(2 * np.exp(-step / (steps / 5)) + 0.1 * rng.random()),
            "GradNorm": norms.tolist(),
            "Distance": distance.tolist(),
            "UpdateSize": np.abs(rng.normal(0, 0.01, 4)).tolist(),
            "Alpha": float(rng.normal(-0.2, 0.4)),
            "NormTest": float(1 + 0.2 * rng.random()),
            "InnerTest": float(0.3 + 0.1 * rng.random()),
            "OrthoTest": float(1 + 0.2 * rng.random()),
            "GradHist1d": {
                "hist": np.histogram(rng.normal(0, 0.3, 2000), edges)[0].tolist(),
                "edges": edges,
            },
            "learning_rates": [0.1],
        }
        if step % 10 == 0:
            values.update(train_loss=values["Loss"], valid_loss=values["Loss"] + 0.1)
            if accuracies:
                values.update(
                    train_accuracy=float(1 - values["Loss"] / 3),
                    valid_accuracy=float(0.95 - values["Loss"] / 3),
                )
        yield step, values


def write_log(path: str, steps: int, seed: int) -> str:
    """A streamed-size log shaped like an ``economy`` run's (see the docstring)."""
    history = new_history()
    for step, values in economy_steps(steps, seed):
        for key, value in values.items():
            history.add(step, key, value)
    return history.write_json(path)


def measure(command: list[str]) -> dict:
    """Wall time, CPU time and peak RSS of one command in a fresh process."""
    done = subprocess.run(["/usr/bin/time", "-v", *command], env=CHILD_ENV,
                          capture_output=True, text=True, check=True)  # fmt: skip
    text = done.stderr

    def field(name: str) -> str:
        return re.search(rf"{re.escape(name)}: (.+)", text)[1].strip()

    wall = field("Elapsed (wall clock) time (h:mm:ss or m:ss)").split(":")
    seconds = float(wall[-1]) + 60 * float(wall[-2])
    if len(wall) == 3:
        seconds += 3600 * float(wall[0])
    cpu = float(field("User time (seconds)")) + float(field("System time (seconds)"))
    return {
        "wall_s": seconds,
        "cpu_s": cpu,
        "peak_rss_mib": int(field("Maximum resident set size (kbytes)")) / 1024,
    }


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and write the results file."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    args = parser.parse_args(argv)
    cockpit = [sys.executable, "-m", "cockpit"]
    with tempfile.TemporaryDirectory() as work:
        a = write_log(os.path.join(work, "a.json"), args.steps, 0)
        b = write_log(os.path.join(work, "b.json"), args.steps, 1)
        variants = {
            "plot A --html (one run)": cockpit
            + ["plot", a, "--html", f"{work}/a.html"],
            "plot A B --html (two runs)": cockpit
            + ["plot", a, b, "--html", f"{work}/ab.html"],
            "plot A -o a.png (PNG, for comparison)": cockpit
            + ["plot", a, "-o", f"{work}/a.png"],
        }
        found: dict[str, list[dict]] = {name: [] for name in variants}
        for _ in range(args.repeats):  # interleaved
            for name, command in variants.items():
                found[name].append(measure(command))
        sizes = {
            "one run": os.path.getsize(f"{work}/a.html"),
            "two runs": os.path.getsize(f"{work}/ab.html"),
            "log A": os.path.getsize(a),
        }
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                            capture_output=True, text=True).stdout.strip()  # fmt: skip
    cpu = subprocess.run("lscpu | grep 'Model name'", shell=True, capture_output=True,
                         text=True).stdout.split(":", 1)[-1].strip()  # fmt: skip
    lines = [
        "# `cockpit plot --html` on long logs",
        "",
        f"`python -m benchmarks.html_dashboard --steps {args.steps} --repeats "
        f"{args.repeats}`; {datetime.date.today()}, commit {commit}, {cpu}, "
        f"{os.cpu_count()} CPUs, Python {platform.python_version()}; each command "
        "in a fresh process, medians of the repeats (interleaved); the machine is "
        "shared with other jobs, so wall times vary more than CPU times.",
        "",
        f"Logs: {args.steps:,} tracked steps each, what `economy` records at every "
        f"step (log A: {sizes['log A'] / MIB:.1f} MiB).",
        "",
        "| command | wall (s) | CPU (s) | peak RSS (MiB) |",
        "| --- | ---: | ---: | ---: |",
    ]
    for name, runs in found.items():
        wall = statistics.median(r["wall_s"] for r in runs)
        cpu_s = statistics.median(r["cpu_s"] for r in runs)
        rss = statistics.median(r["peak_rss_mib"] for r in runs)
        lines.append(f"| `cockpit {name}` | {wall:.1f} | {cpu_s:.1f} | {rss:.0f} |")
    lines += [
        "",
        f"HTML file: {sizes['one run'] / MIB:.2f} MiB for one run, "
        f"{sizes['two runs'] / MIB:.2f} MiB for two (uPlot and the page's script: "
        "about 75 KiB of it; every series at full resolution, six significant "
        "digits).",
        "",
    ]
    with open(args.out, "w", encoding="utf-8") as handle:
        handle.write("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
