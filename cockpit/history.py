"""The history of a run: ``global_step -> quantity key -> value``.

The history is the only thing plotting reads (data flows quantities -> history ->
plotting). It holds plain Python values (floats, ints, lists, dicts), writes standard
JSON (non-finite floats are tagged so they survive a round trip) and reads both its own
logs and logs written by cockpit-for-pytorch 1.0.2 (json_tricks ``__ndarray__``
objects).
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Iterator, Mapping

import numpy as np

_FLOAT_TAG = "__float__"
_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def to_builtin(value: Any) -> Any:
    """Convert tensors, arrays and numpy scalars (recursively) to plain Python values.

    Args:
        value: A number, tensor, array, or a (nested) list/tuple/dict of them.

    Returns:
        The same data made of ``float``, ``int``, ``bool``, ``str``, ``None``,
        ``list`` and ``dict`` only.

    Raises:
        TypeError: For a value that has no JSON representation.
    """
    if value is None or isinstance(value, (bool, str, int, float)):
        return value
    if hasattr(value, "detach"):  # torch.Tensor
        return value.detach().cpu().tolist()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, Mapping):
        return {str(k): to_builtin(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_builtin(v) for v in value]
    raise TypeError(
        f"Cannot store a value of type {type(value).__name__} in the history; "
        "return numbers, tensors, arrays, or lists/dicts of them."
    )


def _encode(value: Any) -> Any:
    """Replace non-finite floats by tagged objects (standard JSON has no NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        tag = "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
        return {_FLOAT_TAG: tag}
    if isinstance(value, dict):
        return {k: _encode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_encode(v) for v in value]
    return value


def _decode(value: Any) -> Any:
    """Undo :func:`_encode` and unpack json_tricks arrays into (nested) lists."""
    if isinstance(value, dict):
        if set(value) == {_FLOAT_TAG}:
            return _NONFINITE[value[_FLOAT_TAG]]
        if "__ndarray__" in value:
            array = np.asarray(value["__ndarray__"], dtype=value.get("dtype"))
            if "shape" in value:
                array = array.reshape(value["shape"])
            return array.tolist()
        return {k: _decode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode(v) for v in value]
    return value


def json_path(logpath: str | os.PathLike) -> str:
    """Return ``logpath`` with a ``.json`` suffix (added unless already present)."""
    logpath = os.fspath(logpath)
    return logpath if logpath.endswith(".json") else logpath + ".json"


class History:
    """Values recorded during training, keyed by global step and quantity key."""

    def __init__(self, data: Mapping[int, Mapping[str, Any]] | None = None):
        """Create a history, optionally from ``{step: {key: value}}``.

        Args:
            data: Initial content; steps are converted to ``int``.
        """
        self._data: dict[int, dict[str, Any]] = {}
        for step, entries in (data or {}).items():
            for key, value in entries.items():
                self.add(int(step), key, value)

    # --- writing -------------------------------------------------------------------
    def add(self, global_step: int, key: str, value: Any) -> None:
        """Store ``value`` for ``key`` at ``global_step`` (overwrites an old value)."""
        self._data.setdefault(int(global_step), {})[key] = to_builtin(value)

    def update(self, other: History | Mapping[int, Mapping[str, Any]]) -> None:
        """Merge another history (or nested dict) into this one."""
        items = other.items() if isinstance(other, History) else other.items()
        for step, entries in items:
            for key, value in entries.items():
                self.add(int(step), key, value)

    # --- reading -------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._data)

    def __contains__(self, global_step: int) -> bool:
        return int(global_step) in self._data

    def __getitem__(self, global_step: int) -> dict[str, Any]:
        return self._data[int(global_step)]

    def __iter__(self) -> Iterator[int]:
        return iter(sorted(self._data))

    def items(self) -> Iterator[tuple[int, dict[str, Any]]]:
        """Iterate over ``(step, {key: value})`` in step order."""
        for step in sorted(self._data):
            yield step, self._data[step]

    @property
    def steps(self) -> list[int]:
        """All steps that hold at least one value, in order."""
        return sorted(self._data)

    @property
    def keys(self) -> list[str]:
        """All quantity keys that occur, sorted."""
        return sorted({k for entries in self._data.values() for k in entries})

    def series(self, key: str) -> tuple[list[int], list[Any]]:
        """Return the steps at which ``key`` was recorded and its values there."""
        steps, values = [], []
        for step, entries in self.items():
            if key in entries:
                steps.append(step)
                values.append(entries[key])
        return steps, values

    def to_dict(self) -> dict[int, dict[str, Any]]:
        """Return ``{step: {key: value}}`` (a shallow copy, steps sorted)."""
        return {step: dict(entries) for step, entries in self.items()}

    def to_dataframe(self):
        """Return a pandas DataFrame with one row per step and one column per key.

        The index is named ``step``; missing values are ``NaN``; list-valued
        quantities (per-parameter values, histograms) stay lists in their cells.

        Returns:
            pandas.DataFrame
        """
        import pandas as pd

        rows = self.to_dict()
        frame = pd.DataFrame.from_dict(rows, orient="index", columns=self.keys)
        frame.index.name = "step"
        return frame

    # --- files ---------------------------------------------------------------------
    def write_json(self, path: str | os.PathLike) -> str:
        """Write the history as standard JSON (sorted keys, indent 2).

        Steps become string keys; NaN and infinities become
        ``{"__float__": "nan" | "inf" | "-inf"}``. The file is written to a temporary
        name and moved into place, so a crash never leaves a half-written log.

        Args:
            path: Target file path (parent directories are created).

        Returns:
            The path written.
        """
        path = os.fspath(path)
        parent = os.path.dirname(path)
        if parent:
            os.makedirs(parent, exist_ok=True)
        payload = {str(step): _encode(entries) for step, entries in self.items()}
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as handle:
            json.dump(payload, handle, indent=2, sort_keys=True, allow_nan=False)
        os.replace(tmp, path)
        return path

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> History:
        """Read a log written by :meth:`write_json` or by cockpit-for-pytorch 1.0.2.

        Args:
            path: Path of the log; ``.json`` is appended if the file does not exist
                as given (the reference names logs without the suffix).

        Returns:
            The history.
        """
        path = os.fspath(path)
        if not os.path.exists(path) and os.path.exists(path + ".json"):
            path = path + ".json"
        with open(path, encoding="utf-8") as handle:
            raw = json.load(handle)
        return cls({int(step): _decode(entries) for step, entries in raw.items()})
