"""One run of ``cockpit serve``: its log read incrementally, kept in bounded memory.

A :class:`LiveRun` reads the bytes appended to its log since the last
:meth:`~LiveRun.poll` (whole lines only; a line still being written waits for the
next poll) through the stream reader of :mod:`cockpit.log.stream`
(:func:`~cockpit.log.stream.stream_records`: the header is checked, a damaged
line is skipped with its warning, a ``resume_after`` marker voids later steps).
A log written whole (``Cockpit.write``, a 1.0.2 log) is read with
:func:`cockpit.log.files.open_log` again when it changes.

What the page draws is kept, nothing else, in memory that does not grow with the
run:

* each series a gauge draws (the reductions of :mod:`cockpit.plotting.data`) in a
  :class:`Points`: every value up to :data:`LIVE_POINTS` points, then blocks are
  thinned to their smallest and largest value (spikes stay, as on the PNG), so
  a series never holds more than ``2 * LIVE_POINTS`` points;
* the step length ``Alpha`` as an even sample (its density is drawn, which
  extremes would bias);
* histograms at up to :data:`HIST_SNAPSHOTS` steps spread over the run (every
  k-th, k doubling when full) and the latest one;
* the live diagnosis (:class:`cockpit.diagnosis.LiveDiagnosis`: a few numbers per
  detector); when the run has ended, the report of the whole run
  (:func:`cockpit.diagnosis.diagnose`, read once from the file);
* one latest value per key (what :meth:`CockpitPlotter.layout` needs to choose
  the gauges).

:meth:`LiveRun.payload` answers the page: everything, or, given what the page
holds (``epoch`` and the number of points of each series), only the points
added since. Anything that is not an append (thinning, a resume marker, a log
replaced or truncated) starts a new ``epoch``, and the page then fetches the run
whole again.
"""

from __future__ import annotations

import math
import threading
import time
import warnings
from typing import Any, Iterator, Mapping

import numpy as np

from cockpit.log.format import decode
from cockpit.log.keys import (
    ESTIMATE_SUFFIX,
    LEARNING_RATES_KEY,
    MISSING_KEY,
    NONFINITE_KEY,
)
from cockpit.log.stream import stream_records
from cockpit.plotting.html import histogram_entry
from cockpit.serve.points import Points, Snapshots
from cockpit.serve.reading import READ_CHUNK, LogReading

#: Keys whose values are histograms the page shows over time.
HIST_KEYS = ("GradHist1d", "GradHist2d")


def _wanted() -> dict[str, tuple[str, ...]]:
    """``{key: reductions}`` of every series a gauge of the dashboard draws."""
    from cockpit.plotting.html import gauge_series
    from cockpit.plotting.instruments import GAUGES

    found: dict[str, list[str]] = {}
    for name in GAUGES:
        for key, reduce in gauge_series(name):
            found.setdefault(key, [])
            if reduce not in found[key]:
                found[key].append(reduce)
    found.setdefault("Alpha", [])  # its even sample (Points(sample=True))
    return {key: tuple(reduces) for key, reduces in found.items()}


_WANTED: dict[str, tuple[str, ...]] | None = None


def wanted() -> dict[str, tuple[str, ...]]:
    """:func:`_wanted`, computed once."""
    global _WANTED
    if _WANTED is None:
        _WANTED = _wanted()
    return _WANTED


class _Decoded(Mapping):
    """A record's values, decoded when read (the diagnosis reads a few keys)."""

    def __init__(self, raw: Mapping[str, Any], is_raw: bool):
        self.raw, self.is_raw = raw, is_raw

    def __getitem__(self, key: str) -> Any:
        value = self.raw[key]
        return decode(value) if self.is_raw else value

    def __contains__(self, key: object) -> bool:
        return key in self.raw

    def __iter__(self) -> Iterator[str]:
        return iter(self.raw)

    def __len__(self) -> int:
        return len(self.raw)


def _number(value: Any) -> Any:
    """A decoded number or list, or the value as stored (decoded if needed)."""
    if type(value) in (float, int):
        return value
    if type(value) is list and all(type(v) in (float, int) for v in value):
        return value
    return decode(value)


class LiveRun(LogReading):
    """A run's log, read as it grows (see the module docstring).

    Args:
        path: The log file (as found under a served path).
        rel: Its name relative to the served path (shown on the page).
        index: Its number on the page (the id the page asks for).
    """

    def __init__(self, path: str, rel: str, index: int):
        self.path, self.rel, self.index = path, rel, index
        self.lock = threading.Lock()
        self.error: str | None = None
        self.warning: str | None = None
        self.skipped = 0
        self.kind: str | None = None  # "stream" or "json"
        self.version = 0
        self.epoch = 0
        self.identity: tuple | None = None
        self.modified = 0.0
        self.writing: bool | None = None
        self.report: list | None = None
        self._json_seen: tuple | None = None
        self._stat_key: tuple | None = None
        self._error_seen: tuple | None = None
        self.previewed = False
        self._reset()

    # --- state -------------------------------------------------------------------
    def _reset(self) -> None:
        from cockpit.diagnosis import LiveDiagnosis

        self.offset = 0
        self.line = 0
        self.pending = b""
        self.header = False
        self.records = 0
        self.first_step: int | None = None
        self.last_step: int | None = None
        self.steps = 0
        self.series: dict[str, Points] = {}
        self.hists: dict[str, Snapshots] = {}
        self.latest: dict[str, tuple[int, Any]] = {}
        self.sketch: dict[str, Any] = {}
        self.missing: tuple[int, Any] | None = None
        self.nonfinite: list[list[int]] = []
        self._open_span = False  # the latest tracked step was not finite
        self.live = LiveDiagnosis(warn=False)
        self.diag_offset = 0  # bytes of the file the live diagnosis has read
        self.diag_line = 0
        self.diag_step: int | None = None
        self.wanted = False  # the page asked for this run: diagnose it first
        self.lr: list[float] | None = None
        self._batch: dict[str, tuple[list, list, list]] = {}
        self.coarse = False  # what is held is a preview (see PREVIEW_BYTES)
        self.report = None
        self.epoch += 1
        self.version += 1

    @property
    def status(self) -> str:
        """``"error"``, ``"reading"`` (nothing read), ``"live"`` or ``"finished"``."""
        if self.error is not None:
            return "error"
        if self.kind is None:
            return "reading"
        if self.kind == "json" or self.writing is False:
            return "finished"
        if self.writing is None and time.time() - self.modified > 120:
            return "finished"
        return "live"

    # --- one record --------------------------------------------------------------
    def _apply(self, step: int, values: Mapping[str, Any], raw: bool) -> None:
        step = int(step)
        self.records += 1
        marked = NONFINITE_KEY in values
        if self.last_step is None or step > self.last_step:
            self.steps += 1
            self.last_step = step
            if marked and self._open_span:
                self.nonfinite[-1][1] = step
            elif marked:
                self.nonfinite.append([step, step])
            self._open_span = marked
        elif marked and step == self.last_step and not self._open_span:
            self.nonfinite.append([step, step])
            self._open_span = True
        if self.first_step is None or step < self.first_step:
            self.first_step = step
        table = wanted()
        for key in values:
            if key in HIST_KEYS:
                self.latest[key] = (step, values)
                hists = self.hists.setdefault(key, Snapshots())
                entry = values[key]
                if not hists.offer(step, entry):
                    self.epoch += 1
                self.sketch[key] = (step, values)
                continue
            if key == MISSING_KEY:
                self.missing = (step, values)
                continue
            if key.endswith(ESTIMATE_SUFFIX):
                continue
            self.sketch[key] = (step, values)
            reduces = table.get(key)
            if key == LEARNING_RATES_KEY:
                self._rates(step, values[key])
            if reduces is None:
                continue
            batch = self._batch.get(key)
            if batch is None:
                batch = self._batch[key] = ([], [], [])
            batch[0].append(step)
            batch[1].append(values[key])
            batch[2].append(values.get(key + ESTIMATE_SUFFIX))

    def _flush(self) -> None:
        """Add the values collected since the last flush, key by key, at once."""
        from cockpit.plotting.data import estimate_error

        table = wanted()
        for key, (steps, raws, estimates) in self._batch.items():
            steps = np.asarray(steps, dtype=np.int64)
            rows = _rows(raws)
            reduces = table.get(key, ("scalar",))  # learning_rates#k: scalars
            for reduce in reduces + (("sample",) if key == "Alpha" else ()):
                how = "scalar" if reduce == "sample" else reduce
                numbers = _reduced(rows, raws, how)
                errors = np.full(len(steps), np.nan)
                for j, estimate in enumerate(estimates):
                    if estimate is not None:
                        errors[j] = estimate_error(decode(estimate), how)[0]
                name = key if "#" in key else f"{key}|{reduce}"
                self._extend(name, steps, numbers, errors, reduce == "sample")
        self._batch = {}

    def _extend(self, name, steps, numbers, errors, sample) -> None:
        keep = np.isfinite(numbers)
        steps, numbers, errors = steps[keep], numbers[keep], errors[keep]
        if not len(steps):
            return
        points = self.series.get(name)
        if points is None:
            points = self.series[name] = Points(sample=sample)
        last = points.last_step
        stride = points.stride
        if (last is None or steps[0] > last) and np.all(np.diff(steps) > 0):
            points.extend(steps, numbers, errors)
        else:  # a late or repeated step: one by one (rare)
            for step, number, error in zip(steps.tolist(), numbers.tolist(),
                                           errors.tolist()):  # fmt: skip
                self._point(name, step, number, error, sample)
        if points.stride != stride:
            self.epoch += 1

    def _point(self, name, step, number, error, sample=False) -> None:
        if not math.isfinite(number):
            return
        points = self.series.get(name)
        if points is None:
            points = self.series[name] = Points(sample=sample)
        stride = points.stride
        if not points.add(step, number, error if math.isfinite(error) else math.nan):
            self._insert(points, step, number, error)
        if points.stride != stride:
            self.epoch += 1

    def _insert(self, points: Points, step, number, error) -> None:
        """A value for an earlier step (rare): rebuild the series, new epoch."""
        steps = points.steps[: points.n].tolist() + [p[0] for p in points.tail]
        values = points.values[: points.n].tolist() + [p[1] for p in points.tail]
        pairs = dict(zip(steps, values))
        pairs[step] = number
        fresh = Points(points.limit, points.sample)
        for s in sorted(pairs):
            fresh.add(s, pairs[s])
        points.__dict__.update(fresh.__dict__)
        self.epoch += 1

    def _rates(self, step: int, value: Any) -> None:
        try:
            rates = [float(x) for x in np.asarray(decode(value), float).ravel()]
        except (TypeError, ValueError):
            return
        if self.lr is None:
            self.lr = rates
        for k, rate in enumerate(rates):
            batch = self._batch.get(f"{LEARNING_RATES_KEY}#{k}")
            if batch is None:
                batch = self._batch[f"{LEARNING_RATES_KEY}#{k}"] = ([], [], [])
            batch[0].append(step)
            batch[1].append(rate)
            batch[2].append(None)

    def _truncate(self, after: int) -> None:
        """A resume marker: steps after ``after`` are void."""
        for points in self.series.values():
            points.truncate(after)
        for snapshots in self.hists.values():
            snapshots.truncate(after)
        self.nonfinite = [[a, min(b, after)] for a, b in self.nonfinite if a <= after]
        for name in list(self.latest):
            if self.latest[name][0] > after:
                del self.latest[name]
        if self.last_step is not None and self.last_step > after:
            self.last_step = after
        self.epoch += 1

    # --- answers -----------------------------------------------------------------
    def summary(self) -> dict:
        """What the run list shows (small: sent for every run at every poll)."""
        return {
            "id": self.index,
            "path": self.rel,
            "status": self.status,
            "error": self.error,
            "warning": self.warning,
            "version": self.version,
            "epoch": self.epoch,
            "steps": self.steps,
            "first_step": self.first_step,
            "last_step": self.last_step,
            "coarse": self.coarse,
        }

    def sketch_history(self):
        """One step holding the latest value of every key (for the layout)."""
        from cockpit.history import History

        step = self.last_step if self.last_step is not None else 0
        values = {}
        for key, (_, where) in self.sketch.items():
            values[key] = _value(where, key)
        if self.missing is not None:
            values[MISSING_KEY] = _value(self.missing[1], MISSING_KEY)
        return History({step: values}) if values else History()

    def pending_bytes(self) -> int:
        """Bytes of the log not read yet (0 for a log read whole)."""
        if self.kind is None:
            return 1
        if self.kind != "stream" or self._stat_key is None:
            return 0
        if self.coarse:
            return 1
        return max(self._stat_key[1] - self.offset - len(self.pending), 0)

    def diagnose_some(self, most: int = 2000) -> bool:
        """Feed up to ``most`` more records to the live diagnosis; ``True``: more left.

        The diagnosis runs behind the reader (it costs about as much per step as
        in the training process), from the file, up to what the reader has read.
        A finished run is diagnosed whole instead (:meth:`run_report`).
        """
        with self.lock:
            if self.error is not None or self.kind != "stream" or self.report:
                return False
            start, end, first = self.diag_offset, self.offset, self.diag_line
            epoch = self.epoch
        if start >= end:
            return False
        with open(self.path, "rb") as handle:
            handle.seek(start)
            data = handle.read(min(end - start, READ_CHUNK))
        cut = data.rfind(b"\n") + 1
        pieces = data[:cut].split(b"\n")[:-1][:most]
        used = sum(len(p) + 1 for p in pieces)
        lines = ((first + 1 + i, raw, True) for i, raw in enumerate(pieces))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            found = [(step, values) for _, step, values in
                     stream_records(self.path, lines) if step is not None]  # fmt: skip
        with self.lock:
            if self.epoch != epoch and self.diag_offset != start:
                return True  # read again from the start
            for step, values in found:
                self.live.on_record(step, _Decoded(values, True))
                self.diag_step = step
            self.diag_offset = start + used
            self.diag_line = first + len(pieces)
            self.version += 1
            return self.diag_offset < self.offset

    def layer_count(self) -> int:
        """Per-parameter 2-D histograms in the latest ``GradHist2d`` (0: none)."""
        found = self.sketch.get("GradHist2d")
        if found is None:
            return 0
        value = found[1]["GradHist2d"]
        if not isinstance(value, Mapping):
            return 0
        return sum(1 for k in value if k.startswith("param_") and k[6:].isdigit())

    def findings(self) -> tuple[str, list[dict]]:
        """``("report" | "live", findings as dicts)``."""
        if self.report is not None:
            return "report", self.report
        return "live", [f.to_dict() for f in self.live.findings]

    @property
    def diagnosed(self) -> int | None:
        """The last step the diagnosis has read (the last step with a report)."""
        return self.last_step if self.report is not None else self.diag_step

    def run_report(self) -> None:
        """Diagnose the whole (finished) run once, from its file."""
        from cockpit.diagnosis import diagnose

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            found = [f.to_dict() for f in diagnose(self.path)]
        with self.lock:
            self.report = found
            self.version += 1

    def payload(self, epoch: int | None = None, have: Mapping | None = None) -> dict:
        """The run's data for the page: whole, or what was added since.

        Args:
            epoch: The epoch the page holds (another one: everything is sent).
            have: ``{series name: points held}`` of that epoch.
        """
        with self.lock:
            self.wanted = True
            whole = epoch != self.epoch or have is None
            have = {} if whole else have
            series = {}
            for name, points in self.series.items():
                start = int(have.get(name, 0) or 0)
                if whole or start < points.n or points.tail or start > points.n:
                    series[name] = points.part(0 if whole else start)
            hists = {}
            for key, snaps in self.hists.items():
                start = 0 if whole else int(have.get("hist:" + key, 0) or 0)
                if whole or start < len(snaps.items):
                    hists[key] = {"from": start, "items": snaps.items[start:]}
            latest = {}
            for key, (step, where) in self.latest.items():
                entry = histogram_entry(step, _value(where, key))
                if entry is None:
                    continue
                if key == "GradHist2d":
                    layers = {"all": entry}
                    value = decode(_value(where, key))
                    for name, part in value.items():
                        if name.startswith("param_"):
                            found = histogram_entry(step, part)
                            if found is not None:
                                layers[name] = found
                    entry = layers
                latest[key] = entry
            kind, findings = self.findings()
            return {
                **self.summary(),
                "whole": whole,
                "series": series,
                "hists": hists,
                "latest": latest,
                "nonfinite": [list(span) for span in self.nonfinite],
                "findings": findings,
                "diagnosis": kind,
                "diagnosed": self.diagnosed,
                "config": self.config(),
            }

    def config(self) -> dict:
        """What the log says about the run's set-up (shown side by side)."""
        from cockpit.plotting.html import run_config

        name = self.rel.rsplit(".", 1)[0]
        return run_config(name, list(self.sketch), self.lr)

    def nbytes(self) -> int:
        """About the memory this run holds (its series and histograms)."""
        total = sum(p.nbytes() for p in self.series.values())
        return total + sum(s.nbytes() for s in self.hists.values())


def _rows(raws: list) -> np.ndarray | None:
    """The values of a key as a float array (a row per step), if they are plain."""
    try:
        rows = np.asarray(raws, dtype=np.float64)
    except (TypeError, ValueError):  # encoded NaN, ragged lists, strings
        return None
    return rows if rows.ndim in (1, 2) else None


def _reduced(rows: np.ndarray | None, raws: list, reduce: str) -> np.ndarray:
    """One number per step, as :data:`cockpit.plotting.data.REDUCERS` gives it."""
    from cockpit.plotting.data import REDUCERS

    if rows is None:
        return np.array([REDUCERS[reduce](_number(v)) for v in raws], dtype=float)
    if rows.ndim == 1:
        return np.abs(rows) if reduce == "norm" else rows
    if reduce == "scalar":
        return rows[:, 0] if rows.shape[1] == 1 else np.full(len(rows), np.nan)
    if not rows.shape[1]:
        return np.full(len(rows), np.nan)
    if reduce == "norm":
        return np.sqrt(np.einsum("ij,ij->i", rows, rows))
    return rows.sum(axis=1)


def _value(where: Any, key: str) -> Any:
    value = where[key]
    return decode(value) if isinstance(value, (dict, list)) else value
