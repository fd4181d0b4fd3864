"""Series and histograms of ``cockpit serve`` in memory that does not grow with a run.

A :class:`Points` keeps every value of a series up to :data:`LIVE_POINTS` points,
then thins blocks to their smallest and largest value (spikes stay); with
``sample=True`` it keeps an even sample instead (Alpha, whose density is drawn).
:class:`Snapshots` keeps histograms at up to :data:`HIST_SNAPSHOTS` steps spread
over the run, and the latest one.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np

from cockpit.plotting.html import histogram_entry

#: Points a series keeps before its blocks are thinned (it holds at most twice as
#: many). TensorBoard keeps 1,000 scalars per series by default.
LIVE_POINTS = 2500

#: Histogram steps kept per key (at most twice as many; plus the latest).
HIST_SNAPSHOTS = 60


class Points:
    """A growing series of ``(step, value, error)``, thinned to bounded size.

    Up to ``2 * limit`` points are kept. When full, every block of four points
    keeps its smallest and largest value (in step order), and from then on each
    block of ``2 * stride`` new values is added as its two extremes, so the
    density stays even over the run. ``sample=True`` keeps every other point
    instead (an even sample, for values whose distribution is drawn).

    The last block (:attr:`tail`, fewer than ``2 * stride`` values) is shown as
    it is and replaced as it fills.
    """

    def __init__(self, limit: int = LIVE_POINTS, sample: bool = False):
        self.limit = limit
        self.sample = sample
        self.stride = 1
        self.steps = np.empty(64, np.int64)
        self.values = np.empty(64, np.float32)
        self.errors: np.ndarray | None = None
        self.n = 0
        self.tail: list[tuple[int, float, float]] = []
        self.seen = 0  # values offered (for the sample)

    def __len__(self) -> int:
        return self.n + len(self.tail)

    @property
    def last_step(self) -> int | None:
        """The latest step held."""
        if self.tail:
            return self.tail[-1][0]
        return int(self.steps[self.n - 1]) if self.n else None

    def add(self, step: int, value: float, error: float = math.nan) -> bool:
        """Add a finite value at a step after the last one; ``False``: not an append.

        A value for the latest step replaces it when it is still in the tail.
        """
        last = self.last_step
        if last is not None and step <= last:
            if self.tail and step == last:
                self.tail[-1] = (step, value, error)
                return True
            return False
        self.seen += 1
        if self.sample:
            if (self.seen - 1) % self.stride == 0:
                self._commit([(step, value, error)])
            return True
        self.tail.append((step, value, error))
        if len(self.tail) >= 2 * self.stride:
            self._commit(_extremes(self.tail))
            self.tail = []
        return True

    def extend(self, steps: np.ndarray, values: np.ndarray, errors: np.ndarray) -> None:
        """:meth:`add` of many finite values at increasing steps after the last one.

        The same points as adding them one by one, in array operations.
        """
        i, n = 0, len(steps)
        while i < n:
            room = max(2 * self.limit - self.n, 2)  # points until the next thinning
            if self.sample:
                take = min(n - i, room * self.stride)
                index = np.arange(i, i + take)
                keep = index[(self.seen + index - i) % self.stride == 0]
                self._commit_arrays(steps[keep], values[keep], errors[keep])
            else:
                block = 2 * self.stride
                pending = len(self.tail)
                take = min(n - i, max(room // 2, 1) * block - pending)
                tail = np.array(self.tail, dtype=float).reshape(-1, 3)
                all_steps = np.concatenate(
                    [tail[:, 0].astype(np.int64), steps[i : i + take]]
                )
                all_values = np.concatenate([tail[:, 1], values[i : i + take]])
                all_errors = np.concatenate([tail[:, 2], errors[i : i + take]])
                full = len(all_steps) // block
                if full:
                    body = all_values[: full * block].reshape(full, block)
                    low, high = np.argmin(body, axis=1), np.argmax(body, axis=1)
                    same = low == high
                    low = np.where(same, 0, low)
                    high = np.where(same, block - 1, high)
                    first = np.minimum(low, high) + block * np.arange(full)
                    second = np.maximum(low, high) + block * np.arange(full)
                    pick = np.stack([first, second], axis=1).ravel()
                    pick = pick[np.concatenate([[True], np.diff(pick) != 0])]
                    self._commit_arrays(all_steps[pick], all_values[pick],
                                        all_errors[pick])  # fmt: skip
                rest = slice(full * block, None)
                self.tail = list(zip(all_steps[rest].tolist(),
                                     all_values[rest].tolist(),
                                     all_errors[rest].tolist()))  # fmt: skip
            self.seen += take
            i += take
            if self.n >= 2 * self.limit:
                self._thin()

    def _commit_arrays(self, steps, values, errors) -> None:
        k = len(steps)
        need = self.n + k
        if need > len(self.steps):
            size = max(2 * len(self.steps), need)
            self.steps = _grown(self.steps, size, self.n)
            self.values = _grown(self.values, size, self.n)
            if self.errors is not None:
                self.errors = _grown(self.errors, size, self.n)
        if self.errors is None and np.isfinite(errors).any():
            self.errors = np.full(len(self.steps), np.nan, np.float32)
        self.steps[self.n : need] = steps
        self.values[self.n : need] = values
        if self.errors is not None:
            self.errors[self.n : need] = errors
        self.n = need

    def _commit(self, points: list[tuple[int, float, float]]) -> None:
        need = self.n + len(points)
        if need > len(self.steps):
            size = max(2 * len(self.steps), need)
            self.steps = _grown(self.steps, size, self.n)
            self.values = _grown(self.values, size, self.n)
            if self.errors is not None:
                self.errors = _grown(self.errors, size, self.n)
        for step, value, error in points:
            if math.isfinite(error) and self.errors is None:
                self.errors = np.full(len(self.steps), np.nan, np.float32)
            self.steps[self.n] = step
            self.values[self.n] = value
            if self.errors is not None:
                self.errors[self.n] = error
            self.n += 1
        if self.n >= 2 * self.limit:
            self._thin()

    def _thin(self) -> None:
        """Halve the points held (see the class docstring); doubles the stride."""
        n = self.n
        if self.sample:
            keep = np.arange(0, n, 2)
        else:
            blocks = n // 4
            body = self.values[: 4 * blocks].reshape(blocks, 4)
            low = np.argmin(body, axis=1)
            high = np.argmax(body, axis=1)
            same = low == high  # equal values: the first and the last
            low, high = np.where(same, 0, low), np.where(same, 3, high)
            low, high = low + 4 * np.arange(blocks), high + 4 * np.arange(blocks)
            keep = np.unique(np.concatenate([low, high, np.arange(4 * blocks, n)]))
        k = len(keep)
        self.steps[:k] = self.steps[keep]
        self.values[:k] = self.values[keep]
        if self.errors is not None:
            self.errors[:k] = self.errors[keep]
        self.n = k
        self.stride *= 2

    def truncate(self, after: int) -> None:
        """Forget the values at steps after ``after``."""
        self.tail = [p for p in self.tail if p[0] <= after]
        self.n = int(np.searchsorted(self.steps[: self.n], after, "right"))

    def part(self, start: int) -> dict:
        """The points from index ``start`` on (the tail last) as JSON-safe lists."""
        start = min(max(start, 0), self.n)
        steps = self.steps[start : self.n].tolist() + [p[0] for p in self.tail]
        values = _rounded(self.values[start : self.n]) + _rounded(
            [p[1] for p in self.tail]
        )
        found = {"from": start, "steps": steps, "values": values,
                 "tail": len(self.tail)}  # fmt: skip
        has_errors = self.errors is not None or any(
            math.isfinite(p[2]) for p in self.tail
        )
        if has_errors:
            errors = (
                [None] * (self.n - start)
                if self.errors is None
                else _rounded(self.errors[start : self.n])
            )
            found["errors"] = errors + _rounded([p[2] for p in self.tail])
        return found

    def nbytes(self) -> int:
        """Memory of the arrays held."""
        total = self.steps.nbytes + self.values.nbytes + 40 * len(self.tail)
        return total + (0 if self.errors is None else self.errors.nbytes)


def _grown(array: np.ndarray, size: int, n: int) -> np.ndarray:
    new = np.empty(size, array.dtype)
    new[:n] = array[:n]
    return new


def _extremes(block: list[tuple[int, float, float]]) -> list[tuple[int, float, float]]:
    """The smallest and largest value of a block, in step order.

    Two points always (a block of equal values: its first and last), so every
    block is drawn with the same density.
    """
    low = min(range(len(block)), key=lambda i: block[i][1])
    high = max(range(len(block)), key=lambda i: block[i][1])
    if low == high:
        low, high = 0, len(block) - 1
    return [block[i] for i in sorted({low, high})]


def _rounded(values) -> list:
    """Six significant digits (``None`` for non-finite), as the HTML file writes."""
    return [float(f"{v:.6g}") if math.isfinite(v) else None for v in values]


class Snapshots:
    """Histograms of one key at steps spread over the run (bounded count)."""

    def __init__(self, limit: int = HIST_SNAPSHOTS):
        self.limit = limit
        self.stride = 1
        self.seen = 0
        self.items: list[dict] = []

    def offer(self, step: int, value: Any) -> bool:
        """Keep ``value`` if it is due; ``True`` if kept, ``False`` if thinned."""
        self.seen += 1
        if (self.seen - 1) % self.stride:
            return True
        entry = histogram_entry(step, value)
        if entry is None:
            return True
        if self.items and step <= self.items[-1]["step"]:
            return False
        self.items.append(entry)
        if len(self.items) >= 2 * self.limit:
            self.items = self.items[::2]
            self.stride *= 2
            return False
        return True

    def truncate(self, after: int) -> None:
        """Forget the histograms after ``after``."""
        self.items = [item for item in self.items if item["step"] <= after]

    def nbytes(self) -> int:
        """About the memory held (8 bytes a number)."""
        return sum(8 * _count(item) for item in self.items)


def _count(value: Any) -> int:
    if isinstance(value, Mapping):
        return sum(_count(v) for v in value.values())
    if isinstance(value, list):
        return sum(_count(v) for v in value) if value and isinstance(
            value[0], list) else len(value)  # fmt: skip
    return 1
