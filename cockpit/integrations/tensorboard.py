"""Export a cockpit log to TensorBoard, next to your other runs.

``cockpit export LOG --tensorboard DIR`` on the command line, or::

    from cockpit.integrations.tensorboard import export_tensorboard

    export_tensorboard("logs/run.jsonl", "runs/my_run")      # a log file
    export_tensorboard(cockpit, "runs/my_run")               # a live Cockpit

Then ``tensorboard --logdir runs``. Tags start with ``prefix`` (default
``"cockpit"``), so the cockpit's values form their own section in TensorBoard:

* a number (``Loss``, ``Alpha``, ``NormTest``, ``learning_rate``, ...):
  the scalar ``cockpit/<key>``;
* a per-parameter list (``GradNorm``, ``Distance``, ``UpdateSize``, ``HessTrace``,
  ``Variance``, ...): one scalar per parameter tensor, ``cockpit/<key>/<name>``
  (the parameter's name where known, else ``param_<i>``), and for the quantities in
  :data:`TOTALS` also the total over all tensors as ``cockpit/<key>`` (the norm of
  the per-tensor norms, the sum of per-tensor traces);
* ``learning_rates`` (one value per parameter group of the optimizer, recorded by
  the cockpit on tracked steps): ``cockpit/learning_rates/group_<i>``;
* a histogram (``GradHist1d``): the TensorBoard histogram ``cockpit/<key>`` with the
  log's bin edges and counts; a 2-D histogram (``GradHist2d``: gradient x parameter)
  as its two marginals ``cockpit/<key>/gradient`` and ``cockpit/<key>/parameter``,
  and with ``keep_individual=True`` the marginals of every parameter tensor
  (``cockpit/<key>/gradient/<name>``, ...);
* ``Parameters`` (raw values): one histogram of the values per parameter tensor.

Values the export cannot show (text such as the ``nonfinite`` markers) are skipped
and listed in the returned :class:`ExportSummary`; ``None`` (a metric
:meth:`Cockpit.log <cockpit.Cockpit.log>` was given as not measured) is no value and
is left out without being listed.

TensorBoard stores a histogram as bucket counts with right edges plus the data's
minimum and maximum; the export writes the log's right edges and counts unchanged
and uses the outer edges of the first and last non-empty bin as minimum and maximum
(TensorBoard draws those buckets with exactly the log's edges). The log keeps only
counts, so the histogram's sum and sum of squares are computed from bin centres.

Needs the ``tensorboard`` package (the ``tensorboard`` extra, docs/integrations.md);
writing uses ``torch.utils.tensorboard.SummaryWriter``.
"""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import numpy as np

from cockpit.errors import CockpitWarning
from cockpit.history import History
from cockpit.log.files import open_log
from cockpit.log.keys import LEARNING_RATES_KEY

if TYPE_CHECKING:  # pragma: no cover
    from torch.utils.tensorboard import SummaryWriter

#: Per-parameter quantities with a meaningful total over all tensors, and how it is
#: formed: ``"norm"`` (square root of the sum of squares) or ``"sum"``.
TOTALS: dict[str, str] = {
    "GradNorm": "norm",
    "Distance": "norm",
    "UpdateSize": "norm",
    "HessTrace": "sum",
    "Variance": "sum",
}

#: Names of the two axes of a 2-D histogram (GradHist2d: gradient x parameter).
HIST2D_AXES = ("gradient", "parameter")


@dataclass
class ExportSummary:
    """What :func:`export_tensorboard` wrote.

    Attributes:
        logdir: The TensorBoard directory written to (``None`` for a given writer).
        scalars: Number of scalar values written.
        histograms: Number of histograms written.
        steps: Number of steps exported.
        skipped: Keys with values that have no TensorBoard form, sorted.
    """

    logdir: str | None
    scalars: int = 0
    histograms: int = 0
    steps: int = 0
    skipped: list[str] = field(default_factory=list)


def summary_writer(logdir: str | os.PathLike) -> SummaryWriter:
    """Return a ``SummaryWriter`` for ``logdir``, or say how to install TensorBoard.

    Raises:
        ImportError: If the ``tensorboard`` package is missing (the message names
            the extra to install).
    """
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as error:  # torch raises this when tensorboard is missing
        raise ImportError(
            "Exporting to TensorBoard needs the tensorboard package. Fix: pip "
            "install tensorboard (or cockpit's extra, see docs/integrations.md)."
        ) from error
    return SummaryWriter(log_dir=os.fspath(logdir))


def export_tensorboard(
    log: Any,
    logdir: str | os.PathLike | None = None,
    *,
    param_names: Sequence[str | None] | None = None,
    prefix: str = "cockpit",
    writer: SummaryWriter | None = None,
) -> ExportSummary:
    """Write a cockpit log as TensorBoard scalars and histograms.

    Args:
        log: A log file (JSON, streamed, or cockpit-for-pytorch 1.0.2), a
            :class:`~cockpit.history.History`, a :class:`~cockpit.Cockpit` (its
            parameter names are used where known), or ``{step: {key: value}}``.
        logdir: The TensorBoard run directory (created if missing). A directory
            that already holds your run's event files is fine: TensorBoard merges
            the files of one directory into one run.
        param_names: Names of the parameter tensors, in the order of the
            per-parameter lists (``[name for name, _ in model.named_parameters()]``);
            missing or ``None`` names become ``param_<i>``.
        prefix: First part of every tag; ``""`` for none.
        writer: Write through this ``SummaryWriter`` instead of opening one for
            ``logdir`` (e.g. a Lightning ``TensorBoardLogger``'s ``experiment``);
            it is flushed, not closed.

    Returns:
        What was written.

    Raises:
        ValueError: If neither ``logdir`` nor ``writer`` is given.
        ImportError: If the ``tensorboard`` package is missing.
        LogFileError: If ``log`` is a path without a readable log holding a
            tracked step (:func:`~cockpit.log.files.open_log`).
    """
    history, known_names = _as_history(log)
    if param_names is None:
        param_names = known_names
    if writer is None and logdir is None:
        raise ValueError(
            "export_tensorboard needs a logdir (the TensorBoard run directory) or a "
            "SummaryWriter. Fix: export_tensorboard(log, 'runs/my_run')."
        )
    own = writer is None
    if own:
        writer = summary_writer(logdir)
    out = _Exporter(writer, list(param_names or []), prefix.strip("/"))
    try:
        for step, entries in history.items():
            out.steps += 1
            for key, value in entries.items():
                out.write(key, value, step)
    finally:
        if own:
            writer.close()
        else:
            writer.flush()
    if out.unnamed:
        counts = " or ".join(str(c) for c in sorted(out.unnamed))
        warnings.warn(
            f"export_tensorboard: {len(out.names)} parameter name(s) given, but the "
            f"per-parameter values of {', '.join(sorted(out.unnamed_keys))} hold "
            f"{counts} entries, so their tags use param_<i>. Fix: pass one name per "
            "parameter tensor the cockpit tracked, in its order.",
            CockpitWarning,
            stacklevel=2,
        )
    return ExportSummary(
        logdir=os.fspath(logdir) if own else None,
        scalars=out.scalars,
        histograms=out.histograms,
        steps=out.steps,
        skipped=sorted(out.skipped),
    )


def _as_history(log: Any) -> tuple[History, list[str | None] | None]:
    """Return the history of ``log`` and the parameter names it knows."""
    if isinstance(log, History):
        return log, None
    if hasattr(log, "history") and isinstance(log.history, History):  # a Cockpit
        return log.history, list(getattr(log, "param_names", None) or []) or None
    if isinstance(log, Mapping):
        return History(log), None
    return open_log(log), None


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _numeric_array(value: Any) -> np.ndarray | None:
    """Return ``value`` as a float array if it is a (nested) list of numbers."""
    if not isinstance(value, list) or not value:
        return None
    try:
        array = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError):  # ragged, or not numbers
        return None
    return array if array.dtype == np.float64 else None


class _Exporter:
    """Turns one history entry after the other into TensorBoard summaries."""

    def __init__(self, writer, names: list[str | None], prefix: str):
        self.writer = writer
        self.names = names
        self.prefix = prefix
        self.scalars = 0
        self.histograms = 0
        self.steps = 0
        self.skipped: set[str] = set()
        #: Per-parameter list lengths that did not match the names given, by key.
        self.unnamed: set[int] = set()
        self.unnamed_keys: set[str] = set()

    def tag(self, *parts: str) -> str:
        return "/".join(p for p in (self.prefix, *parts) if p)

    def name(self, index: int, count: int, key: str) -> str:
        """The tag part of parameter ``index`` of ``count`` parameters."""
        if count == len(self.names):
            if self.names[index]:
                return str(self.names[index])
        elif self.names:
            self.unnamed.add(count)
            self.unnamed_keys.add(key)
        return f"param_{index}"

    def write(self, key: str, value: Any, step: int) -> None:
        if value is None:  # not measured at this step (Cockpit.log's None)
            return
        is_list = isinstance(value, list) and len(value) > 0
        if _is_number(value):
            self.scalar(self.tag(key), value, step)
        elif isinstance(value, Mapping) and "hist" in value and "edges" in value:
            self.histogram_entry(key, value, step)
        elif is_list and all(map(_is_number, value)) and key == LEARNING_RATES_KEY:
            for group, rate in enumerate(value):  # per parameter group, not tensor
                self.scalar(self.tag(key, f"group_{group}"), rate, step)
        elif is_list and all(map(_is_number, value)):
            self.per_parameter(key, value, step)
        elif is_list and all(isinstance(v, list) for v in value):
            self.value_histograms(key, value, step)
        else:
            self.skipped.add(key)

    def scalar(self, tag: str, value: float, step: int) -> None:
        self.writer.add_scalar(tag, float(value), global_step=step)
        self.scalars += 1

    def per_parameter(self, key: str, values: list, step: int) -> None:
        for i, value in enumerate(values):
            self.scalar(self.tag(key, self.name(i, len(values), key)), value, step)
        total = TOTALS.get(key)
        if total == "norm":
            self.scalar(self.tag(key), math.sqrt(sum(v * v for v in values)), step)
        elif total == "sum":
            self.scalar(self.tag(key), math.fsum(values), step)

    def value_histograms(self, key: str, values: list, step: int) -> None:
        """One histogram of raw values per parameter tensor (``Parameters``)."""
        arrays = [_numeric_array(v) for v in values]
        if any(a is None for a in arrays):
            self.skipped.add(key)
            return
        for i, array in enumerate(arrays):
            if array.size and np.isfinite(array).all():
                name = self.name(i, len(arrays), key)
                self.writer.add_histogram(self.tag(key, name), array, global_step=step)
                self.histograms += 1

    def histogram_entry(self, key: str, value: Mapping, step: int) -> None:
        counts = _numeric_array(value["hist"])
        edges = value["edges"]
        if counts is None:
            self.skipped.add(key)
        elif counts.ndim == 1:
            self.histogram(self.tag(key), counts, np.asarray(edges, float), step)
        elif counts.ndim == 2 and len(edges) == 2:
            self.marginals(self.tag(key), counts, edges, step)
            for index in range(int(value.get("param_groups", 0) or 0)):
                single = value.get(f"param_{index}")
                if isinstance(single, Mapping) and "hist" in single:
                    name = self.name(index, int(value["param_groups"]), key)
                    self.marginals(
                        self.tag(key), _numeric_array(single["hist"]),
                        single["edges"], step, name,
                    )  # fmt: skip
        else:
            self.skipped.add(key)

    def marginals(self, tag, counts, edges, step, name: str = "") -> None:
        """The marginal histograms of a 2-D histogram (sum over the other axis)."""
        for axis, label in enumerate(HIST2D_AXES):
            marginal = counts.sum(axis=1 - axis)
            axis_edges = np.asarray(edges[axis], dtype=np.float64)
            self.histogram("/".join(p for p in (tag, label, name) if p), marginal,
                           axis_edges, step)  # fmt: skip

    def histogram(self, tag: str, counts, edges: np.ndarray, step: int) -> None:
        """Write counts over ``edges`` with :func:`histogram_raw_arguments`."""
        arguments = histogram_raw_arguments(counts, edges)
        if arguments is None:  # nothing was counted
            return
        self.writer.add_histogram_raw(tag, global_step=step, **arguments)
        self.histograms += 1


def histogram_raw_arguments(counts, edges) -> dict[str, Any] | None:
    """Arguments for ``SummaryWriter.add_histogram_raw`` from bin counts and edges.

    Args:
        counts: ``bins`` counts.
        edges: ``bins + 1`` increasing bin edges.

    Returns:
        ``min``, ``max`` (outer edges of the first and last non-empty bin),
        ``num``, ``sum`` and ``sum_squares`` (from bin centres),
        ``bucket_limits`` (the right edges) and ``bucket_counts``; ``None`` if all
        counts are zero.

    Raises:
        ValueError: If there are not ``len(counts) + 1`` edges.
    """
    counts = np.asarray(counts, dtype=np.float64).reshape(-1)
    edges = np.asarray(edges, dtype=np.float64).reshape(-1)
    if edges.size != counts.size + 1:
        raise ValueError(
            f"A histogram with {counts.size} bins needs {counts.size + 1} edges, got "
            f"{edges.size}."
        )
    filled = np.flatnonzero(counts)
    if filled.size == 0:
        return None
    centres = (edges[:-1] + edges[1:]) / 2
    return {
        "min": float(edges[filled[0]]),
        "max": float(edges[filled[-1] + 1]),
        "num": int(counts.sum()),
        "sum": float(counts @ centres),
        "sum_squares": float(counts @ centres**2),
        "bucket_limits": edges[1:].tolist(),
        "bucket_counts": counts.tolist(),
    }
