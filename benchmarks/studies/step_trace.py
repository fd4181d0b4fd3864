"""How hard is one tracked step to read? Count the cockpit code it runs through.

A small MLP (Linear(20, 16)-ReLU-Linear(16, 3), batch 8, random data, on the CPU)
is extended with BackPACK and tracked by a ``Cockpit`` with ``NormTest`` and
``GradNorm`` on ``linear(1)``. After two warm-up steps, ONE tracked step -- the whole
``with cockpit(step, info=...): loss.backward(create_graph=...)`` block -- runs
under ``sys.setprofile`` (this thread only; CPU backward hooks run in it).

Counting rules: a call is a Python 'call' event of a frame whose code file lies in
the ``cockpit`` package (C calls and other packages are ignored); a generator's
resumption is such an event, and so are comprehensions on Python < 3.12. Functions
are distinct code objects; a switch is two consecutive calls from different files.
Each quantity's ``track_schedule`` is wrapped to count how often it is asked (the
wrapper lies outside cockpit; the ``linear(1)`` it calls counts). Only the public API
(``Cockpit``, ``cockpit.quantities``, ``cockpit.utils.schedules``) is used, so the
tracer runs unchanged on later versions. Figures can differ by one between runs:
``any()`` over a set of strings stops at a hash-seeded place.

Run: ``python -m benchmarks.studies.step_trace --out
benchmarks/results/step_trace_before.json``
"""

from __future__ import annotations

import argparse
import collections
import json
import platform
import subprocess
import sys
import warnings
from pathlib import Path

import torch
from backpack import extend

import cockpit
from cockpit.quantities import GradNorm, NormTest
from cockpit.utils.schedules import linear

PACKAGE = Path(cockpit.__file__).resolve().parent
BATCH, WARMUP = 8, 2


class CountedSchedule:
    """A ``track_schedule`` that counts how often it is asked."""

    def __init__(self, schedule):
        self.schedule, self.calls = schedule, 0

    def __call__(self, step):
        self.calls += 1
        return self.schedule(step)


def trace_step() -> dict:
    """Run the warm-up steps, trace one tracked step, return the figures."""
    torch.manual_seed(0)
    x, y = torch.randn(BATCH, 20), torch.randint(0, 3, (BATCH,))
    layers = [torch.nn.Linear(20, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3)]
    model = extend(torch.nn.Sequential(*layers))
    loss_fn = extend(torch.nn.CrossEntropyLoss())
    individual_loss_fn = torch.nn.CrossEntropyLoss(reduction="none")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    schedules = {name: CountedSchedule(linear(1)) for name in ("NormTest", "GradNorm")}
    quantities = [NormTest(schedules["NormTest"]), GradNorm(schedules["GradNorm"])]
    tracker = cockpit.Cockpit(model.parameters(), quantities=quantities)

    calls, files, order = collections.Counter(), {}, []

    def profile(frame, event, _arg):
        if event == "call":
            code = frame.f_code
            if code not in files:
                path = Path(code.co_filename).resolve()
                inside = path.is_relative_to(PACKAGE)
                files[code] = path.relative_to(PACKAGE.parent) if inside else None
            if files[code] is not None:
                calls[code] += 1
                order.append(files[code])

    for step in range(WARMUP + 1):
        optimizer.zero_grad()
        outputs = model(x)
        loss = loss_fn(outputs, y)
        info = {
            "batch_size": BATCH,
            "individual_losses": individual_loss_fn(outputs, y),
            "loss": loss,
            "optimizer": optimizer,
        }
        traced = step == WARMUP
        if traced:
            for schedule in schedules.values():
                schedule.calls = 0
            previous = sys.getprofile()
            sys.setprofile(profile)
        try:
            with tracker(step, info=info):
                loss.backward(create_graph=tracker.create_graph(step))
        finally:
            if traced:
                sys.setprofile(previous)
        optimizer.step()

    by_file = collections.Counter()
    for code, count in calls.items():
        by_file[str(files[code])] += count
    return {
        "files": len(by_file),
        "functions": len(calls),
        "calls": sum(calls.values()),
        "switches": sum(a != b for a, b in zip(order, order[1:])),
        "schedule_calls": {name: s.calls for name, s in schedules.items()},
        "top_files": dict(by_file.most_common(10)),
        # each file where the step first enters it: the order to read them in
        "reading_order": list(dict.fromkeys(str(path) for path in order)),
    }


def commit() -> str | None:
    """The short hash of the checkout's HEAD, or None outside a git checkout."""
    git = ["git", "rev-parse", "--short", "HEAD"]
    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(git, cwd=here, capture_output=True, text=True).stdout
    except OSError:
        return None
    return out.strip() or None


def main(argv: list[str] | None = None) -> dict:
    """Trace one step, print a table, write JSON if asked; return the figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the figures as JSON to this file")
    args = parser.parse_args(argv)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Full backward hook is firing")
        figures = trace_step()
    machine = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
    result = {"commit": commit(), "machine": machine, **figures}

    print(f"one tracked step at {result['commit']} (cockpit in {PACKAGE})")
    for key in ("files", "functions", "calls", "switches"):
        print(f"  {key:<24}{result[key]:>6}")
    for name, count in result["schedule_calls"].items():
        print(f"  {name + ' schedule asked':<24}{count:>6}")
    print("  top files by calls:")
    for path, count in result["top_files"].items():
        print(f"    {count:>6}  {path}")
    print("  reading order (each file where the step first enters it):")
    for number, path in enumerate(result["reading_order"], 1):
        print(f"    {number:>6}  {path}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
