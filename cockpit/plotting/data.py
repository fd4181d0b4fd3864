"""The dashboard's view of a history: series that grow with the run.

:class:`DashboardData` turns a :class:`~cockpit.history.History` into the arrays the
gauges draw (one value per step, reduced over parameters where needed, plus an
exponential moving average). It remembers how far it has read: :meth:`refresh` reads
only the steps added since the last call (and the last step seen before, which a
two-step quantity such as ``Alpha`` fills in one step late), so keeping a live
dashboard up to date costs time proportional to the new data. Gauges draw at most
:data:`MAX_POINTS` points per series (:func:`extremes_index` keeps each stretch's
extremes), so drawing does not grow with the run either.

Estimated values (a step with ``<key>_estimate``, see
:data:`cockpit.log.keys.ESTIMATE_SUFFIX`) carry their standard error along: a
series holds, next to each value, the standard error of the reduced value (NaN
where it is exact; :func:`estimate_error`), which :meth:`Series.view_errors` thins
with the values.
"""

from __future__ import annotations

import math
import os
from bisect import bisect_left
from typing import Any, Callable, Mapping

import numpy as np

from cockpit.history import History
from cockpit.log.files import locate_log, open_log
from cockpit.log.keys import ESTIMATE_SUFFIX

#: Number of neighbouring points of the trend line's local fits (see :func:`trend`):
#: about the smoothing of the exponential moving average of cockpit-for-pytorch
#: (``alpha = 0.2``, a span of 9 points), but centred, so it does not lag.
TREND_POINTS = 9

#: Upper bound on the number of points a gauge draws per series; longer series are
#: thinned to the extremes of power-of-two blocks (so the kept points do not jump
#: around while the run grows; see :func:`extremes_index`); the last point is
#: always drawn.
MAX_POINTS = 2000


def _to_float(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def _flat(value: Any) -> np.ndarray | None:
    """A list/array of numbers as a flat float array (``None`` if it is not one)."""
    try:
        return np.asarray(value, dtype=np.float64).ravel()
    except (TypeError, ValueError):  # ragged or non-numeric
        return None


def _scalar(value: Any) -> float:
    """A number as float; a one-element list as its element; else NaN."""
    if isinstance(value, (list, tuple, np.ndarray)):
        flat = _flat(value)
        return float(flat[0]) if flat is not None and flat.size == 1 else math.nan
    return _to_float(value)


def _norm(value: Any) -> float:
    """Root of the sum of squares over parameters (a number is its own norm)."""
    if isinstance(value, (list, tuple, np.ndarray)):
        flat = _flat(value)
        if flat is None or flat.size == 0:
            return math.nan
        return float(np.sqrt(np.dot(flat, flat)))
    return abs(_to_float(value))


def _sum(value: Any) -> float:
    """Sum over parameters (a number is its own sum)."""
    if isinstance(value, (list, tuple, np.ndarray)):
        flat = _flat(value)
        if flat is None or flat.size == 0:
            return math.nan
        return float(np.sum(flat))
    return _to_float(value)


def _entries(history: History, step: int) -> Mapping[str, Any]:
    """The entries of one step, read-only and uncopied (see ``History.view``)."""
    return history.view(step)


#: How a per-step value becomes one number: ``"scalar"`` (floats), ``"norm"``
#: (per-parameter norms combined to the norm of the whole vector) or ``"sum"``
#: (per-parameter traces summed).
REDUCERS: dict[str, Callable[[Any], float]] = {
    "scalar": _scalar,
    "norm": _norm,
    "sum": _sum,
}


def estimate_error(estimate: Any, reduce: str) -> tuple[float, bool]:
    """The standard error of a reduced estimated value, from its description.

    Args:
        estimate: The step's ``<key>_estimate`` entry (``None`` where the value is
            exact).
        reduce: How the value is reduced (see :data:`REDUCERS`).

    Returns:
        The standard error (NaN if the value is exact, or its reduction has none:
        ``"norm"``), and whether it is only an upper bound. For ``"sum"`` it is
        the entry's ``"stderr_sum"``; a log written before that existed gives the
        sum of the per-parameter errors instead, an upper bound (the standard
        deviation of a sum is at most the sum of the standard deviations, however
        the parameters' errors are correlated). For ``"scalar"``, the error of a
        single value.
    """
    if not isinstance(estimate, Mapping):
        return math.nan, False
    if reduce == "sum":
        total = estimate.get("stderr_sum")
        if total is not None:
            return _to_float(total), False
        flat = _flat(estimate.get("stderr"))
        if flat is None or flat.size == 0:
            return math.nan, False
        return float(np.sum(flat)), flat.size > 1
    if reduce == "scalar":
        return _scalar(estimate.get("stderr")), False
    return math.nan, False


class Series:
    """One quantity as growing arrays of steps and values.

    Non-finite values are kept in :attr:`values` (so steps line up) but skipped by
    :meth:`view` and by its trend line. :attr:`errors` holds the standard error of
    each estimated value (NaN for exact ones).
    """

    def __init__(self) -> None:
        self._steps = np.empty(64, dtype=np.int64)
        self._values = np.empty(64, dtype=np.float64)
        self._errors = np.empty(64, dtype=np.float64)
        self._n = 0
        #: Whether some error is only an upper bound (see :func:`estimate_error`).
        self.error_bound = False
        #: The curvatures its estimates say they used (``{"ggn"}``: the GGN stood
        #: in for the Hessian, see :mod:`cockpit.curvature.source`).
        self.curvatures: set[str] = set()

    def note_estimate(self, estimate: Any) -> None:
        """Keep the curvature an estimate description names, if any."""
        if isinstance(estimate, Mapping) and isinstance(estimate.get("curvature"), str):
            self.curvatures.add(estimate["curvature"])

    def __len__(self) -> int:
        return self._n

    @property
    def steps(self) -> np.ndarray:
        """Steps with a value, increasing (a view, do not modify)."""
        return self._steps[: self._n]

    @property
    def values(self) -> np.ndarray:
        """The values (a view, do not modify)."""
        return self._values[: self._n]

    @property
    def errors(self) -> np.ndarray:
        """Standard error of each value: NaN where it is exact (a view)."""
        return self._errors[: self._n]

    def truncate(self, first_step: int) -> None:
        """Forget all entries at ``first_step`` and later."""
        self._n = int(np.searchsorted(self.steps, first_step, side="left"))
        self._own()

    def _own(self) -> None:
        """Copy arrays shared with a log's columns before writing into them."""
        for name in ("_steps", "_values", "_errors"):
            array = getattr(self, name)
            if not array.flags.writeable:
                setattr(self, name, array.copy())

    def append(self, step: int, value: float, error: float = math.nan) -> None:
        """Add a value (and its standard error, if estimated) at a later step."""
        if self._n < len(self._steps):
            self._own()
        if self._n == len(self._steps):
            size = 2 * len(self._steps)
            for name in ("_steps", "_values", "_errors"):
                old = getattr(self, name)
                new = np.empty(size, dtype=old.dtype)
                new[: self._n] = old[: self._n]
                setattr(self, name, new)
        self._steps[self._n] = step
        self._values[self._n] = value
        self._errors[self._n] = error
        self._n += 1

    def extend(self, steps: np.ndarray, values: np.ndarray, errors=None) -> None:
        """Append many values at once (as :meth:`append` would, one by one).

        Args:
            steps: Increasing steps, after the last one held.
            values: One float per step.
            errors: Standard errors (``None``: every value exact).
        """
        n = len(steps)
        if not n:
            return
        if not self._n:  # new: hold the arrays (the steps shared with the column)
            self._steps = np.asarray(steps, dtype=np.int64)
            self._values = np.array(values, dtype=np.float64)
            self._errors = _nan(n) if errors is None else np.array(errors, float)
            self._n = n
            return
        self._own()
        total = self._n + n
        if total > len(self._steps):
            for name in ("_steps", "_values", "_errors"):
                old = getattr(self, name)
                new = np.empty(total, dtype=old.dtype)
                new[: self._n] = old[: self._n]
                setattr(self, name, new)
        part = slice(self._n, total)
        self._steps[part] = steps
        self._values[part] = values
        self._errors[part] = math.nan if errors is None else errors
        self._n = total

    def view(
        self, upto: int | None = None, max_points: int | None = MAX_POINTS
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Return ``(steps, values, trend)`` to draw: finite, up to a step, thinned.

        ``trend`` is :func:`trend` of the finite values up to ``upto`` (computed
        before thinning, at the points kept). A longer series is thinned by
        :func:`extremes_index`: spikes and dips stay visible, and so does the
        last point.

        Args:
            upto: Last step to include (``None``: all).
            max_points: Thin longer series to about this many points (``None``:
                keep all).

        Returns:
            Three arrays of equal length.
        """
        return self.view_errors(upto, max_points)[:3]

    def view_errors(
        self, upto: int | None = None, max_points: int | None = MAX_POINTS
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Like :meth:`view`, plus the standard errors of the values drawn.

        Returns:
            ``(steps, values, trend, errors)`` of equal length; ``errors[i]``
            belongs to ``values[i]`` (NaN where it is exact).
        """
        n = self._n if upto is None else int(np.searchsorted(self.steps, upto, "right"))
        keep = np.isfinite(self._values[:n])
        steps = self._steps[:n][keep]
        values = self._values[:n][keep]
        errors = self._errors[:n][keep]
        index = extremes_index(values, max_points)
        smooth = trend(steps, values, at=index)
        return steps[index], values[index], smooth, errors[index]


def trend(
    steps: np.ndarray,
    values: np.ndarray,
    points: int = TREND_POINTS,
    at: slice | np.ndarray | None = None,
) -> np.ndarray:
    """The trend line of a series: at each point, a local straight-line fit.

    Point ``i``'s trend is the least-squares line through the ``points``
    neighbours centred on it (fewer near the ends: the window stays ``points``
    wide and is moved inwards), evaluated at its step. Unlike an exponential
    moving average it does not lag behind the points, however sparse the
    schedule (an average over 9 points of a schedule that tracks every 10th step
    lags 40 steps behind a trend), and a straight run of points is its own
    trend, also at the ends. Steps need not be evenly spaced (logarithmic
    schedules).

    Args:
        steps: Increasing steps (finite values only).
        values: The values at them.
        points: Width of the window in points.
        at: Compute the trend only at these indices (default: all); memory and
            time are proportional to their number times ``points``.

    Returns:
        The trend at the steps chosen (``values`` itself for fewer than 3 points).
    """
    n = len(values)
    x = np.asarray(steps, dtype=np.float64)
    y = np.asarray(values, dtype=np.float64)
    where = np.arange(n)[slice(None) if at is None else at]
    width = min(points, n)
    if width < 3:
        return y[where].copy()
    start = np.clip(where - width // 2, 0, n - width)
    windows = start[:, None] + np.arange(width)
    xs, ys = x[windows], y[windows]
    x_mean, y_mean = xs.mean(axis=1), ys.mean(axis=1)
    dx = xs - x_mean[:, None]
    spread = np.einsum("ij,ij->i", dx, dx)
    slope = np.divide(np.einsum("ij,ij->i", dx, ys - y_mean[:, None]), spread,
                      out=np.zeros(len(where)), where=spread > 0)  # fmt: skip
    return y_mean + slope * (x[where] - x_mean)


_NANS: dict[int, np.ndarray] = {}


def _nan(n: int) -> np.ndarray:
    """A read-only array of ``n`` NaNs, shared by the exact series of a run."""
    found = _NANS.get(n)
    if found is None:
        found = np.full(n, math.nan)
        found.flags.writeable = False
        _NANS.clear()  # one length at a time: a run's series share it
        _NANS[n] = found
    return found


def thinned_index(n: int, max_points: int | None) -> slice | np.ndarray:
    """Indices of at most about ``max_points`` of ``n`` points, always the last.

    The stride is a power of two, so the chosen points stay the same while ``n``
    grows (until the stride doubles): a live plot does not flicker.
    """
    if max_points is None or n <= max_points:
        return slice(0, n)
    stride = 2 ** math.ceil(math.log2(n / max_points))
    index = np.arange(0, n, stride)
    if index[-1] != n - 1:
        index = np.append(index, n - 1)
    return index


def extremes_index(values: np.ndarray, max_points: int | None) -> slice | np.ndarray:
    """Indices of at most ``max_points + 1`` of ``values`` that keep their shape.

    A longer series is cut into blocks of a power-of-two length (so complete
    blocks, and the points chosen in them, stay the same while a live run grows);
    of each block the smallest and the largest finite value are kept, of the last
    (incomplete) block its smallest, largest and last value. A spike (a loss that
    jumps for one step) is therefore drawn however long the run is.

    Args:
        values: The series.
        max_points: Upper bound of points (``None``: keep all).

    Returns:
        Increasing indices (a slice if all are kept).
    """
    n = len(values)
    if max_points is None or n <= max_points:
        return slice(0, n)
    stride = 2 ** math.ceil(math.log2(2 * n / max(max_points - 2, 2)))
    finite = np.isfinite(values)
    low = np.where(finite, values, np.inf)
    high = np.where(finite, values, -np.inf)
    full = n - n % stride
    offsets = np.arange(0, full, stride)
    picks = [
        offsets + low[:full].reshape(-1, stride).argmin(axis=1),
        offsets + high[:full].reshape(-1, stride).argmax(axis=1),
    ]
    if full < n:
        tail = [full + low[full:].argmin(), full + high[full:].argmax()]
        picks.append(np.array(tail))
    picks.append(np.array([n - 1]))
    return np.unique(np.concatenate(picks))


class DashboardData:
    """Incrementally maintained series of a history, shared by all gauges.

    Args:
        history: The history to read. It may keep growing (a live run); call
            :meth:`refresh` before drawing.
    """

    def __init__(self, history: History):
        if not isinstance(history, History):
            raise TypeError(
                f"DashboardData reads a cockpit.history.History, got "
                f"{type(history).__name__}. Convert it with as_history(...)."
            )
        self.history = history
        self._series: dict[tuple[str, str], Series] = {}
        self._latest: dict[str, tuple[int, Any]] = {}
        self._resume: int | None = None  # first step to (re-)read on refresh
        #: The log file read by :func:`read_log` (``None`` for other sources): its
        #: history holds only the latest histogram per key.
        self.log: str | None = None
        #: Number of (step, key) entries read so far (shows the incremental cost).
        self.entries_read = 0

    # --- reading -------------------------------------------------------------------
    def refresh(self) -> None:
        """Read the steps added to the history since the last refresh."""
        steps = self.history.steps
        if not steps:
            return
        if self._resume is None and _columns(self.history):  # a log read once
            self._read_log_history(steps)
            return
        start = 0 if self._resume is None else bisect_left(steps, self._resume)
        new = steps[start:]
        if not new:
            return
        first = new[0]
        for series in self._series.values():
            series.truncate(first)
        for step in new:
            entries = _entries(self.history, step)
            self.entries_read += len(entries)
            for (key, reduce), series in self._series.items():
                if key in entries:
                    estimate = entries.get(key + ESTIMATE_SUFFIX)
                    _append(series, step, entries[key], estimate, reduce)
            for key, value in entries.items():
                if isinstance(value, Mapping):
                    self._latest[key] = (step, value)
        self._resume = new[-1]

    def _read_log_history(self, steps: list[int]) -> None:
        """The first refresh of a :class:`~cockpit.log.reader.LogHistory`.

        Its latest mapping of each key is asked for, not found by reading every
        step (whose mappings are read from the file when asked for).
        """
        history = self.history
        for key in history.mapping_keys():
            found = history.latest_mapping(key)
            if found is not None:
                self._latest[key] = found
        self.entries_read += history.entry_count()
        self._resume = steps[-1]

    def series(self, key: str, reduce: str = "scalar") -> Series:
        """Return the series of ``key`` reduced with ``reduce`` (see :data:`REDUCERS`).

        The first request for a series reads it from the whole history once; later
        refreshes extend it.

        Raises:
            ValueError: For an unknown ``reduce``.
        """
        if reduce not in REDUCERS:
            raise ValueError(
                f"Unknown reduction {reduce!r}; choose one of {sorted(REDUCERS)}."
            )
        if (key, reduce) not in self._series and _columns(self.history):
            series = _column_series(self.history, key, reduce, self._resume)
            if series is not None:
                self._series[(key, reduce)] = series
        if (key, reduce) not in self._series:
            series = Series()
            steps, values = self.history.stored_series(key, last=self._resume)
            estimates = dict(
                zip(
                    *self.history.stored_series(
                        key + ESTIMATE_SUFFIX, last=self._resume
                    )
                )
            )
            for step, value in zip(steps, values):
                _append(series, step, value, estimates.get(step), reduce)
            self._series[(key, reduce)] = series
        return self._series[(key, reduce)]

    def latest(self, key: str, upto: int | None = None) -> tuple[int, Any] | None:
        """Return ``(step, value)`` of the last dict-valued entry of ``key``.

        Args:
            key: The quantity key (e.g. ``"GradHist1d"``).
            upto: Last step to consider (``None``: all). Looking further back than
                the newest entry scans the history backwards.

        Returns:
            The step and value, or ``None`` if there is none.
        """
        found = self._latest.get(key)
        if found is not None and (upto is None or found[0] <= upto):
            return found
        if upto is None:
            return None
        if _columns(self.history):
            return self.history.latest_mapping(key, min(upto, self._resume))
        steps = self.history.steps
        for step in reversed(steps[: bisect_left(steps, upto + 1)]):
            value = _entries(self.history, step).get(key)
            if isinstance(value, Mapping):
                return step, value
        return None

    def has(self, key: str) -> bool:
        """Return whether ``key`` has at least one entry."""
        if key in self._latest:
            return True
        return len(self.series(key)) > 0

    @property
    def last_step(self) -> int | None:
        """The newest step read so far."""
        return self._resume


def _columns(history: History) -> bool:
    """Whether ``history`` keeps its numbers in columns (a log read once)."""
    return callable(getattr(history, "column", None))


def _column_series(history, key: str, reduce: str, last: int | None) -> Series | None:
    """The series of a numeric column, made at once (``None``: not a column).

    The values are those :meth:`DashboardData.series` computes value by value:
    the same reductions, row by row, and the same moving average.
    """
    found = history.column(key)
    if found is None:
        return None
    steps, values = found
    if last is not None:
        end = int(np.searchsorted(steps, last, "right"))
        steps, values = steps[:end], values[:end]
    reducer = REDUCERS[reduce]
    if values.ndim == 1:
        reduced = np.abs(values) if reduce == "norm" else values
        reduced = reduced.astype(np.float64)
    elif reduce == "scalar" and values.shape[1] != 1:
        reduced = np.full(len(values), math.nan)
    else:
        reduced = np.array([reducer(row) for row in values], dtype=np.float64)
    series = Series()
    errors = None
    estimates = history.stored_series(key + ESTIMATE_SUFFIX, last=last)
    if estimates[0]:
        errors = np.full(len(steps), math.nan)
        where = np.searchsorted(steps, estimates[0])
        for index, step, estimate in zip(where, *estimates):
            if index < len(steps) and steps[index] == step:
                error, bound = estimate_error(estimate, reduce)
                errors[index] = error
                series.error_bound |= bound
                series.note_estimate(estimate)
    series.extend(steps, reduced, errors)
    return series


def _append(series: Series, step: int, value: Any, estimate: Any, reduce: str):
    """Append a reduced value and, if it was estimated, its standard error."""
    error = math.nan
    if estimate is not None:
        error, bound = estimate_error(estimate, reduce)
        series.error_bound |= bound
        series.note_estimate(estimate)
    series.append(step, REDUCERS[reduce](value), error)


def read_log(path: str | os.PathLike, upto: int | None = None) -> DashboardData:
    """Read a log file for drawing, step by step, keeping only what gauges draw.

    Every number a series gauge draws is kept (per step: floats, per-parameter
    lists and estimates' standard errors), but of values that are mappings
    (histograms) only the latest one per key
    (:meth:`~cockpit.history.History.from_json_latest`): a 20,000-step log of the
    ``full`` configuration needs tens of MB, not GB, and is never held in memory
    at once. Gauges that draw earlier histograms
    (``draw(upto=...)`` with an earlier step, a timelapse) need the whole run:
    read it with :func:`as_data` instead.

    Args:
        path: A log path as :meth:`~cockpit.history.History.from_json` takes it.
        upto: Ignore steps after this one (the latest histograms are those at or
            before it).

    Returns:
        Refreshed data; :attr:`DashboardData.log` is the file read.

    Raises:
        LogFileError: As :func:`~cockpit.log.files.open_log` raises it (also for
            a log without a tracked step up to ``upto``).
    """
    found = locate_log(path)
    data = DashboardData(open_log(found, latest=True, upto=upto))
    data.log = found
    data.refresh()
    return data


def as_history(source: Any) -> History:
    """Return the history behind ``source``.

    Args:
        source: A :class:`~cockpit.Cockpit`, a :class:`~cockpit.history.History`, a
            ``{step: {key: value}}`` mapping, or the path of a log (ours or one
            written by cockpit-for-pytorch 1.0.2, with or without ``.json``).

    Returns:
        The history (the cockpit's own object for a cockpit, so it stays live).

    Raises:
        LogFileError: For a path, as :func:`~cockpit.log.files.open_log` raises it.
        TypeError: For any other kind of source.
    """
    if isinstance(source, History):
        return source
    history = getattr(source, "history", None)
    if isinstance(history, History):
        return history
    if isinstance(source, (str, os.PathLike)):
        return open_log(source)
    if isinstance(source, Mapping):
        return History(source)
    raise TypeError(
        f"Cannot plot a {type(source).__name__}. Pass a Cockpit, a History, a "
        "{step: {key: value}} dict or the path of a cockpit log."
    )


def as_data(source: Any) -> DashboardData:
    """Return :class:`DashboardData` for anything :func:`as_history` takes.

    A :class:`DashboardData` is returned as it is (its owner refreshes it, once for
    all gauges); anything else is read into a new, refreshed one.
    """
    if isinstance(source, DashboardData):
        return source
    data = DashboardData(as_history(source))
    data.refresh()
    return data
