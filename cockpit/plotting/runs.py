"""Several runs on one dashboard: their labels, colours and data.

A gauge draws one run (the classic look: points coloured by iteration) or several
(:func:`as_runs` of a list or tuple): then every run has one colour on every gauge,
the legend names the runs, and a run that lacks what a gauge reads is named in
that gauge. Runs are aligned by their global step.

Labels default to the log file's name without ``.json``/``.jsonl``
(:func:`default_labels`: runs whose file names agree are named by the folders that
tell them apart), ``run 1``, ``run 2``, ... for sources that are not paths.
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


def _parts(path: str) -> list[str]:
    """The folders of a path (absolute) and its file's stem, outermost first."""
    folder = os.path.dirname(os.path.normpath(os.path.abspath(path)))
    parts = []
    while True:
        folder, name = os.path.split(folder)
        if not name:
            break
        parts.append(name)
    return parts[::-1] + [_stem(path)]


def _told_apart(paths: list[str]) -> list[str] | None:
    """Short distinct names of paths whose stems agree, ``None`` if some are equal.

    The parts all paths end in alike are dropped (``runs/lr_0.1/log.json`` and
    ``runs/lr_1.0/log.json`` differ in their folder only: ``lr_0.1``, ``lr_1.0``);
    of the rest, each name keeps its last ``k`` parts for the smallest ``k`` that
    tells all of them apart.
    """
    parts = [_parts(path) for path in paths]
    common = 0
    while (
        all(len(p) > common for p in parts)
        and len({p[len(p) - 1 - common] for p in parts}) == 1
    ):
        common += 1
    rest = [p[: len(p) - common] for p in parts]
    if any(not r for r in rest):
        return None  # one path is another's tail: the same file, or nested alike
    for k in range(1, max(map(len, rest)) + 1):
        names = ["/".join(r[-k:]) for r in rest]
        if len(set(names)) == len(names):
            return names
    return None


def default_labels(sources: Sequence[Any]) -> list[str]:
    """Labels of runs: file stems for paths, with folders where stems agree.

    Args:
        sources: The runs' sources (paths, cockpits, histories, ...).

    Returns:
        One distinct, short label per source: ``"lr_0.1"`` for
        ``logs/lr_0.1.json``; ``"lr_0.1"``, ``"lr_1.0"`` for
        ``runs/lr_0.1/log.json`` and ``runs/lr_1.0/log.json`` (the file names
        agree, so the folders that differ name the runs); ``"run k"`` for a source
        that is not a path; ``" (1)"``, ``" (2)"``, ... appended to labels that are
        still equal (the same file twice).
    """
    paths = [
        os.fspath(s) if isinstance(s, (str, os.PathLike)) else None for s in sources
    ]
    labels = [
        _stem(path) if path is not None else f"run {index + 1}"
        for index, path in enumerate(paths)
    ]
    stems = list(labels)  # the groups are read off this copy, never off labels
    for stem in set(stems):
        group = [i for i, s in enumerate(stems) if s == stem and paths[i] is not None]
        if len(group) < 2:
            continue
        names = _told_apart([paths[i] for i in group])
        for i, name in zip(group, names or [stem] * len(group)):
            labels[i] = name
    counts = {label: labels.count(label) for label in labels}
    seen: dict[str, int] = {}
    for index, label in enumerate(list(labels)):  # still equal: number them
        if counts[label] > 1:
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
