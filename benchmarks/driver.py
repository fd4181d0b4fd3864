"""What the benchmarks share: where results go, one command line, one report table.

Every benchmark writes its results under :data:`RESULTS` (``benchmarks/results/``).
Benchmarks that measure in child processes and keep a JSON record share one
command-line pattern (``--child SPEC`` in a child, ``--table JSON`` to print a
record's tables again, otherwise measure, write the record to ``--out`` and print
its tables): :func:`main` runs it. :func:`machine_line` and :func:`table` are the
Markdown every report starts with and is made of.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

#: The one folder for every benchmark's results.
RESULTS = Path(__file__).resolve().parent / "results"


def fill_defaults(args, quick: bool, defaults: dict[str, tuple]) -> None:
    """Set each ``args.name`` still ``None`` to its ``(quick, full)`` default."""
    for name, (small, full) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, small if quick else full)


def machine_line(data: dict, *, backpack: bool = False) -> str:
    """The report's first line: commit, date, machine, torch and the command."""
    machine = data["machine"]
    line = (
        f"Commit {machine['commit']}, {machine['date']}, {machine['cpu']} "
        f"({machine['cores']} cores, load {machine['load']}), torch "
        f"{machine['torch']}"
    )
    if backpack:
        line += f", BackPACK {machine['backpack']}"
    return line + f". Command: `{' '.join(data['argv'])}`"


def table(header: Sequence[str], rows: Iterable[Sequence]) -> list[str]:
    """A Markdown table's lines (cells as given; ``None`` shows as an empty cell)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        cells = ("" if cell is None else str(cell) for cell in row)
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def errors(record: dict, *sections: str) -> list[str]:
    """Where a record's sections hold a failed measurement (a dict with ``"error"``).

    Each is named by its path of keys, ``memory/8/economy``.
    """
    found = []

    def walk(node, path):
        if isinstance(node, dict):
            if "error" in node:
                found.append("/".join(path))
                return
            for key, value in node.items():
                walk(value, (*path, str(key)))

    for section in sections:
        walk(record.get(section), (section,))
    return found


def write_record(data: dict, out: Path, render: Callable[[dict], str]) -> str:
    """Write a record to ``out`` (JSON) and its report beside it (``.md``); print it."""
    out.write_text(json.dumps(data, indent=1))
    text = render(data)
    out.with_suffix(".md").write_text(text)
    print(text)
    return text


def main(
    argv: list[str] | None,
    parse: Callable,
    *,
    child_main: Callable[[dict], object],
    render: Callable[[dict], str],
    measure_all: Callable,
    settings: Callable[[object], dict],
    sections: Sequence[str],
    complete: Callable[[dict], None] | None = None,
) -> int:
    """The shared command line: a child, ``--table``, or measure and write a record.

    ``measure_all(args)`` returns the record's measured part; the record adds the
    machine (with the load before measuring), the command, ``settings(args)`` and the
    wall time, ``complete(record)`` may add to it (verdicts), then it goes to
    ``args.out`` as JSON and its tables (``render``) to stdout. The exit status is 1
    when a measurement in the record's ``sections`` failed (:func:`errors`, printed
    to stderr).
    """
    from benchmarks import measure, record

    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    if args.child:
        child_main(json.loads(args.child))
        return 0
    if args.table:
        print(render(json.loads(Path(args.table).read_text())))
        return 0
    for name, value in measure.CHILD_ENV.items():
        os.environ.setdefault(name, value)
    load_before = " ".join(f"{x:.2f}" for x in os.getloadavg())
    started = time.perf_counter()
    measured = measure_all(args)
    machine = record.machine()
    machine["load_before"] = load_before
    saved = {
        "machine": machine,
        "argv": list(argv),
        "settings": settings(args),
        "wall_s": time.perf_counter() - started,
        **measured,
    }
    if complete is not None:
        complete(saved)
    Path(args.out).write_text(json.dumps(saved, indent=1) + "\n")
    print(render(saved))
    print(f"wrote {args.out} ({saved['wall_s']:.0f} s)", file=sys.stderr)
    failed = errors(saved, *sections)
    if failed:
        print("failed: " + ", ".join(failed), file=sys.stderr)
    return 1 if failed else 0


__all__ = [
    "RESULTS",
    "errors",
    "fill_defaults",
    "machine_line",
    "main",
    "table",
    "write_record",
]
