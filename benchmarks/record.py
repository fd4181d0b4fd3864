"""The JSON record of a run (``--json``): what was measured, where and how.

A record is ``{"machine", "results", "notes", "argv", "settings"}``, and
``"reference"`` after a ``--reference`` run. ``results`` maps problem -> spec ->
mode (``time``, ``memory``) -> the child's result (:mod:`benchmarks.measure`).
``--render`` and ``--fix`` read it back; the settings it saves are the arguments the
report depends on.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
from pathlib import Path

from benchmarks.measure import REPO

#: The arguments the report depends on, saved in the record.
SETTINGS = (
    "problems",
    "repeats",
    "warmup",
    "min_time",
    "memory_steps",
    "threads",
    "clock",
)


def machine() -> dict:
    """Describe this machine, the software versions and the commit measured."""
    from importlib import metadata

    import torch

    cpu = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    commit = os.environ.get("BENCH_COMMIT", "")
    if not commit:
        try:
            commit = subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"],
                cwd=REPO,
                capture_output=True,
                text=True,
            ).stdout.strip()
        except OSError:
            pass
    commit = commit or "unknown"
    try:
        load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        load = "unknown"
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "backpack": metadata.version("backpack-for-pytorch"),
        "commit": commit,
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "load": load,
    }


def new(results: dict, notes: list[str], argv, args, reference=None) -> dict:
    """Return the record of a run that has just measured ``results``."""
    record = {
        "machine": machine(),
        "results": results,
        "notes": notes,
        "argv": list(argv),
        "settings": {name: getattr(args, name) for name in SETTINGS},
    }
    if reference is not None:
        record["reference"] = reference
    return record


def read(path, args=None) -> dict:
    """Load a record; copy its settings onto ``args`` (a namespace) if given."""
    record = json.loads(Path(path).read_text())
    if args is not None:
        for name, value in record["settings"].items():
            setattr(args, name, value)
    return record


def write(path, record: dict) -> None:
    """Save a record as indented JSON."""
    Path(path).write_text(json.dumps(record, indent=1))
