"""Finding the logs under the paths ``cockpit serve`` was given, and nothing else.

A path given may be a log file or a folder; folders are searched at any depth
(like ``tensorboard --logdir``), hidden folders skipped. A ``.jsonl`` file is a
run (one that is not a cockpit stream shows its error); a ``.json`` file is a
run if it starts like a cockpit log (``{"0": ...``: written by
``Cockpit.write`` or by cockpit-for-pytorch 1.0.2), so the other JSON files of an
experiment folder (configs, tokenizers) are not listed. A ``log.json`` written
next to its stream ``log.jsonl`` (``Cockpit.write`` at the end of a streamed
run) is the same run: the stream is shown.

Only files whose real path (links resolved) lies inside the real path of the
folder they were found in are served: a symbolic link leading out is ignored.
"""

from __future__ import annotations

import os
import re

#: Most runs one server lists (the rest are left out, with a warning).
MAX_RUNS = 1000

_JSON_LOG = re.compile(rb'^\s*\{\s*"-?\d+"\s*:')


def inside(path: str, root: str) -> bool:
    """Whether the real path ``path`` lies in (or is) the real folder ``root``."""
    try:
        return os.path.commonpath([path, root]) == root
    except ValueError:  # different drives
        return False


def _is_log(name: str, path: str, siblings: set[str]) -> bool:
    """A stream (``.jsonl``), or a JSON log with no stream of its name beside it."""
    if name.endswith(".jsonl"):
        return True
    return (
        name.endswith(".json")
        and name[:-5] + ".jsonl" not in siblings
        and _looks_like_json_log(path)
    )


def _looks_like_json_log(path: str) -> bool:
    try:
        with open(path, "rb") as handle:
            head = handle.read(4096)
    except OSError:
        return False
    return bool(_JSON_LOG.match(head))


def find_logs(root: str) -> list[tuple[str, str]]:
    """``(file, name relative to root)`` of the logs under ``root`` (sorted).

    Args:
        root: A folder or a log file.
    """
    if os.path.isfile(root):
        return [(root, os.path.basename(root))]
    real_root = os.path.realpath(root)
    found: dict[str, tuple[str, str]] = {}
    for folder, dirs, files in os.walk(root, followlinks=False):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        names = set(files)
        for name in sorted(files):
            if name.startswith("."):
                continue
            path = os.path.join(folder, name)
            if not _is_log(name, path, names):
                continue
            real = os.path.realpath(path)
            if not inside(real, real_root) or not os.path.isfile(real):
                continue  # a link leading out of the served folder
            found[real] = (path, os.path.relpath(path, root).replace(os.sep, "/"))
            if len(found) >= MAX_RUNS:
                return sorted(found.values(), key=lambda item: item[1])
    return sorted(found.values(), key=lambda item: item[1])


def writers() -> set[tuple[int, int]] | None:
    """``(device, inode)`` of files a process holds a write lock on.

    A cockpit stream's writer holds one on its log while it runs
    (:mod:`cockpit.log.lock`); read from ``/proc/locks`` (Linux), so asking
    takes no lock and never stands in a writer's way. ``None`` where that is not
    known (other systems).
    """
    try:
        with open("/proc/locks", encoding="ascii", errors="replace") as handle:
            lines = handle.read().splitlines()
    except OSError:
        return None
    held = set()
    for line in lines:
        parts = line.split()
        if "->" in parts:  # a waiter
            continue
        if len(parts) < 6 or parts[1] not in ("FLOCK", "POSIX") or parts[3] != "WRITE":
            continue
        try:
            major, minor, inode = parts[5].split(":")
            held.add((os.makedev(int(major, 16), int(minor, 16)), int(inode)))
        except ValueError:
            continue
    return held
