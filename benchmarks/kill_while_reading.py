"""Soak: writers killed at random moments while ``cockpit`` reads their log.

Run from the repository root (each scenario takes a few seconds, plus the fork
server's start)::

    python -m benchmarks.kill_while_reading --seeds 0-49 \
        --out benchmarks/results/kill_while_reading.md
    python -m benchmarks.kill_while_reading --seeds 17     # replay one seed

Each seed plays one scenario of :mod:`tests.utils.chaos` (what the test suite runs
for two seeds): a run streaming its log is killed after a random number of steps, at
a random moment within a step; maybe a second Cockpit tries the path meanwhile
(it must be refused); maybe a new run replaces the log and is killed in turn; all
the while another process runs ``cockpit report --json`` and ``cockpit plot`` on
the log. The seed fixes these choices (the processes' timing is the machine's).
The results file lists every seed with what happened and any problem
(:func:`tests.utils.chaos.problems`); the command exits 1 if any seed had one.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import tempfile
import time

from tests.utils import chaos


def _seeds(text: str) -> list[int]:
    seeds: list[int] = []
    for part in text.split(","):
        if "-" in part:
            first, last = part.split("-")
            seeds += range(int(first), int(last) + 1)
        else:
            seeds.append(int(part))
    return seeds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0-19", help="e.g. 0-49 or 3,17")
    parser.add_argument("--out", default=None, help="results file (Markdown)")
    args = parser.parse_args(argv)
    lines, failed = [], 0
    started = time.time()
    for seed in _seeds(args.seeds):
        folder = tempfile.mkdtemp(prefix=f"cockpit-chaos-{seed}-")
        began = time.time()
        try:
            outcome = chaos.run(seed, folder)
            found = chaos.problems(outcome)
        except Exception as error:  # noqa: BLE001 - a failed scenario is a result
            outcome, found = None, [f"{type(error).__name__}: {error}"]
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        failed += bool(found)
        what = chaos.summary(outcome) if outcome else f"seed {seed}"
        line = f"- {what} ({time.time() - began:.0f} s): " + (
            "PROBLEMS: " + " | ".join(found) if found else "ok"
        )
        print(line, flush=True)
        lines.append(line)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    text = "\n".join(
        [
            "# Writers killed while cockpit reads their log",
            "",
            f"`python -m benchmarks.kill_while_reading --seeds {args.seeds}` at "
            f"{commit}: {len(lines)} seeds, {failed} with problems, "
            f"{(time.time() - started) / 60:.0f} min, load average "
            f"{os.getloadavg()[0]:.1f} at the end.",
            "",
            *lines,
            "",
        ]
    )
    if args.out:
        with open(args.out, "w", encoding="utf-8") as handle:
            handle.write(text)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
