"""Per-step signals: the few scalars each check reads off a step's recorded values."""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping

import numpy as np

from cockpit.history import to_builtin
from cockpit.log.keys import LEARNING_RATES_KEY, NONFINITE_KEY


# --- per-step signals -------------------------
def _float(value: Any) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _largest(value: Any) -> float | None:
    """The largest of a list of numbers (the learning rates of the groups)."""
    try:
        array = np.asarray(value, dtype=np.float64).reshape(-1)
    except (TypeError, ValueError):
        return None
    return float(np.max(array)) if array.size else None


def _total_norm(value: Any) -> float | None:
    """Root sum of squares of a per-parameter list (or a scalar)."""
    try:
        array = np.asarray(value, dtype=np.float64).reshape(-1)
    except (TypeError, ValueError):
        return None
    if array.size == 0:
        return None
    with np.errstate(over="ignore", invalid="ignore"):
        return float(np.sqrt(np.sum(array * array)))


def _layer_ratio(value: Any) -> float | None:
    """Largest gradient norm of the first quarter of the tensors over the last's.

    A quarter is at least two tensors (four at least are needed). The largest
    norm of each end, not the first and last tensors alone: a transformer's first
    tensors can be a query and key whose gradients are tiny at initialisation
    (uniform attention) while the value and embedding gradients next to them are
    not; gradients vanish when every tensor near the input has a small one.
    """
    try:
        array = np.asarray(value, dtype=np.float64).reshape(-1)
    except (TypeError, ValueError):
        return None
    if array.size < 4 or not np.all(np.isfinite(array)):
        return None
    quarter = max(2, array.size // 4)
    first, last = float(np.max(array[:quarter])), float(np.max(array[-quarter:]))
    if last <= 0:
        return None
    return first / last


def _edge_fraction(value: Any) -> float | None:
    """Share of histogram counts in the two outer bins."""
    if not isinstance(value, Mapping) or "hist" not in value:
        return None
    try:
        hist = np.asarray(value["hist"], dtype=np.float64).reshape(-1)
    except (TypeError, ValueError):
        return None
    total = float(np.sum(hist))
    if hist.size < 3 or not math.isfinite(total) or total <= 0:
        return None
    return float((hist[0] + hist[-1]) / total)


_EXTRACT: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "loss": ("Loss", _float),
    "alpha": ("Alpha", _float),
    "grad_norm": ("GradNorm", _total_norm),
    "layer_ratio": ("GradNorm", _layer_ratio),
    "update_size": ("UpdateSize", _total_norm),
    "edge_fraction": ("GradHist1d", _edge_fraction),
    "norm_test": ("NormTest", _float),
    "inner_test": ("InnerTest", _float),
    "ortho_test": ("OrthoTest", _float),
    "learning_rate": ("learning_rate", _float),
    "learning_rates": (LEARNING_RATES_KEY, _largest),
    "nonfinite": (NONFINITE_KEY, lambda v: [str(x) for x in (v or [])] or None),
}


def step_signals(values: Mapping[str, Any]) -> dict[str, Any]:
    """Reduce the values recorded for one step to the scalars the checks read.

    Args:
        values: ``{key: value}`` of one step (history entries, plain or numpy).

    Returns:
        ``{signal: value}`` for the signals whose keys are present (floats; a list
        of strings for ``nonfinite``).
    """
    out: dict[str, Any] = {}
    for signal, (key, extract) in _EXTRACT.items():
        if key in values:
            value = values[key]
            if not isinstance(value, (float, int, np.ndarray)):
                try:  # tensors (also on a GPU), lists and dicts of them
                    value = to_builtin(value)
                except TypeError:
                    continue
            result = extract(value)
            if result is not None:
                out[signal] = result
    return out


class Signals:
    """Per-signal ``(steps, values)`` series, built step by step."""

    def __init__(self):
        self.steps: dict[str, list[int]] = {}
        self.values: dict[str, list[Any]] = {}
        self.keys: set[str] = set()

    def add(self, global_step: int, values: Mapping[str, Any]) -> None:
        """Add the signals of one step's recorded values."""
        self.keys.update(values)
        for signal, value in step_signals(values).items():
            self.steps.setdefault(signal, []).append(int(global_step))
            self.values.setdefault(signal, []).append(value)

    def series(self, signal: str) -> tuple[np.ndarray, np.ndarray]:
        """Steps (int) and values (float64) of a numeric signal, in step order."""
        steps = np.asarray(self.steps.get(signal, []), dtype=np.int64)
        values = np.asarray(self.values.get(signal, []), dtype=np.float64)
        order = np.argsort(steps, kind="stable")
        return steps[order], values[order]

    def has(self, signal: str) -> bool:
        """Whether at least one value of ``signal`` was seen."""
        return bool(self.steps.get(signal))
