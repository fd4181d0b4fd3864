"""Reading a log of any length: numbers in compact columns, histograms from the file.

:func:`read_log_history` reads a log (streamed, written, or cockpit-for-pytorch
1.0.2's) in one pass into a :class:`LogHistory`, the :class:`~cockpit.history.History`
that every command gets from :func:`cockpit.log.files.open_log`. What a long run
logs is mostly numbers at every step (losses, per-parameter norms) and mappings
(histograms) that a reader needs at a few steps only, so:

* numbers, and lists of numbers of one length (per-parameter values), are kept in
  typed columns: 8 bytes per number, whatever the number of steps, instead of a
  dict and boxed floats per step (about 20 times less memory);
* mappings (histograms, ``missing`` reasons) are not kept: the file offsets of the
  records that hold them are, and a mapping is read again from the file when a
  reader asks for it (``view(step)[key]``), one step at a time. With
  ``mappings="latest"`` only the latest mapping of each key exists, as
  :meth:`~cockpit.history.History.from_json_latest` has always read for drawing;
* values that are neither (strings, ragged lists, ``None``) are kept as they are
  (they are rare).

The history answers every question a :class:`~cockpit.history.History` answers,
with the same values (read-only: :meth:`LogHistory.add` turns it into an ordinary
history first). Streamed logs are merged as :func:`~cockpit.log.stream.parse_stream`
merges them: records for a step are joined, later values win, and a ``resume_after``
marker voids the records before it for later steps. Memory is about 8 bytes per
number plus 8 bytes per record, time one pass over the file (and one read of each
record whose mappings are asked for).

Nothing here imports torch or BackPACK.
"""

from __future__ import annotations

import json
import os
import warnings
import weakref
from array import array
from typing import Any, Iterator, Mapping

import numpy as np

from cockpit.errors import CockpitWarning, LogFileError
from cockpit.history import History
from cockpit.log.format import COMPACT_MIN_SIZE, compact, decode, expand
from cockpit.log.json_file import NotStreamable, is_tagged, json_log_steps
from cockpit.log.keys import ESTIMATE_SUFFIX
from cockpit.log.stream import STREAM_MAGIC, is_stream_data, stream_records

__all__ = ["LogHistory", "read_log_history"]

#: The policies for mappings: every one (read back from the file when asked for),
#: or only the latest of each key (what a dashboard draws).
MAPPINGS = ("all", "latest")


class _NotColumnar(Exception):
    """A log that is read whole instead.

    An odd file: the whole-file reader says what is wrong with it.
    """


def _is_mapping_value(key: str, raw: Any) -> bool:
    """Whether a value as written is a mapping that is read back lazily."""
    return (
        isinstance(raw, dict)
        and not is_tagged(raw)
        and not key.endswith(ESTIMATE_SUFFIX)
    )


class _Column:
    """The values of one key, as they come: typed while they fit one type.

    ``kind`` is ``"float"``, ``"int"`` (one number per step), ``"floats"`` /
    ``"ints"`` (a list of ``width`` numbers per step) or ``"object"`` (anything,
    kept as :func:`~cockpit.log.format.compact` stores it).
    """

    def __init__(self):
        self.kind: str | None = None
        self.width = 0
        self.records = array("q")  # the record (sequence number) of each value
        self.steps = array("q")
        self.numbers: array | None = None
        self.objects: list | None = None

    def __len__(self) -> int:
        return len(self.steps)

    def add(self, record: int, step: int, value: Any) -> None:
        kind, width = _kind(value)
        if self.kind is None:
            self.kind, self.width = kind, width
            if kind == "object":
                self.objects = []
            else:
                self.numbers = array("d" if kind.startswith("float") else "q")
        elif kind != self.kind or width != self.width:
            self._to_objects()
        if self.kind == "object":
            self.objects.append(compact(value))
        elif self.width:
            self.numbers.extend(value)
        else:
            self.numbers.append(value)
        self.records.append(record)
        self.steps.append(step)

    def _to_objects(self) -> None:
        """From here on, keep values as they are (the values so far included)."""
        if self.kind == "object":
            return
        values = self.numbers.tolist()
        if self.width:
            w = self.width
            values = [values[i : i + w] for i in range(0, len(values), w)]
        self.objects = [compact(v) for v in values]
        self.kind, self.width, self.numbers = "object", 0, None


def _kind(value: Any) -> tuple[str, int]:
    """How a decoded value is kept: ``(kind, width)`` (see :class:`_Column`)."""
    kind = type(value)
    if kind is float:
        return "float", 0
    if kind is int and -(2**63) <= value < 2**63:
        return "int", 0
    if kind is list and value:
        first = type(value[0])
        if first is float or first is int:
            if all(type(v) is first for v in value):
                if first is float:
                    return "floats", len(value)
                if all(-(2**63) <= v < 2**63 for v in value):
                    return "ints", len(value)
    return "object", 0


class _Stored:
    """One key after reading: sorted steps and their values."""

    __slots__ = ("kind", "objects", "steps", "values", "width")

    def __init__(self, kind, width, steps, values=None, objects=None):
        self.kind, self.width, self.steps = kind, width, steps
        self.values, self.objects = values, objects

    def value(self, index: int) -> Any:
        """The value of entry ``index``, as a history stores it."""
        if self.kind == "object":
            return self.objects[index]
        if not self.width:
            return self.values[index].item()
        row = self.values[index]
        if self.width < COMPACT_MIN_SIZE:
            return row.tolist()
        return row  # a read-only view, as compact() keeps large arrays

    def nbytes(self, shared: np.ndarray) -> int:
        total = 0 if self.steps is shared else self.steps.nbytes
        if self.values is not None:
            total += self.values.nbytes
        return total


def _valid(records: np.ndarray, steps: np.ndarray, markers) -> np.ndarray:
    """Which entries no later ``resume_after`` marker voids (as parse_stream does)."""
    keep = np.ones(len(records), dtype=bool)
    if not markers:
        return keep
    at = np.array([m[0] for m in markers], dtype=np.int64)
    after = np.array([m[1] for m in markers], dtype=np.int64)
    order = np.argsort(at, kind="stable")
    at, after = at[order], after[order]
    suffix = np.minimum.accumulate(after[::-1])[::-1]  # min of later markers' after
    first_later = np.searchsorted(at, records, side="right")
    limited = first_later < len(at)
    keep[limited] = steps[limited] <= suffix[first_later[limited]]
    return keep


def _latest_per_step(records: np.ndarray, steps: np.ndarray, keep: np.ndarray):
    """Indices of the kept entries, sorted by step, the last record per step only."""
    index = np.flatnonzero(keep)
    if not len(index):
        return index
    order = np.lexsort((records[index], steps[index]))
    index = index[order]
    ordered = steps[index]
    last = np.ones(len(index), dtype=bool)
    last[:-1] = ordered[1:] != ordered[:-1]
    return index[last]


class _Reader:
    """One pass over a log file, into columns and a record index."""

    def __init__(self, path: str, mappings: str, upto: int | None):
        self.path, self.mappings, self.upto = path, mappings, upto
        self.columns: dict[str, _Column] = {}
        self.lazy: dict[str, tuple[array, array]] = {}  # key -> (records, steps)
        self.record_steps = array("q")
        self.record_spans = array("q")  # offset and length of each record
        self.markers: list[tuple[int, int]] = []  # (record, after)
        self.stream = False
        self.handle = None

    def read(self) -> None:
        """Read the file, and keep it open in :attr:`handle`.

        Records are read again from this very file, whatever happens to the path.
        """
        self.handle = handle = open(self.path, "rb")  # noqa: SIM115
        try:
            self.stream = is_stream_data(handle.read(len(STREAM_MAGIC) + 1))
            handle.seek(0)
            if self.stream:
                self._read_stream(handle)
            else:
                self._read_json(handle)
        except BaseException:
            handle.close()
            raise

    def _read_stream(self, handle) -> None:
        offsets = array("q")

        def lines() -> Iterator[tuple[int, bytes, bool]]:
            offset = 0
            for number, raw in enumerate(handle, start=1):
                offsets.append(offset)
                offset += len(raw)
                yield number, raw, raw.endswith(b"\n")

        for number, step, values in stream_records(self.path, lines()):
            record = len(self.record_steps)
            if step is None:  # a resume marker: ``values`` is the last step kept
                self.markers.append((record, values))
                self.record_steps.append(-1)
                self.record_spans.extend((0, 0))
                continue
            start = offsets[number - 1]
            end = offsets[number] if number < len(offsets) else handle.tell()
            self.record_steps.append(step)
            self.record_spans.extend((start, end - start))
            if self.upto is None or step <= self.upto:
                self._add(record, step, values)

    def _read_json(self, handle) -> None:
        spans: list = []
        try:
            for step, entries in json_log_steps(handle, spans=spans):
                record = len(self.record_steps)
                span = spans[-1]
                if span is None:  # not ASCII: offsets of text are not of bytes
                    raise _NotColumnar
                self.record_steps.append(step)
                self.record_spans.extend((span[0], span[1] - span[0]))
                if self.upto is None or step <= self.upto:
                    self._add(record, step, entries)
        except NotStreamable as error:
            raise _NotColumnar from error

    def _add(self, record: int, step: int, values: Mapping[str, Any]) -> None:
        for key, raw in values.items():
            if _is_mapping_value(key, raw):
                records, steps = self.lazy.setdefault(key, (array("q"), array("q")))
                records.append(record)
                steps.append(step)
                continue
            value = raw if type(raw) in (float, int, str) else decode(raw)
            column = self.columns.get(key)
            if column is None:
                column = self.columns[key] = _Column()
            column.add(record, step, value)


class LogHistory(History):
    """A history read from a log file: numbers in columns, mappings on demand.

    Made by :func:`read_log_history` (:func:`cockpit.log.files.open_log` returns
    one). It reads like any :class:`~cockpit.history.History`; the first call of a
    writing method (:meth:`add`, :meth:`update`, :meth:`load_state_dict`) turns
    it into an ordinary one, holding every value in memory.
    """

    def __init__(self):  # made by read_log_history only
        super().__init__()
        self.path: str | None = None
        self.mappings = "all"
        self._stored: dict[str, _Stored] = {}
        self._lazy: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # key: steps, recs
        self._all_steps = np.empty(0, dtype=np.int64)
        self._rows: dict[str, np.ndarray | None] = {}  # key -> entry per step, or -1
        self._key_order: list[str] = []
        self._spans = np.empty((0, 2), dtype=np.int64)
        self._record_steps = np.empty(0, dtype=np.int64)
        self._stream = False
        self._steps_list: list[int] | None = None
        self._cache: tuple | None = None  # the last record read: (record, raw, decoded)
        self._handle = None  # the file read, open: its mappings are read back
        self._data = _Rows(self)

    # --- building ------------------------------------------------------------------
    @classmethod
    def _build(cls, reader: _Reader) -> LogHistory:
        history = cls()
        history.path, history.mappings = reader.path, reader.mappings
        history._handle = reader.handle
        weakref.finalize(history, reader.handle.close)
        history._stream = reader.stream
        history._record_steps = np.frombuffer(reader.record_steps, dtype=np.int64)
        history._spans = np.frombuffer(reader.record_spans, dtype=np.int64).reshape(
            -1, 2
        )
        markers = reader.markers
        record_steps = np.frombuffer(reader.record_steps, dtype=np.int64)
        all_records = np.arange(len(record_steps), dtype=np.int64)
        steps_everywhere = [np.empty(0, dtype=np.int64)]
        if reader.mappings == "latest":  # every record's step counts, as it did in
            # from_json_latest (a step whose mappings were all dropped stays a step)
            seen = _valid(all_records, record_steps, markers) & (record_steps >= 0)
            if reader.upto is not None:
                seen &= record_steps <= reader.upto
            steps_everywhere.append(record_steps[seen])
        for key, column in reader.columns.items():
            records = np.frombuffer(column.records, dtype=np.int64)
            steps = np.frombuffer(column.steps, dtype=np.int64)
            index = _latest_per_step(records, steps, _valid(records, steps, markers))
            history._stored[key] = _stored(column, index, steps)
            column.records = None  # (its buffer is no longer needed)
            history._key_order.append(key)
            steps_everywhere.append(history._stored[key].steps)
        latest: dict[str, tuple[int, int]] = {}
        for key, (records, steps) in reader.lazy.items():
            records = np.frombuffer(records, dtype=np.int64)
            steps = np.frombuffer(steps, dtype=np.int64)
            index = _latest_per_step(records, steps, _valid(records, steps, markers))
            if not len(index):
                continue
            if reader.mappings == "latest":
                latest[key] = (int(steps[index[-1]]), int(records[index[-1]]))
                continue
            history._lazy[key] = (steps[index].copy(), records[index].copy())
            history._key_order.append(key)
            steps_everywhere.append(history._lazy[key][0])
        all_steps = np.unique(np.concatenate(steps_everywhere))
        history._all_steps = all_steps
        for key, found in latest.items():  # read now: one mapping per key
            step, record = found
            value = compact(decode(history._load_record(record)[key]))
            history._stored[key] = _Stored(
                "object", 0, np.array([step], dtype=np.int64), objects=[value]
            )
            history._key_order.append(key)
        for key, stored in history._stored.items():
            if np.array_equal(stored.steps, all_steps):  # at every step: share them
                stored.steps = all_steps
            history._rows[key] = _rows(all_steps, stored.steps)
        for key, (steps, records) in history._lazy.items():
            if np.array_equal(steps, all_steps):
                history._lazy[key] = (all_steps, records)
            history._rows[key] = _rows(all_steps, history._lazy[key][0])
        return history

    # --- reading mappings back -------------------------------------------------------
    def _load_record(self, record: int) -> dict[str, Any]:
        """The values of one record of the file, as written (not decoded).

        Raises:
            LogFileError: If the record is not there any more: a new run has
                started writing the log since it was read (a stream is rewritten
                in place; appended records, a removed file or one replaced by
                ``Cockpit.write`` leave what was read as it was).
        """
        offset, length = (int(x) for x in self._spans[record])
        self._handle.seek(offset)  # the file read (kept open until dropped)
        text = self._handle.read(length)
        try:
            raw = json.loads(text)
            if self._stream and raw.get("step") != int(self._record_steps[record]):
                raise ValueError("another record")
            raw = raw["values"] if self._stream else raw
            if not isinstance(raw, dict):
                raise ValueError("not a record")
        except (ValueError, KeyError, AttributeError):
            raise LogFileError(
                self.path,
                "changed while it was read: a new run started writing it (the "
                "records read before are not where they were). Fix: read it "
                "again, or copy the log and read the copy while the run writes.",
            ) from None
        return raw

    def _mapping(self, key: str, index: int) -> Any:
        """The mapping ``key`` of its entry ``index``, read from the file.

        The record read last is kept (the other mappings of a step are usually in
        the same record), and each value is decoded when first asked for.
        """
        record = int(self._lazy[key][1][index])
        if self._cache is None or self._cache[0] != record:
            self._cache = (record, self._load_record(record), {})
        _, raw, decoded = self._cache
        if key not in decoded:
            try:
                decoded[key] = compact(decode(raw[key]))
            except (ValueError, TypeError, KeyError) as error:  # a damaged value
                step = int(self._lazy[key][0][index])
                warnings.warn(
                    f"Skipped {key} at step {step} of the cockpit log {self.path!r}: "
                    f"its value cannot be read ({error}). The other values are read.",
                    CockpitWarning,
                    stacklevel=4,
                )
                decoded[key] = None
        return decoded[key]

    # --- the history's reading methods -------------------------------------------
    def _position(self, global_step: int) -> int:
        step = int(global_step)
        position = int(np.searchsorted(self._all_steps, step))
        if position >= len(self._all_steps) or self._all_steps[position] != step:
            raise KeyError(global_step)
        return position

    def _here(self, position: int) -> list[tuple[str, int]]:
        """``(key, entry)`` of every key at the step at ``position``, in log order."""
        found = []
        for key in self._key_order:
            rows = self._rows[key]
            if rows is None:  # at every step
                found.append((key, position))
                continue
            index = int(rows[position])
            if index >= 0:
                found.append((key, index))
        return found

    def _value(self, key: str, index: int) -> Any:
        stored = self._stored.get(key)
        if stored is not None:
            return stored.value(index)
        return self._mapping(key, index)

    def _entries(self, position: int) -> dict[str, Any]:
        """The entries of the step at ``position``, in the log's key order."""
        return {key: self._value(key, index) for key, index in self._here(position)}

    def __len__(self) -> int:
        return len(self._all_steps)

    def __contains__(self, global_step: int) -> bool:
        try:
            self._position(global_step)
        except KeyError:
            return False
        return True

    def __getitem__(self, global_step: int) -> dict[str, Any]:
        return expand(self._entries(self._position(global_step)))

    def __iter__(self) -> Iterator[int]:
        return iter(self.steps)

    def view(self, global_step: int) -> Mapping[str, Any]:
        """One step's entries as stored (read-only; see :meth:`History.view`).

        A mapping is read from the file when its key is first looked up.
        """
        return _StepView(self, self._here(self._position(global_step)))

    def missing_at(self, global_step: int) -> Mapping[str, str] | None:
        """The ``missing`` entries of ``global_step`` (``None``: no such step)."""
        try:
            return self.view(global_step).get("missing")
        except KeyError:
            return None

    def items(self) -> Iterator[tuple[int, dict[str, Any]]]:
        """Iterate over ``(step, {key: value})`` in step order (read as it goes)."""
        for position in range(len(self._all_steps)):
            yield int(self._all_steps[position]), expand(self._entries(position))

    @property
    def steps(self) -> list[int]:
        """All steps that hold at least one value, in order."""
        if self._steps_list is None:
            self._steps_list = self._all_steps.tolist()
        return self._steps_list

    @property
    def keys(self) -> list[str]:
        """All quantity keys that occur, sorted."""
        return sorted(self._key_order)

    def series(self, key: str) -> tuple[list[int], list[Any]]:
        """Return the steps at which ``key`` was recorded and its values there."""
        steps, values = self.stored_series(key)
        return steps, [expand(v) for v in values]

    def stored_series(
        self, key: str, first: int | None = None, last: int | None = None
    ) -> tuple[list[int], list[Any]]:
        """Like :meth:`History.stored_series` (values as stored)."""
        steps = self._key_steps(key)
        lo = 0 if first is None else int(np.searchsorted(steps, first, "left"))
        hi = len(steps) if last is None else int(np.searchsorted(steps, last, "right"))
        stored = self._stored.get(key)
        if stored is not None:
            values = [stored.value(i) for i in range(lo, hi)]
        else:
            values = [self._mapping(key, i) for i in range(lo, hi)]
        return steps[lo:hi].tolist(), values

    def _key_steps(self, key: str) -> np.ndarray:
        if key in self._stored:
            return self._stored[key].steps
        if key in self._lazy:
            return self._lazy[key][0]
        return np.empty(0, dtype=np.int64)

    # --- what readers use instead of stepping through the history -----------------
    def column(self, key: str) -> tuple[np.ndarray, np.ndarray] | None:
        """``(steps, values)`` of a numeric key as arrays, or ``None``.

        ``values`` is 1-D (one number per step) or 2-D (a list of numbers of one
        length per step: a row per step), read-only. ``None`` for keys whose
        values are not all numbers or lists of one length.
        """
        stored = self._stored.get(key)
        if stored is None or stored.kind == "object":
            return None
        return stored.steps, stored.values

    def latest_mapping(self, key: str, upto: int | None = None):
        """``(step, value)`` of the last mapping of ``key`` (at or before ``upto``).

        ``None`` if there is none.
        """
        steps = self._key_steps(key)
        if not len(steps):
            return None
        end = len(steps) if upto is None else int(np.searchsorted(steps, upto, "right"))
        for index in range(end - 1, -1, -1):
            step = int(steps[index])
            stored = self._stored.get(key)
            value = stored.value(index) if stored else self._mapping(key, index)
            if isinstance(value, Mapping):
                return step, value
        return None

    def entry_count(self) -> int:
        """The number of ``(step, key)`` entries."""
        counts = [len(s.steps) for s in self._stored.values()]
        return sum(counts) + sum(len(steps) for steps, _ in self._lazy.values())

    def mapping_keys(self) -> list[str]:
        """Keys whose values are mappings read back from the file (or kept latest)."""
        keys = list(self._lazy)
        keys += [k for k, s in self._stored.items() if s.kind == "object"]
        return keys

    def memory_bytes(self) -> int:
        """The memory of the columns, the index and the kept objects (estimate)."""
        total = self._all_steps.nbytes + self._spans.nbytes + self._record_steps.nbytes
        total += sum(rows.nbytes for rows in self._rows.values() if rows is not None)
        total += sum(s.nbytes(self._all_steps) for s in self._stored.values())
        for steps, records in self._lazy.values():
            total += records.nbytes + (0 if steps is self._all_steps else steps.nbytes)
        objects = [s.objects for s in self._stored.values() if s.objects is not None]
        total += History({0: {"o": [v for o in objects for v in o]}}).memory_bytes()
        return total

    @property
    def revision(self) -> int:
        """Constant until a value is added (the log is read once)."""
        return self._revision

    # --- writing: an ordinary history from here on ----------------------------------
    def _thaw(self) -> None:
        data = {int(self._all_steps[p]): self._entries(p) for p in range(len(self))}
        if self._handle is not None:
            self._handle.close()
        state = {"_data": data, "_revision": self._revision + 1}
        self.__dict__.clear()
        self.__dict__.update(state)
        self.__class__ = History

    def add(self, global_step: int, key: str, value: Any) -> None:
        """Store a value (the history holds every value in memory from now on)."""
        self._thaw()
        History.add(self, global_step, key, value)

    def update(self, other) -> None:
        """Merge another history (see :meth:`add`)."""
        self._thaw()
        History.update(self, other)

    def load_state_dict(self, state) -> None:
        """Replace the content (see :meth:`add`)."""
        self._thaw()
        History.load_state_dict(self, state)

    def state_dict(self) -> dict[int, dict[str, Any]]:
        """The content for a checkpoint (every value in memory; see History)."""
        return History({s: v for s, v in self._data.items()}).state_dict()

    def to_output(self):
        """As :meth:`History.to_output`."""
        return History(dict(self._data.items())).to_output()

    def write_json(self, path, legacy: bool = False, packed: bool = True) -> str:
        """As :meth:`History.write_json` (every value in memory while writing)."""
        return History(dict(self._data.items())).write_json(path, legacy, packed)


class _StepView(Mapping):
    """One step of a :class:`LogHistory`: values looked up when asked for."""

    __slots__ = ("_history", "_index")

    def __init__(self, history: LogHistory, found: list[tuple[str, int]]):
        self._history = history
        self._index = dict(found)

    def __getitem__(self, key: str) -> Any:
        return self._history._value(key, self._index[key])

    def __contains__(self, key: object) -> bool:
        return key in self._index

    def __iter__(self):
        return iter(self._index)

    def __len__(self) -> int:
        return len(self._index)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({dict(self)!r})"


class _Rows(Mapping):
    """``{step: entries}`` of a :class:`LogHistory`, read as asked (its ``_data``)."""

    def __init__(self, history: LogHistory):
        self._history = history

    def __getitem__(self, step):
        history = self._history
        return history._entries(history._position(step))

    def __iter__(self):
        return iter(self._history.steps)

    def __len__(self):
        return len(self._history)


def _stored(column: _Column, index: np.ndarray, steps: np.ndarray) -> _Stored:
    """The kept entries ``index`` of a column, sorted by step.

    Where every entry is kept in the order read (a log without resumes or values
    written twice), the arrays read are used as they are, not copied.
    """
    whole = len(index) == len(steps) and bool(
        np.array_equal(index, np.arange(len(steps)))
    )
    kept_steps = steps if whole else steps[index].copy()
    if column.kind == "object":
        objects = column.objects if whole else [column.objects[i] for i in index]
        return _Stored("object", 0, kept_steps, objects=objects)
    dtype = np.float64 if column.kind.startswith("float") else np.int64
    numbers = np.frombuffer(column.numbers, dtype=dtype)
    if column.width:
        numbers = numbers.reshape(-1, column.width)
    values = numbers if whole else numbers[index].copy()
    values.flags.writeable = False
    return _Stored(column.kind, column.width, kept_steps, values=values)


def _rows(all_steps: np.ndarray, steps: np.ndarray) -> np.ndarray | None:
    """For every step of the log: the entry of a key there, or -1.

    ``None`` for a key at every step (its entry is the step's position).
    """
    if steps is all_steps:
        return None
    rows = np.full(
        len(all_steps), -1, dtype=np.int32 if len(steps) < 2**31 else np.int64
    )
    rows[np.searchsorted(all_steps, steps)] = np.arange(len(steps))
    return rows


def read_log_history(
    path: str, mappings: str = "all", upto: int | None = None
) -> History:
    """Read a log file into a :class:`LogHistory` (one pass).

    Args:
        path: The log file (see :func:`cockpit.log.json_file.find_log`).
        mappings: ``"all"``: every mapping can be read (back from the file, when
            asked for); ``"latest"``: only the latest of each key exists.
        upto: Ignore steps after this one.

    Returns:
        The history. A file of an odd shape is read whole
        (:meth:`History.from_json`, which raises its errors).

    Raises:
        LogFileError: As :meth:`History.from_json` raises it.
        OSError: If the file cannot be read.
    """
    if mappings not in MAPPINGS:
        raise ValueError(f"mappings must be one of {MAPPINGS}, got {mappings!r}.")
    path = os.fspath(path)
    reader = _Reader(path, mappings, upto)
    try:
        reader.read()
    except (_NotColumnar, ValueError, TypeError, KeyError):
        if reader.handle is not None:
            reader.handle.close()
        # an odd file: the whole-file readers say what is wrong, or read it
        if mappings == "latest":
            return History.from_json_latest(path, upto)
        history = History.from_json(path)
        if upto is not None:
            history = History({s: history.view(s) for s in history.steps if s <= upto})
        return history
    return LogHistory._build(reader)
