"""Track schedules: callables that map a global step to ``True`` (track) or ``False``.

Any callable ``int -> bool`` works as a ``track_schedule``; the two factories here
cover the common cases and describe themselves in their ``__doc__`` and ``repr``.
"""

from __future__ import annotations

import math
from typing import Callable

Schedule = Callable[[int], bool]


class _Schedule:
    """A named step predicate with a readable ``repr``.

    Picklable when ``predicate`` is (the factories' are module-level classes):
    Lightning's ``ddp_spawn`` and other process launchers pickle the quantities.
    """

    def __init__(self, predicate: Callable[[int], bool], description: str):
        self._predicate = predicate
        self.__doc__ = description
        self._description = description

    def __call__(self, global_step: int) -> bool:
        return bool(self._predicate(int(global_step)))

    def __repr__(self) -> str:
        return f"<schedule: {self._description}>"


class _Every:
    """``step - offset >= 0`` and a multiple of ``interval`` (for :func:`linear`)."""

    def __init__(self, interval: int, offset: int):
        self.interval, self.offset = interval, offset

    def __call__(self, step: int) -> bool:
        shifted = step - self.offset
        return shifted >= 0 and shifted % self.interval == 0


class _OneOf:
    """``step`` is one of the given steps (for :func:`logarithmic`)."""

    def __init__(self, steps: frozenset):
        self.steps = steps

    def __call__(self, step: int) -> bool:
        return step in self.steps


def _check_int(name: str, value, minimum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"Schedule argument {name!r} must be an int, got {value!r}.")
    if minimum is not None and value < minimum:
        raise ValueError(
            f"Schedule argument {name!r} must be >= {minimum}, got {value}. "
            f"For example linear(interval=1) tracks every step."
        )
    return value


def linear(interval: int, offset: int = 0) -> Schedule:
    """Track every ``interval``-th step, starting at ``offset``.

    Step ``s`` is tracked iff ``s - offset >= 0`` and ``(s - offset) % interval == 0``.
    A negative offset shifts the pattern: ``linear(4, offset=-1)`` tracks 3, 7, 11, ...

    Args:
        interval: Distance between two tracked steps, at least 1.
        offset: First tracked step (may be negative, see above).

    Returns:
        A callable ``global_step -> bool``.

    Raises:
        ValueError: If ``interval`` is below 1.
        TypeError: If an argument is not an int.
    """
    interval = _check_int("interval", interval, minimum=1)
    offset = _check_int("offset", offset)
    if offset < 0:
        offset = offset % interval

    return _Schedule(
        _Every(interval, offset), f"every {interval} step(s) from step {offset}"
    )


def logarithmic(
    start: float, end: float, steps: int = 300, base: float = 10, init: bool = True
) -> Schedule:
    """Track steps that are spaced logarithmically.

    The tracked set is ``{floor(base**e)}`` for ``steps`` exponents ``e`` spaced evenly
    from ``start`` to ``end`` (both included), plus step 0 if ``init``. Duplicates
    collapse, so early on every step may be tracked.

    Args:
        start: Exponent of the first tracked step.
        end: Exponent of the last tracked step.
        steps: Number of exponents, at least 1.
        base: Base of the logarithm, above 1.
        init: Also track step 0.

    Returns:
        A callable ``global_step -> bool``.

    Raises:
        ValueError: If ``steps < 1``, ``base <= 1`` or ``end < start``.
    """
    steps = _check_int("steps", steps, minimum=1)
    if base <= 1:
        raise ValueError(f"Schedule argument 'base' must be > 1, got {base}.")
    if end < start:
        raise ValueError(f"Schedule needs start <= end, got start={start}, end={end}.")
    if steps == 1:
        exponents = [float(start)]
    else:
        exponents = [start + (end - start) * k / (steps - 1) for k in range(steps)]
    tracked = {int(math.floor(base**e + 1e-9)) for e in exponents}
    if init:
        tracked.add(0)
    tracked = frozenset(tracked)
    return _Schedule(
        _OneOf(tracked),
        f"{len(tracked)} log-spaced steps in [{min(tracked)}, {max(tracked)}]",
    )
