"""Long runs: log bytes per tracked step, ``cockpit plot`` on a long log, live redraws.

Run from the repository root (about five minutes on two CPU cores)::

    python -m benchmarks.long_runs       # -> benchmarks/results/long_runs.md
    python -m benchmarks.long_runs --steps 2000 --out /tmp/long.md      # quicker
    python -m benchmarks.long_runs --before /path/to/older/checkout     # before/after

1. **Log size.** The benchmark MLP (784-128-10, batch 32, random data;
   :mod:`benchmarks.problems`) trains ``--train-steps`` steps with the ``full``
   configuration tracked at every step, streaming its log. Then the history is
   written packed (the default of ``cockpit.write``), plain (``packed=False``) and
   in 1.0.2's layout (``legacy=True``). Bytes per tracked step = file size /
   tracked steps.
2. **A long log.** ``--steps`` records shaped like the real ones (the real run's
   records in turn, scalars and per-parameter values scaled by random factors, the
   histograms as recorded) are written as a streamed log (``.jsonl``, record by
   record as a run does), as a packed ``.json`` and, unless ``--no-plain``, as a
   plain indent-2 ``.json`` (the layout every cockpit log had before packing).
3. **``cockpit plot``** on each of them, each run in a fresh process under
   ``/usr/bin/time -v`` (wall time and peak resident memory, median of
   ``--repeats``), with ``MALLOC_MMAP_MAX_=0`` and a huge ``MALLOC_TRIM_THRESHOLD_``
   as in :mod:`benchmarks.measure`. ``--before DIR`` also runs the ``cockpit`` of
   another checkout (``PYTHONPATH=DIR``) on the plain log, once.
4. **Live redraw.** A live dashboard (``CockpitPlotter.plot(run)``, ``run`` having a
   ``history`` like a cockpit) with 200, 5,000 and ``--steps`` recorded steps: one
   step is added, then ``plot`` and the rendering of both figures
   (``canvas.draw()``, what a window does) are timed; median of ``--repeats``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

from benchmarks import internals
from benchmarks.driver import RESULTS
from benchmarks.measure import CHILD_ENV, REPO, tracked_step

DEFAULT_OUT = RESULTS / "long_runs.md"
#: Sizes of the live runs besides the long one: 200 steps draw all their points,
#: 5,000 steps are thinned to at most 2,000 points per series, as the long run is.
LIVE_SIZES = (200, 5000)
KIB = 1024
MIB = 2**20


# --- 1. a real run --------------------------------------------------------------------
def real_run(train_steps: int, workdir: str) -> tuple[object, dict]:
    """Train with the full configuration at every step; return history and sizes."""
    import torch

    from benchmarks.problems import make

    torch.manual_seed(0)
    bench = make("mlp", batch_size=32, need_plain=False)
    model = bench.extended
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    cockpit = internals.make_cockpit(
        model.named_parameters(),
        internals.make_quantities("full"),
        logpath=os.path.join(workdir, "real"),
    )
    for step in range(train_steps):
        tracked_step(cockpit, model, bench.loss_fn, optimizer, bench.batch(step), step)
    cockpit.close()
    history = cockpit.history
    files = {
        "streamed (.jsonl, while training)": cockpit.logpath,
        "written, packed (default)": cockpit.write(os.path.join(workdir, "packed")),
        "written, plain (packed=False)": history.write_json(
            os.path.join(workdir, "plain.json"), packed=False
        ),
        "written, 1.0.2 layout (legacy=True)": history.write_json(
            os.path.join(workdir, "legacy.json"), legacy=True
        ),
    }
    sizes = {name: os.path.getsize(path) for name, path in files.items()}
    return history, {"steps": len(history), "bytes": sizes}


# --- 2. a long log --------------------------------------------------------------------
def _scaled(value, factor):
    """Scale plain numbers (and lists of them); leave mappings (histograms) alone."""
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, (int, float)):
        return value * factor if isinstance(value, float) else value
    if isinstance(value, list):
        return [_scaled(v, factor) for v in value]
    return value


class LongRun:
    """Records shaped like those of a real run, for any number of steps."""

    def __init__(self, history, seed: int = 0):
        import numpy as np

        self.templates = [history.view(step) for step in history.steps]
        self.rng = np.random.default_rng(seed)

    def record(self, step: int) -> dict:
        """The values of ``step``: a real record in turn, numbers scaled."""
        template = self.templates[step % len(self.templates)]
        factor = float(self.rng.lognormal(0.0, 0.1))
        if step % 997 == 500:  # an occasional spike, as real runs have
            factor *= 50.0
        return {
            key: value if hasattr(value, "keys") else _scaled(_plain(value), factor)
            for key, value in template.items()
        }


def _plain(value):
    return value.tolist() if hasattr(value, "tolist") else value


def write_long_logs(run: LongRun, steps: int, workdir: str, plain: bool):
    """Write the long logs; return ``{name: path}``, the history and seconds taken."""
    started = time.perf_counter()
    history = internals.new_history()
    stream = internals.open_stream(os.path.join(workdir, "long"))
    for step in range(steps):
        values = run.record(step)
        stream.write({step: values})
        for key, value in values.items():
            history.add(step, key, value)
    stream.close()
    paths = {
        "streamed .jsonl": stream.path,
        "packed .json": history.write_json(os.path.join(workdir, "long.json")),
    }
    if plain:
        paths["plain .json (before packing)"] = _write_plain(
            history, os.path.join(workdir, "long_plain.json")
        )
    return paths, history, time.perf_counter() - started


def _write_plain(history, path: str) -> str:
    """The layout of ``write_json(packed=False)``, written one step at a time."""
    steps = sorted(history.steps, key=str)  # as json.dumps(sort_keys=True) orders them
    with open(path, "w", encoding="utf-8") as handle:
        handle.write("{\n")
        for index, step in enumerate(steps):
            body = json.dumps(history[step], indent=2, sort_keys=True)
            body = body.replace("\n", "\n  ")
            comma = "," if index < len(steps) - 1 else ""
            handle.write(f'  "{step}": {body}{comma}\n')
        handle.write("}")
    return path


# --- 3. cockpit plot ------------------------------------------------------------------
def time_plot(log: str, out: str, pythonpath: str, repeats: int) -> dict:
    """Wall time and peak RSS of ``cockpit plot LOG`` in fresh processes (medians)."""
    env = dict(os.environ, PYTHONPATH=pythonpath, **CHILD_ENV)
    walls, peaks = [], []
    for _ in range(repeats):
        command = ["/usr/bin/time", "-v", sys.executable, "-m", "cockpit", "plot",
                   log, "-o", out]  # fmt: skip
        started = time.perf_counter()
        done = subprocess.run(
            command, env=env, cwd=pythonpath, capture_output=True, text=True
        )
        walls.append(time.perf_counter() - started)
        if done.returncode != 0:
            raise RuntimeError(f"cockpit plot failed on {log}: {done.stderr[-2000:]}")
        found = re.search(r"Maximum resident set size \(kbytes\): (\d+)", done.stderr)
        peaks.append(int(found.group(1)) * 1024 if found else math.nan)
    return {"seconds": statistics.median(walls), "peak": statistics.median(peaks),
            "runs": repeats}  # fmt: skip


# --- 4. live redraw -------------------------------------------------------------------
class _Live:
    """Stands for a running cockpit: the plotter reads its ``history``."""

    def __init__(self, history):
        self.history = history


def time_redraw(run: LongRun, history, repeats: int) -> dict:
    """Seconds of one live redraw after a new step (plot + rendering), median."""
    live = _Live(history)
    plotter = internals.make_plotter()
    started = time.perf_counter()
    plotter.plot(live, show_plot=False)
    for fig in plotter.figures:
        fig.canvas.draw()
    first = time.perf_counter() - started
    plots, totals = [], []
    step = history.steps[-1]
    for _ in range(repeats):
        step += 1
        for key, value in run.record(step).items():
            history.add(step, key, value)
        started = time.perf_counter()
        plotter.plot(live, show_plot=False)
        plots.append(time.perf_counter() - started)
        for fig in plotter.figures:
            fig.canvas.draw()
        totals.append(time.perf_counter() - started)
    return {"steps": len(history), "first": first, "plot": statistics.median(plots),
            "total": statistics.median(totals)}  # fmt: skip


def live_histories(run: LongRun, long_history, sizes: tuple[int, ...]):
    """Histories with each of ``sizes`` steps, then the long one."""
    histories = []
    for size in sizes:
        history = internals.new_history()
        for step in range(size):
            for key, value in run.record(step).items():
                history.add(step, key, value)
        histories.append(history)
    return histories + [long_history]


# --- report ---------------------------------------------------------------------------
def render(results: dict) -> str:
    """The markdown report."""
    real, steps = results["real"], results["steps"]
    lines = [
        "# Long runs: log size, `cockpit plot` on a long log, live redraws",
        "",
        f"Generated by `python -m benchmarks.long_runs {results['argv']}` on "
        f"{results['date']} ({results['machine']}).",
        "",
        "## Bytes per tracked step of a full-configuration log",
        "",
        f"The benchmark MLP (784-128-10, batch 32, random data) trained "
        f"{real['steps']} steps with the `full` configuration tracked at every "
        "step (GradHist1d: 100 bins, GradHist2d: 40x50 bins).",
        "",
        "| log | bytes | bytes per tracked step |",
        "| --- | ---: | ---: |",
    ]
    for name, size in real["bytes"].items():
        lines.append(f"| {name} | {size:,} | {size / real['steps']:,.0f} |")
    lines += [
        "",
        f"## `cockpit plot` on a {steps:,}-step log",
        "",
        f"{steps:,} records shaped like the real ones (written in "
        f"{results['synth_seconds']:.0f} s). Each `cockpit plot LOG -o out.png` "
        "ran in a fresh process; wall time and peak resident memory from "
        f"`/usr/bin/time -v`, median of {results['repeats']} runs.",
        "",
        "| log | file size (MiB) | bytes per step | cockpit | wall (s) "
        "| peak RSS (MiB) |",
        "| --- | ---: | ---: | --- | ---: | ---: |",
    ]
    for row in results["plots"]:
        lines.append(
            f"| {row['log']} | {row['size'] / MIB:,.1f} | {row['size'] / steps:,.0f} "
            f"| {row['cockpit']} | {row['seconds']:.1f} | {row['peak'] / MIB:,.0f} |"
        )
    lines += [
        "",
        "## Live dashboard redraw",
        "",
        "`CockpitPlotter.plot(run, show_plot=False)` on a run whose history holds "
        "the given number of steps (full configuration), after one new step, plus "
        "rendering both figures with `canvas.draw()` (what a window does); median "
        f"of {results['repeats_live']} redraws. First draw: the first `plot` call "
        "(reads the whole history) and its rendering. Series gauges draw every "
        "point up to 2,000 points, then at most 2,000 (each block's extremes): the "
        "redraw grows with the points drawn up to that bound, not with the steps.",
        "",
        "| recorded steps | first draw (s) | redraw: plot (s) "
        "| redraw: plot + render (s) |",
        "| ---: | ---: | ---: | ---: |",
    ]
    for row in results["live"]:
        lines.append(
            f"| {row['steps']:,} | {row['first']:.2f} | {row['plot']:.3f} | "
            f"{row['total']:.3f} |"
        )
    lines += ["", results["notes"], ""]
    return "\n".join(lines)


NOTES = """\
How: logs are packed (`cockpit.log.format.pack`): histogram edges as
`{"__linspace__": [first, last, n]}` (checked to give back the exact floats),
integer counts that are mostly zero (the 2-D histogram) as `{"__sparse__": ...}`
(the non-zero counts and the run of zeros before each), one line per step; every
record stands alone, so a torn streamed record loses only itself. `cockpit plot`
reads the log one step (JSON) or one line (streamed) at a time, keeps every series
value but only the latest histogram per key, and gauges draw at most 2,000 points
per series (each block's minimum and maximum, so spikes stay visible). A live
redraw reads only the new steps."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20000, help="long log steps")
    parser.add_argument("--train-steps", type=int, default=40, help="real run steps")
    parser.add_argument("--repeats", type=int, default=3, help="cockpit plot runs")
    parser.add_argument("--live-repeats", type=int, default=5, help="redraws timed")
    parser.add_argument("--no-plain", action="store_true", help="skip the plain log")
    parser.add_argument(
        "--before", default=None, metavar="DIR", help="also plot with DIR's cockpit"
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="report file")
    parser.add_argument("--workdir", default=None, help="keep the logs here")
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", "Full backward hook", UserWarning)
    workdir = args.workdir or tempfile.mkdtemp(prefix="cockpit_long_")
    os.makedirs(workdir, exist_ok=True)
    print(f"real run: {args.train_steps} steps ...", flush=True)
    real_history, real = real_run(args.train_steps, workdir)
    run = LongRun(real_history)
    print(f"writing {args.steps} synthetic steps ...", flush=True)
    paths, long_history, synth_seconds = write_long_logs(
        run, args.steps, workdir, plain=not args.no_plain
    )
    here = str(REPO)
    workdir = os.path.abspath(workdir)
    plots = []
    jobs = [(name, path, "this", here, args.repeats) for name, path in paths.items()]
    if args.before and not args.no_plain:
        plain = paths["plain .json (before packing)"]
        jobs.append(("plain .json (before packing)", plain, f"`{args.before}`",
                     args.before, 1))  # fmt: skip
    for name, path, which, pythonpath, repeats in jobs:
        print(f"cockpit plot ({which}) on {name} ...", flush=True)
        timing = time_plot(path, os.path.join(workdir, "out.png"), pythonpath, repeats)
        plots.append({"log": name, "size": os.path.getsize(path), "cockpit": which,
                      **timing})  # fmt: skip
    print("live redraws ...", flush=True)
    sizes = tuple(size for size in LIVE_SIZES if size < args.steps)
    histories = live_histories(run, long_history, sizes)
    live = [time_redraw(run, h, args.live_repeats) for h in histories]
    results = {
        "argv": " ".join(sys.argv[1:] if argv is None else argv),
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, CPython "
        f"{platform.python_version()}, torch {torch.__version__}",
        "real": real,
        "steps": args.steps,
        "synth_seconds": synth_seconds,
        "repeats": args.repeats,
        "repeats_live": args.live_repeats,
        "plots": plots,
        "live": live,
        "notes": NOTES,
    }
    args.out.write_text(render(results))
    with open(os.path.join(workdir, "long_runs.json"), "w") as handle:
        json.dump(results, handle, indent=1)
    print(f"report written to {args.out} (logs in {workdir})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
