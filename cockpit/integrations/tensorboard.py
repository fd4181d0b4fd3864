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

import os
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import numpy as np

from cockpit.errors import CockpitWarning
from cockpit.history import History
from cockpit.integrations.series import (
    HIST2D_AXES,
    TOTALS,
    Histogram,
    Samples,
    Scalar,
    Series,
)
from cockpit.log.files import open_log

__all__ = [
    "HIST2D_AXES",
    "TOTALS",
    "ExportSummary",
    "export_tensorboard",
    "histogram_raw_arguments",
    "summary_writer",
    "write_item",
]

if TYPE_CHECKING:  # pragma: no cover
    from torch.utils.tensorboard import SummaryWriter


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


class _Exporter(Series):
    """Writes one history entry after the other as TensorBoard summaries."""

    def __init__(self, writer, names: list[str | None], prefix: str):
        super().__init__(names, prefix)
        self.writer = writer
        self.scalars = 0
        self.histograms = 0
        self.steps = 0

    def write(self, key: str, value: Any, step: int) -> None:
        for item in self.item(key, value):
            write_item(self.writer, item, step)
            if isinstance(item, Scalar):
                self.scalars += 1
            elif not isinstance(item, Histogram) or item.counts.any():
                self.histograms += 1


def write_item(writer, item: Scalar | Histogram | Samples, step: int) -> None:
    """Write one :mod:`~cockpit.integrations.series` item through a ``SummaryWriter``.

    A histogram with nothing counted is left out.
    """
    if isinstance(item, Scalar):
        writer.add_scalar(item.tag, item.value, global_step=step)
    elif isinstance(item, Samples):
        writer.add_histogram(item.tag, item.values, global_step=step)
    else:
        arguments = histogram_raw_arguments(item.counts, item.edges)
        if arguments is not None:
            writer.add_histogram_raw(item.tag, global_step=step, **arguments)


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
