"""Several runs on one dashboard: their labels, colours and data.

A gauge draws one run (the classic look: points coloured by iteration) or several
(:func:`as_runs` of a list or tuple): then every run has one colour on every gauge,
the legend names the runs, and a run that lacks what a gauge reads is named in
that gauge. Runs are aligned by their global step.

Labels default to the log file's name without ``.json``/``.jsonl``
(:func:`default_labels`: runs whose file names agree are told apart by their
folders), ``run 1``, ``run 2``, ... for sources that are not paths.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Sequence

from cockpit.plotting.data import DashboardData, as_data

#: One colour per run, in order (the Okabe-Ito palette, which stays apart for
#: colour-blind readers, then two more); more runs repeat it.
RUN_COLORS = (
    "#0072b2",
    "#d55e00",
    "#009e73",
    "#cc79a7",
    "#e69f00",
    "#56b4e9",
    "#7f7f7f",
    "#000000",
)

#: ``get_gid()`` prefix of what a gauge drew for run ``k``: ``"cockpit-run-k"``.
RUN_GID = "cockpit-run-"


def run_gid(index: int) -> str:
    """The gid of the artists drawn for run ``index``."""
    return f"{RUN_GID}{index}"


@dataclass
class Run:
    """One run on a dashboard.

    Attributes:
        label: Its name in legends.
        data: Its data (refreshed by its owner).
        color: Its colour; ``None`` for the one run of a classic dashboard (points
            coloured by iteration).
        index: Its position among the runs.
    """

    label: str
    data: DashboardData
    color: str | None = None
    index: int = 0

    @property
    def gid(self) -> str:
        """The gid of the artists drawn for this run."""
        return run_gid(self.index)


def _stem(path: str) -> str:
    name = os.path.basename(os.path.normpath(path))
    for suffix in (".jsonl", ".json"):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def default_labels(sources: Sequence[Any]) -> list[str]:
    """Labels of runs: file stems for paths (with folders where stems agree).

    Args:
        sources: The runs' sources (paths, cockpits, histories, ...).

    Returns:
        One distinct label per source: ``"lr_0.1"`` for ``logs/lr_0.1.json``;
        ``"a/log"``, ``"b/log"`` for ``a/log.json`` and ``b/log.json``; ``"run
        k"`` for a source that is not a path.
    """
    labels = []
    for index, source in enumerate(sources):
        if isinstance(source, (str, os.PathLike)):
            labels.append(_stem(os.fspath(source)))
        else:
            labels.append(f"run {index + 1}")
    for index, source in enumerate(sources):
        if labels.count(labels[index]) > 1 and isinstance(source, (str, os.PathLike)):
            path = os.path.normpath(os.path.abspath(os.fspath(source)))
            parent = os.path.basename(os.path.dirname(path))
            labels[index] = f"{parent}/{_stem(path)}" if parent else labels[index]
    seen: dict[str, int] = {}
    for index, label in enumerate(labels):  # still equal: number them
        if labels.count(label) > 1:
            seen[label] = seen.get(label, 0) + 1
            labels[index] = f"{label} ({seen[label]})"
    return labels


def check_labels(labels: Sequence[str] | None, count: int) -> list[str] | None:
    """Validate labels given for ``count`` runs (``None`` passes through).

    Raises:
        ValueError: If their number differs from the runs', or two are equal.
    """
    if labels is None:
        return None
    labels = [str(label) for label in labels]
    if len(labels) != count:
        raise ValueError(
            f"{len(labels)} labels for {count} runs. Fix: give one label per run, "
            "in the order of the runs (or none: the file names are used)."
        )
    twice = sorted({label for label in labels if labels.count(label) > 1})
    if twice:
        raise ValueError(
            f"The label {twice[0]!r} names two runs. Fix: give each run its own label."
        )
    return labels


def is_several(source: Any) -> bool:
    """Whether ``source`` is several runs (a list or tuple of sources, or runs)."""
    return isinstance(source, (list, tuple))


def as_runs(data: Any, labels: Sequence[str] | None = None) -> list[Run]:
    """The runs of what a gauge is given.

    Args:
        data: One run (anything :func:`~cockpit.plotting.data.as_data` takes) or
            several: a list or tuple of them, or of :class:`Run`.
        labels: Labels for several runs (default: :func:`default_labels`).

    Returns:
        One :class:`Run` without a colour for one run; coloured, labelled runs
        for a list or tuple (also of one).

    Raises:
        ValueError: For an empty list, or labels that do not fit.
    """
    if not is_several(data):
        return [Run("", as_data(data))]
    if not data:
        raise ValueError("No runs to draw: pass at least one run.")
    if all(isinstance(item, Run) for item in data):
        return list(data)
    labels = check_labels(labels, len(data)) or default_labels(data)
    return [
        Run(label, as_data(source), RUN_COLORS[index % len(RUN_COLORS)], index)
        for index, (label, source) in enumerate(zip(labels, data))
    ]
