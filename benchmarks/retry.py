"""Busy-machine detection and re-measurement (end of a run, ``--fix``).

Another process on a 2-core machine slows a 2-thread step by up to 50 times (its
threads wait for each other), so the ratio of such a run means little even though
plain and tracked steps alternate. A configuration whose median plain step took more
than ``--busy-factor`` times the fastest median plain step of its problem is measured
again (at most ``--retries`` times) and the run with the fastest plain steps is kept.
Plain training steps and the plain forward+backward passes of the building blocks
are compared separately.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

from benchmarks import blocks, measure, record, report


def plain_median(entry: dict) -> float | None:
    """Median plain-step seconds of a spec's timing run (None if there is none)."""
    plain = entry.get("time", {}).get("plain_s")
    return statistics.median(plain) if plain else None


def retry_busy(
    results: dict, args, interpreter=measure.OURS, label: str = ""
) -> list[str]:
    """Measure again the configurations whose plain steps ran on a busy machine.

    Args:
        results: problem -> spec -> mode -> result; updated in place.
        args: The run's settings (``busy_factor``, ``retries`` and what
            :func:`benchmarks.measure.run_child` needs).
        interpreter: Which cockpit measured ``results``.
        label: Put before the spec in notes (e.g. the reference package's name).

    Returns:
        Notes on what was measured again, for the report.
    """
    notes = []
    for problem, res in results.items():
        for is_block in (False, True):  # plain steps and plain fwd+bwd passes
            specs = [s for s in res if blocks.is_block(s) == is_block]
            notes += _retry_group(problem, res, specs, args, interpreter, label)
    return notes


def _retry_group(problem, res, specs, args, interpreter, label) -> list[str]:
    notes = []
    medians = {}
    for spec in specs:
        median = plain_median(res[spec])
        if median is not None:
            medians[spec] = median
    if not medians:
        return notes
    best = min(medians.values())
    for spec, median in medians.items():
        tries = 0
        while median > args.busy_factor * best and tries < args.retries:
            tries += 1
            again = measure.run_child(problem, spec, "time", args, interpreter)
            new = plain_median({"time": again})
            if new is not None and new < median:
                notes.append(
                    f"{problem} {label}{spec}: measured again (plain step median "
                    f"{1000 * median:.1f} ms, {median / best:.1f}x the fastest "
                    f"of this problem: machine busy); kept {1000 * new:.1f} ms"
                )
                res[spec]["time"], median = again, new
            print(
                f"[{problem}] {label}{spec}: retry {tries}, plain "
                f"{1000 * median:.1f} ms (best {1000 * best:.1f})",
                file=sys.stderr,
                flush=True,
            )
        if median > args.busy_factor * best:
            notes.append(
                f"{problem} {label}{spec}: plain steps still {median / best:.1f}x "
                "slower than the fastest of this problem after retries (machine "
                "busy); its ratio is unreliable"
            )
    return notes


def fix(args) -> None:
    """Re-measure busy configurations of a ``--json`` record, then rewrite both.

    Also measures again the ``--remeasure`` items (``problem:spec``) first. Entries
    of the reference package (``--reference`` runs) are left as they are.
    """
    saved = record.read(args.fix, args)
    notes = list(saved["notes"])
    for item in filter(None, (args.remeasure or "").split(",")):
        problem, spec = item.strip().split(":", 1)
        entry = saved["results"][problem][spec]
        old = entry["time"].get("ratio")
        entry["time"] = measure.run_child(problem, spec, "time", args)
        notes.append(
            f"{problem} {spec}: measured again after the run on request (ratio "
            f"{old:.2f} -> {entry['time'].get('ratio', float('nan')):.2f}; the first "
            "run overlapped with other work on the machine)"
        )
        print(f"[{problem}] {spec}: measured again", file=sys.stderr, flush=True)
    notes += retry_busy(saved["results"], args)
    command = f"python -m benchmarks.run --fix {args.fix}"
    if args.remeasure:
        command += f" --remeasure {args.remeasure}"
    how = (
        "entries 'measured again' were measured again at the end of the run, those "
        f"'after the run' (and any listed after them) by `{command}`"
    )
    if any("measured again" in n for n in notes) and how not in notes:
        notes.append(how)
    saved["notes"] = notes
    record.write(args.fix, saved)
    Path(args.out).write_text(report.render(saved, args.analysis) + "\n")
    print(f"wrote {args.out} and {args.fix}", file=sys.stderr)
