"""The history of a run: ``global_step -> quantity key -> value``.

The history is the only thing plotting reads (data flows quantities -> history ->
plotting). It hands out plain Python values (floats, ints, lists, dicts), writes
standard JSON (non-finite floats are tagged so they survive a round trip) or, on
request, the format of cockpit-for-pytorch 1.0.2, and reads its own logs, streamed
logs (:mod:`cockpit.log.stream`) and logs written by 1.0.2 (json_tricks
``__ndarray__`` objects). How values are stored and encoded is in
:mod:`cockpit.log.format`.

Long runs: numeric arrays with at least :data:`COMPACT_MIN_SIZE` entries (histograms,
per-parameter lists of large models) are kept as numpy arrays inside the history
(8 bytes per number instead of about 32 for a list of Python floats) and turned back
into lists when read, so what a reader sees does not change.

Nothing here imports torch or BackPACK: logs can be read without them.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import sys
import warnings
from types import MappingProxyType
from typing import Any, Iterator, Mapping

import numpy as np

from cockpit.errors import unwritable_error
from cockpit.log.format import (
    COMPACT_MIN_SIZE,
    compact,
    decode,
    encode,
    encode_legacy,
    expand,
    pack,
    to_builtin,
    to_output,
)
from cockpit.log.json_file import (
    NotStreamable,
    find_log,
    is_tagged,
    json_log_steps,
    json_path,
    parse_json_log,
)
from cockpit.log.keys import ESTIMATE_SUFFIX
from cockpit.log.stream import (
    STREAM_MAGIC,
    file_lines,
    is_stream_data,
    parse_stream,
    stream_records,
)

__all__ = ["COMPACT_MIN_SIZE", "History", "json_path", "to_builtin"]


class _Fallback(Exception):
    """The log cannot be read step by step; read it whole instead."""


def _log_steps(path: str, upto: int | None):
    """Yield ``(step, entries as written)`` of a log, and resume markers.

    A resume marker of a streamed log comes as ``(None, after)``.
    """
    with open(path, "rb") as handle:
        if is_stream_data(handle.read(len(STREAM_MAGIC) + 1)):
            handle.seek(0)
            for _, step, values in stream_records(path, file_lines(handle)):
                if step is None or upto is None or step <= upto:
                    yield step, values
            return
        handle.seek(0)
        try:
            for step, entries in json_log_steps(handle):
                if upto is None or step <= upto:
                    yield step, entries
        except NotStreamable as error:
            raise _Fallback from error


def _read_latest(path: str, upto: int | None) -> History:
    """Read a log, keeping of dict values (histograms) only the latest per key.

    Estimates' descriptions (``<key>_estimate``, small) are kept at every step:
    the dashboard draws their standard errors along the values.
    """
    values: dict[int, dict[str, Any]] = {}
    latest: dict[str, tuple[int, Any]] = {}
    for step, entries in _log_steps(path, upto):
        if step is None:  # streamed resume marker: later records are void
            after = entries
            for later in [s for s in values if s > after]:
                del values[later]
            if any(found[0] > after for found in latest.values()):
                raise _Fallback  # an earlier dict value is needed: read it all
            continue
        kept = values.setdefault(step, {})
        for key, raw in entries.items():
            if (
                isinstance(raw, dict)
                and not is_tagged(raw)
                and not key.endswith(ESTIMATE_SUFFIX)
            ):
                found = latest.get(key)
                if found is None or found[0] <= step:
                    latest[key] = (step, raw)
                kept.pop(key, None)
            else:
                kept[key] = decode(raw)
    for key, (step, raw) in latest.items():
        values[step][key] = decode(raw)
    return History.from_decoded(values)


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
        self._revision = 0
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
        self._data.setdefault(int(global_step), {})[key] = compact(value)
        self._revision += 1

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
        return expand(self._data[int(global_step)])

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

    def missing_at(self, global_step: int) -> Mapping[str, str] | None:
        """The ``missing`` entries held for ``global_step`` (``None``: no step)."""
        entries = self._data.get(int(global_step))
        return None if entries is None else entries.get("missing")

    def items(self) -> Iterator[tuple[int, dict[str, Any]]]:
        """Iterate over ``(step, {key: value})`` in step order."""
        for step in sorted(self._data):
            yield step, expand(self._data[step])

    @property
    def revision(self) -> int:
        """A number that changes whenever a value is added or the content replaced."""
        return self._revision

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
                values.append(expand(entries[key]))
        return steps, values

    def output_series(self, key: str) -> tuple[list[int], list[Any]]:
        """Like :meth:`series`, but values as :meth:`to_output` gives them."""
        steps, values = self.stored_series(key)
        return steps, [to_output(value) for value in values]

    def stored_series(
        self, key: str, first: int | None = None, last: int | None = None
    ) -> tuple[list[int], list[Any]]:
        """Like :meth:`series`, but values as stored (arrays read-only, uncopied).

        Cheaper for readers such as the dashboard; the values must not be kept
        across :meth:`add`.

        Args:
            key: The quantity key.
            first: Skip steps before this one (``None``: none).
            last: Skip steps after this one (``None``: none).
        """
        steps, values = [], []
        data = self._data
        for step in sorted(data):
            if (first is not None and step < first) or (
                last is not None and step > last
            ):
                continue
            entries = data[step]
            if key in entries:
                steps.append(step)
                values.append(entries[key])
        return steps, values

    @classmethod
    def from_decoded(cls, data: Mapping[int, Mapping[str, Any]]) -> History:
        """Return a history of ``{step: {key: value}}`` read from a log.

        For plain Python values as :func:`~cockpit.log.format.decode` gives them;
        faster than the constructor: only lists and dicts go through
        :func:`~cockpit.log.format.compact`.
        """
        history = cls()
        plain = (bool, str, int, float, type(None))
        for step, entries in data.items():
            history._data[int(step)] = {
                str(key): value if isinstance(value, plain) else compact(value)
                for key, value in entries.items()
            }
        return history

    def state_dict(self) -> dict[int, dict[str, Any]]:
        """Return the content for a checkpoint, compactly.

        Large numeric arrays become tensors when torch is loaded, as it is in every
        process that trains with a cockpit (``torch.save`` stores them as binary
        blobs, and ``torch.load(..., weights_only=True)`` accepts them); otherwise
        they stay numpy arrays. Everything else is plain Python.

        Returns:
            ``{step: {key: value}}``, readable by :meth:`load_state_dict` and by
            the constructor.
        """
        torch = sys.modules.get("torch")  # never imported here: see the module doc

        def export(value: Any) -> Any:
            if isinstance(value, np.ndarray):
                return value.copy() if torch is None else torch.tensor(value)
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
        self._revision += 1
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

    def to_output(self) -> collections.defaultdict[int, dict[str, Any]]:
        """Return ``{step: {key: value}}`` as cockpit-for-pytorch 1.0.2's output.

        The result is a ``collections.defaultdict(dict)`` (as 1.0.2's
        ``Cockpit.get_output()``), steps in order. Histogram results (``GradHist1d``,
        ``GradHist2d`` and its per-layer ``param_k`` entries: every mapping with
        ``hist`` and ``edges``) hold numpy arrays: ``hist`` one array, ``edges`` one
        array (1-D) or a tuple of one array per axis (2-D). Everything else is plain
        Python, as :meth:`to_dict` returns it.

        Returns:
            A fresh copy; changing it does not change the history.
        """
        output: collections.defaultdict[int, dict[str, Any]] = collections.defaultdict(
            dict
        )
        for step in sorted(self._data):
            output[step] = to_output(self._data[step])
        return output

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
    def write_json(
        self, path: str | os.PathLike, legacy: bool = False, packed: bool = True
    ) -> str:
        """Write the history as JSON, in our format or in cockpit-for-pytorch 1.0.2's.

        Steps become string keys, keys are sorted. Our format (the default) is
        standard JSON, one line per step; NaN and infinities become
        ``{"__float__": "nan" | "inf" | "-inf"}``, and large arrays are packed
        (:func:`~cockpit.log.format.pack`: histogram edges as
        ``{"__linspace__": ...}``, mostly-zero counts as ``{"__sparse__": ...}``), a
        few KB per step of the ``full`` configuration. ``packed=False`` writes plain
        lists instead, with indent 2 (about 33 KB per step of ``full``), for tools
        that read the JSON without cockpit. With ``legacy=True`` the file is
        what 1.0.2 wrote with json_tricks (indent 4): histogram arrays as
        ``{"__ndarray__": ..., "dtype": ..., "shape": ...}`` objects (plus the
        ``Corder`` flag for 2-D arrays), NaN and infinities as the non-standard
        tokens ``NaN``/``Infinity``. 1.0.2's plotter reads it, and so does
        :meth:`from_json`. The file is written to a temporary name and moved into
        place, so a crash never leaves a half-written log.

        Args:
            path: Target file path (parent directories are created); used as given
                (``Cockpit.write`` adds ``.json`` with
                :func:`~cockpit.log.json_file.json_path`).
            legacy: Write 1.0.2's format instead of standard JSON.
            packed: Pack large arrays (ignored with ``legacy=True``).

        Returns:
            The path written.

        Raises:
            OSError: If the file cannot be written (the message names the path and
                the fix; the history stays in memory).
        """
        path = os.fspath(path)
        if legacy:
            payload = {
                str(step): encode_legacy(entries)
                for step, entries in self.to_output().items()
            }
            text = json.dumps(payload, indent=4, sort_keys=True, allow_nan=True)
        elif packed:
            lines = [
                f"{json.dumps(str(step))}: "
                + json.dumps(
                    pack(self._data[step]),
                    separators=(",", ":"),
                    sort_keys=True,
                    allow_nan=False,
                )
                for step in sorted(self._data)
            ]
            text = "{\n" + ",\n".join(lines) + "\n}\n" if lines else "{}\n"
        else:
            payload = {str(step): encode(entries) for step, entries in self.items()}
            text = json.dumps(payload, indent=2, sort_keys=True, allow_nan=False)
        tmp = f"{path}.tmp{os.getpid()}"
        try:
            parent = os.path.dirname(path)
            if parent:
                os.makedirs(parent, exist_ok=True)
            with open(tmp, "w", encoding="utf-8") as handle:
                handle.write(text)
            os.replace(tmp, path)
        except BaseException as error:  # a crash, an interrupt: no tmp file stays
            with contextlib.suppress(OSError):
                os.remove(tmp)
            if isinstance(error, OSError):
                raise unwritable_error(path, error) from error
            raise
        return path

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> History:
        """Read a log: standard JSON, a streamed log, or a cockpit-for-pytorch log.

        The format is detected from the first bytes: streamed logs (written while
        training with ``Cockpit(..., logpath=...)``, see :mod:`cockpit.log.stream`)
        are read record by record, merged per step, and a torn last record (the
        run was killed while writing it) is skipped with a warning. A streamed log
        with no record yet (the run stopped before its first tracked step) gives an
        empty history.

        Args:
            path: Path of the log. Without a ``.json``/``.jsonl`` suffix,
                ``<path>.json`` is meant, as in 1.0.2, then ``<path>.jsonl``, then the
                file ``path`` itself (see :func:`~cockpit.log.json_file.find_log`).

        Returns:
            The history.

        Raises:
            FileNotFoundError: If no log exists under any of these names.
            LogFileError: If the file is not a cockpit log (binary, not JSON,
                truncated JSON, JSON of another shape) or is a streamed log of a
                newer format version; the message names the file and the fix.
            OSError: If the file cannot be read.
        """
        path = find_log(path)
        with open(path, "rb") as handle:
            data = handle.read()
        if is_stream_data(data):
            return cls(parse_stream(path, data))
        return cls(parse_json_log(path, data))

    @classmethod
    def from_json_latest(
        cls, path: str | os.PathLike, upto: int | None = None
    ) -> History:
        """Read a log step by step, keeping of mappings only the latest per key.

        What a dashboard draws: every value that is not a mapping (numbers,
        per-parameter lists) and every estimate's description (``<key>_estimate``),
        but of other mappings (histograms) only the latest one of each key. The
        file is read one step (standard JSON) or one line (streamed log) at a
        time, so a log of any length is never held in memory at once.
        Files of an odd shape are read whole, as :meth:`from_json` reads them
        (raising its errors).

        Args:
            path: As :meth:`from_json` takes it.
            upto: Ignore steps after this one.

        Returns:
            The history (a torn last record of a streamed log is skipped with a
            warning, as by :meth:`from_json`).
        """
        found = find_log(path)
        caught: list = []
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                history = _read_latest(found, upto)
        except (_Fallback, ValueError, TypeError, KeyError):
            # anything odd: the whole-file reader says what is wrong, or reads it
            history = cls.from_json(found)
            if upto is not None:
                history = cls({s: history.view(s) for s in history.steps if s <= upto})
        else:
            for warning in caught:  # as raised while reading (CockpitWarning)
                warnings.warn_explicit(
                    warning.message, warning.category, warning.filename, warning.lineno
                )
        return history
