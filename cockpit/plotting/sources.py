"""Where the dashboard's runs come from: logs, cockpits, histories, read as runs."""

from __future__ import annotations

import os
from typing import Any

from cockpit.history import History
from cockpit.log.files import empty_run_cause
from cockpit.plotting.data import DashboardData, as_history, read_log
from cockpit.plotting.runs import (
    RUN_COLORS,
    Run,
    check_labels,
    default_labels,
    is_several,
)


def log_stem(path: str | os.PathLike) -> str:
    """Return a log path without its ``.json``/``.jsonl`` suffix (1.0.2's naming)."""
    path = os.fspath(path)
    for suffix in (".jsonl", ".json"):
        if path.endswith(suffix):
            return path[: -len(suffix)]
    return path


def resolve_source(
    source: Any, read: DashboardData | None = None
) -> tuple[History, str, str | None]:
    """Return the history, default title and default save folder of a source.

    Args:
        source: What :meth:`CockpitPlotter.plot` accepts.
        read: The data of a log path ``source``, read already.

    Returns:
        The history; ``"Cockpit for <optimizer>"`` for a cockpit that saw an
        optimizer, ``"Cockpit: <file name>"`` for a log, else ``"Cockpit"``; for a
        log, its path without ``.json`` (as cockpit-for-pytorch 1.0.2: images of
        ``logs/run.json`` go to the folder ``logs/run``), else ``None``.

    Raises:
        LogFileError: If a log cannot be read or has no tracked steps.
        ValueError: If any other source has no tracked steps.
    """
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        history = as_history(path) if read is None else read.history  # not empty
        return history, f"Cockpit: {os.path.basename(path)}", log_stem(path)
    history = as_history(source)
    if not history.steps:
        last_step = getattr(source, "last_step", False)  # a Cockpit's; else unknown
        closed = None if last_step is False else last_step is not None
        raise ValueError(
            f"Nothing to plot: the {type(source).__name__} has no tracked steps. "
            f"{empty_run_cause(closed)}"
        )
    optimizer = getattr(source, "optimizer_name", None)
    title = f"Cockpit for {optimizer}" if optimizer else "Cockpit"
    return history, title, None


def read_runs(
    source: Any,
    labels: list[str] | None,
    previous: list[Run],
    stream: bool = False,
    discard: int | None = None,
) -> tuple[list[Run], list[str], list[str | None], list[set[str]]]:
    """Read one run or several for :meth:`CockpitPlotter.load`.

    Args:
        source: What :meth:`CockpitPlotter.plot` accepts (one run or a list).
        labels: Names of several runs (default: :func:`default_labels`).
        previous: The runs loaded before: a history read again reuses its data,
            so that only the steps added since are read.
        stream: Read log paths step by step, keeping what is drawn up to
            ``discard`` (:func:`~cockpit.plotting.data.read_log`).
        discard: The last step drawn (``None``: all).

    Returns:
        The runs, their default titles, their default save folders and the keys
        each run's cockpit was configured with.

    Raises:
        LogFileError: If a log cannot be read or has no tracked steps.
        ValueError: If another source has no tracked steps, the list is empty,
            or the labels do not fit the runs.
    """
    several = is_several(source)
    sources = list(source) if several else [source]
    if several and not sources:
        raise ValueError("Nothing to plot: the list of runs is empty.")
    names = (check_labels(labels, len(sources)) if several else None) or (
        default_labels(sources)
    )
    known = {id(run.data.history): run.data for run in previous}
    runs, titles, folders, configured = [], [], [], []
    for index, item in enumerate(sources):
        thin = None
        if stream and isinstance(item, (str, os.PathLike)):  # only what is drawn
            thin = read_log(item, upto=discard)
        history, title, default_dir = resolve_source(item, thin)
        if isinstance(item, DashboardData) or thin is not None:
            data = item if thin is None else thin
        else:
            data = known.get(id(history))
            if data is None or data.history is not history:
                data = DashboardData(history)
        data.refresh()
        color = RUN_COLORS[index % len(RUN_COLORS)] if several else None
        runs.append(Run(names[index], data, color, index))
        titles.append(title)
        folders.append(default_dir)
        quantities = getattr(item, "quantities", None)
        keys = {getattr(q, "key", None) for q in quantities or ()} - {None}
        configured.append(keys)
    return runs, titles, folders, configured
