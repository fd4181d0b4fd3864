"""The names and forms of a log's values in a tracker: one place for every tracker.

TensorBoard (:mod:`cockpit.integrations.tensorboard`), the Lightning loggers and
Hugging Face's ``report_to`` callbacks (:mod:`cockpit.integrations.loggers`), W&B
(:mod:`cockpit.integrations.wandb`) and MLflow (:mod:`cockpit.integrations.mlflow`)
all show a step's values under the names :class:`Series` gives them:

* a number (``Loss``, ``Alpha``, ``NormTest``, ``learning_rate``, ...): the scalar
  ``<prefix>/<key>``;
* a per-parameter list (``GradNorm``, ``Distance``, ...): one scalar per parameter
  tensor, ``<prefix>/<key>/<name>`` (the parameter's name where known, else
  ``param_<i>``), and for the quantities in :data:`TOTALS` the total over all
  tensors as ``<prefix>/<key>`` (the norm of the per-tensor norms, the sum of the
  per-tensor traces);
* ``learning_rates`` (one per parameter group): ``<prefix>/learning_rates/group_<i>``;
* a histogram (``GradHist1d``): :class:`Histogram` ``<prefix>/<key>`` with the log's
  edges and counts; a 2-D one (``GradHist2d``) as its two marginals
  ``<prefix>/<key>/gradient`` and ``<prefix>/<key>/parameter`` (and per tensor,
  ``.../gradient/<name>``, with ``keep_individual=True``);
* ``Parameters`` (raw values): :class:`Samples` ``<prefix>/Parameters/<name>``.

Values without such a form (text, e.g. the ``nonfinite`` and ``missing`` records)
are skipped and listed in :attr:`Series.skipped`; ``None`` is no value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Sequence

import numpy as np

from cockpit.log.keys import LEARNING_RATES_KEY

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


@dataclass(frozen=True)
class Scalar:
    """One number under its name."""

    tag: str
    value: float


@dataclass(frozen=True)
class Histogram:
    """Bin counts over increasing edges (``len(edges) == len(counts) + 1``)."""

    tag: str
    counts: np.ndarray
    edges: np.ndarray


@dataclass(frozen=True)
class Samples:
    """Raw values (a tracker histograms them itself), e.g. one parameter tensor."""

    tag: str
    values: np.ndarray


#: What :meth:`Series.items` yields.
Item = Scalar | Histogram | Samples


def is_number(value: Any) -> bool:
    """Whether ``value`` is an int or float (not a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def numeric_array(value: Any) -> np.ndarray | None:
    """``value`` as a float array if it is a (nested) list of numbers, else ``None``."""
    if not isinstance(value, list) or not value:
        return None
    try:
        array = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError):  # ragged, or not numbers
        return None
    return array if array.dtype == np.float64 else None


class Series:
    """Turns one step's values after the other into named scalars and histograms.

    Args:
        names: Names of the parameter tensors, in the order of the per-parameter
            lists; missing or ``None`` names become ``param_<i>``.
        prefix: First part of every name (``""``: none).
        separator: Between the parts of a name.

    Attributes:
        skipped: Keys with values that have no form here.
        unnamed: Lengths of per-parameter lists that did not match ``names``.
        unnamed_keys: The keys of those lists.
    """

    def __init__(
        self,
        names: Sequence[str | None] | None = None,
        prefix: str = "cockpit",
        separator: str = "/",
    ):
        self.names = list(names or [])
        self.prefix = prefix.strip(separator)
        self.separator = separator
        self.skipped: set[str] = set()
        self.unnamed: set[int] = set()
        self.unnamed_keys: set[str] = set()

    def tag(self, *parts: str) -> str:
        """The name made of ``prefix`` and ``parts``."""
        return self.separator.join(p for p in (self.prefix, *parts) if p)

    def name(self, index: int, count: int, key: str) -> str:
        """The name part of parameter ``index`` of ``count`` parameters."""
        if count == len(self.names):
            if self.names[index]:
                return str(self.names[index])
        elif self.names:
            self.unnamed.add(count)
            self.unnamed_keys.add(key)
        return f"param_{index}"

    def items(self, values: Mapping[str, Any]) -> Iterator[Item]:
        """Everything of one step's ``{key: value}`` that has a form, in key order."""
        for key, value in values.items():
            yield from self.item(key, value)

    def scalars(self, values: Mapping[str, Any]) -> dict[str, float]:
        """Only the scalars of one step's values, as ``{name: value}``."""
        return {i.tag: i.value for i in self.items(values) if isinstance(i, Scalar)}

    def item(self, key: str, value: Any) -> Iterator[Item]:
        """The forms of one value."""
        if value is None:  # not measured at this step (Cockpit.log's None)
            return
        is_list = isinstance(value, list) and len(value) > 0
        if is_number(value):
            yield Scalar(self.tag(key), float(value))
        elif isinstance(value, Mapping) and "hist" in value and "edges" in value:
            yield from self._histogram_entry(key, value)
        elif is_list and all(map(is_number, value)) and key == LEARNING_RATES_KEY:
            for group, rate in enumerate(value):  # per parameter group, not tensor
                yield Scalar(self.tag(key, f"group_{group}"), float(rate))
        elif is_list and all(map(is_number, value)):
            yield from self._per_parameter(key, value)
        elif is_list and all(isinstance(v, list) for v in value):
            yield from self._samples(key, value)
        else:
            self.skipped.add(key)

    def _per_parameter(self, key: str, values: list) -> Iterator[Scalar]:
        for i, value in enumerate(values):
            yield Scalar(self.tag(key, self.name(i, len(values), key)), float(value))
        total = TOTALS.get(key)
        if total == "norm":
            yield Scalar(self.tag(key), math.sqrt(sum(v * v for v in values)))
        elif total == "sum":
            yield Scalar(self.tag(key), math.fsum(values))

    def _samples(self, key: str, values: list) -> Iterator[Samples]:
        """One set of raw values per parameter tensor (``Parameters``)."""
        arrays = [numeric_array(v) for v in values]
        if any(a is None for a in arrays):
            self.skipped.add(key)
            return
        for i, array in enumerate(arrays):
            if array.size and np.isfinite(array).all():
                name = self.name(i, len(arrays), key)
                yield Samples(self.tag(key, name), array.reshape(-1))

    def _histogram_entry(self, key: str, value: Mapping) -> Iterator[Histogram]:
        counts = numeric_array(value["hist"])
        edges = value["edges"]
        if counts is None:
            self.skipped.add(key)
        elif counts.ndim == 1:
            yield Histogram(self.tag(key), counts, np.asarray(edges, np.float64))
        elif counts.ndim == 2 and len(edges) == 2:
            yield from self._marginals(self.tag(key), counts, edges)
            groups = int(value.get("param_groups", 0) or 0)
            for index in range(groups):
                single = value.get(f"param_{index}")
                if isinstance(single, Mapping) and "hist" in single:
                    name = self.name(index, groups, key)
                    counts = numeric_array(single["hist"])
                    yield from self._marginals(
                        self.tag(key), counts, single["edges"], name
                    )
        else:
            self.skipped.add(key)

    def _marginals(self, tag, counts, edges, name: str = "") -> Iterator[Histogram]:
        """The marginal histograms of a 2-D histogram (sum over the other axis)."""
        for axis, label in enumerate(HIST2D_AXES):
            marginal = counts.sum(axis=1 - axis)
            axis_edges = np.asarray(edges[axis], dtype=np.float64)
            parts = (tag, label, name)
            yield Histogram(self.separator.join(p for p in parts if p), marginal,
                            axis_edges)  # fmt: skip
