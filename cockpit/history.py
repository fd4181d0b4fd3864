"""The history of a run: ``global_step -> quantity key -> value``.

The history is the only thing plotting reads (data flows quantities -> history ->
plotting). It hands out plain Python values (floats, ints, lists, dicts), writes
standard JSON (non-finite floats are tagged so they survive a round trip) and reads
its own logs, streamed logs (:mod:`cockpit.log_stream`) and logs written by
cockpit-for-pytorch 1.0.2 (json_tricks ``__ndarray__`` objects).

Long runs: numeric arrays with at least :data:`COMPACT_MIN_SIZE` entries (histograms,
per-parameter lists of large models) are kept as numpy arrays inside the history
(8 bytes per number instead of about 32 for a list of Python floats) and turned back
into lists when read, so what a reader sees does not change.
"""

from __future__ import annotations

import json
import math
import os
import sys
from types import MappingProxyType
from typing import Any, Iterator, Mapping

import numpy as np

from cockpit.errors import unwritable_error

_FLOAT_TAG = "__float__"
_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}

#: Numeric arrays with at least this many entries are stored compactly.
COMPACT_MIN_SIZE = 16


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


def _compact_array(array: np.ndarray) -> Any:
    """Keep a large numeric array as a read-only copy, a small one as a list."""
    if array.ndim == 0:
        return array.item()
    if array.size < COMPACT_MIN_SIZE or array.dtype.kind not in "biuf":
        return array.tolist()
    array = np.array(array, copy=True, order="C")
    array.flags.writeable = False
    return array


def _leaf_kind(items: list | tuple) -> tuple[type | None, int]:
    """Return the common type of the leaves of a nested list (float, int or None).

    ``None`` means the leaves mix types or are not all numbers. Also returns the
    number of leaves seen.
    """
    kind: type | None = None
    count = 0
    stack = [items]
    while stack:
        for item in stack.pop():
            if isinstance(item, (list, tuple)):
                stack.append(item)
                continue
            leaf = type(item)
            if leaf is not float and leaf is not int:
                return None, count
            if kind is None:
                kind = leaf
            elif kind is not leaf:
                return None, count
            count += 1
    return kind, count


def _compact(value: Any) -> Any:
    """Like :func:`to_builtin`, but keep large numeric arrays as numpy arrays."""
    if value is None or isinstance(value, (bool, str, int, float)):
        return value
    if hasattr(value, "detach"):  # torch.Tensor
        tensor = value.detach()
        if tensor.dim() == 0 or tensor.numel() < COMPACT_MIN_SIZE:
            return tensor.cpu().tolist()
        if tensor.dtype.is_complex:
            return tensor.cpu().tolist()
        if tensor.dtype.is_floating_point and tensor.element_size() < 4:
            tensor = tensor.float()  # bfloat16 has no numpy dtype; float32 is exact
        return _compact_array(tensor.cpu().numpy())
    if isinstance(value, np.ndarray):
        return _compact_array(value)
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, Mapping):
        return {str(k): _compact(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        kind, count = _leaf_kind(value)
        if kind is not None and count >= COMPACT_MIN_SIZE:
            try:
                array = np.array(value, dtype=np.float64 if kind is float else np.int64)
            except (ValueError, OverflowError):  # ragged, or ints beyond int64
                array = None
            if array is not None:
                array.flags.writeable = False
                return array
        return [_compact(v) for v in value]
    return to_builtin(value)  # raises the TypeError for unsupported values


def _expand(value: Any) -> Any:
    """Undo :func:`_compact`: numpy arrays become (nested) lists again."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, dict):
        return {k: _expand(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_expand(v) for v in value]
    return value


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
    """Values recorded during training, keyed by global step and quantity key.

    Reading (``history[step]``, :meth:`items`, :meth:`series`, :meth:`to_dict`)
    returns fresh plain-Python copies; change values with :meth:`add`.
    """

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
        """Store ``value`` for ``key`` at ``global_step`` (overwrites an old value).

        Args:
            global_step: The step.
            key: The quantity key.
            value: A number, tensor, array, or (nested) list/dict of them.

        Raises:
            TypeError: For a value that has no JSON representation.
        """
        self._data.setdefault(int(global_step), {})[key] = _compact(value)

    def update(self, other: History | Mapping[int, Mapping[str, Any]]) -> None:
        """Merge another history (or nested dict) into this one."""
        for step, entries in other.items():
            for key, value in entries.items():
                self.add(int(step), key, value)

    # --- reading -------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._data)

    def __contains__(self, global_step: int) -> bool:
        return int(global_step) in self._data

    def __getitem__(self, global_step: int) -> dict[str, Any]:
        return _expand(self._data[int(global_step)])

    def __iter__(self) -> Iterator[int]:
        return iter(sorted(self._data))

    def view(self, global_step: int) -> Mapping[str, Any]:
        """Return one step's entries as stored, read-only and without copying.

        Cheaper than ``history[step]`` for large values (histograms): numeric arrays
        come back as read-only numpy arrays rather than lists. Meant for readers
        such as the dashboard; the mapping must not be kept across :meth:`add`.

        Raises:
            KeyError: If nothing was recorded at ``global_step``.
        """
        return MappingProxyType(self._data[int(global_step)])

    def items(self) -> Iterator[tuple[int, dict[str, Any]]]:
        """Iterate over ``(step, {key: value})`` in step order."""
        for step in sorted(self._data):
            yield step, _expand(self._data[step])

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
        for step in sorted(self._data):
            entries = self._data[step]
            if key in entries:
                steps.append(step)
                values.append(_expand(entries[key]))
        return steps, values

    def state_dict(self) -> dict[int, dict[str, Any]]:
        """Return the content for a checkpoint, compactly.

        Large numeric arrays become tensors (``torch.save`` stores them as binary
        blobs, and ``torch.load(..., weights_only=True)`` accepts them); everything
        else is plain Python.

        Returns:
            ``{step: {key: value}}``, readable by :meth:`load_state_dict` and by
            the constructor.
        """
        import torch

        def export(value: Any) -> Any:
            if isinstance(value, np.ndarray):
                return torch.tensor(value)
            if isinstance(value, dict):
                return {k: export(v) for k, v in value.items()}
            if isinstance(value, list):
                return [export(v) for v in value]
            return value

        return {step: export(entries) for step, entries in sorted(self._data.items())}

    def load_state_dict(self, state: Mapping[int, Mapping[str, Any]]) -> None:
        """Replace the content by a :meth:`state_dict` (or a ``{step: {key: value}}``).

        Args:
            state: The content to load.
        """
        self._data = {}
        self.update(state)

    def memory_bytes(self) -> int:
        """Estimate the memory the stored values take (containers, numbers, arrays).

        Returns:
            Bytes, counting every container and number object once per reference
            (small ints and shared floats are overcounted slightly).
        """
        total = sys.getsizeof(self._data)
        stack: list[Any] = list(self._data.values())
        while stack:
            value = stack.pop()
            if isinstance(value, np.ndarray):
                total += sys.getsizeof(value)  # includes the data of an owning array
                continue
            total += sys.getsizeof(value)
            if isinstance(value, dict):
                total += sum(sys.getsizeof(k) for k in value)
                stack.extend(value.values())
            elif isinstance(value, list):
                stack.extend(value)
        return total

    def to_dict(self) -> dict[int, dict[str, Any]]:
        """Return ``{step: {key: value}}`` (a copy, steps sorted)."""
        return dict(self.items())

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

        Raises:
            OSError: If the file cannot be written (the message names the path and
                the fix; the history stays in memory).
        """
        path = os.fspath(path)
        payload = {str(step): _encode(entries) for step, entries in self.items()}
        text = json.dumps(payload, indent=2, sort_keys=True, allow_nan=False)
        tmp = f"{path}.tmp{os.getpid()}"
        try:
            parent = os.path.dirname(path)
            if parent:
                os.makedirs(parent, exist_ok=True)
            with open(tmp, "w", encoding="utf-8") as handle:
                handle.write(text)
            os.replace(tmp, path)
        except OSError as error:
            if os.path.exists(tmp):
                os.remove(tmp)
            raise unwritable_error(path, error) from error
        return path

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> History:
        """Read a log: standard JSON, a streamed log, or a cockpit-for-pytorch log.

        The format is detected from the first line: streamed logs (written while
        training with ``Cockpit(..., logpath=...)``, see :mod:`cockpit.log_stream`)
        are read record by record, merged per step, and a torn last record (the
        run was killed while writing it) is skipped with a warning.

        Args:
            path: Path of the log. If it does not exist as given, ``.json`` and then
                ``.jsonl`` are appended (the reference names logs without suffix).

        Returns:
            The history.

        Raises:
            FileNotFoundError: If no log exists under any of these names.
        """
        from cockpit.log_stream import is_stream_file, read_stream

        path = os.fspath(path)
        if not os.path.exists(path):
            for suffix in (".json", ".jsonl"):
                if os.path.exists(path + suffix):
                    path = path + suffix
                    break
            else:
                raise FileNotFoundError(
                    f"No cockpit log at {path!r} (also tried {path + '.json'!r} and "
                    f"{path + '.jsonl'!r}). Fix: pass the path given to "
                    "Cockpit.write() or Cockpit(..., logpath=...)."
                )
        if is_stream_file(path):
            return cls(read_stream(path))
        with open(path, encoding="utf-8") as handle:
            raw = json.load(handle)
        return cls({int(step): _decode(entries) for step, entries in raw.items()})
