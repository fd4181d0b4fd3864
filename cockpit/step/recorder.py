"""Where tracked values go: a recorder that hands each step's values to subscribers.

The cockpit records values as quantities produce them; once a step is done it
flushes, and every subscriber gets each step's new values once, in step order:
the in-memory history, the streamed log, and whatever else subscribes (a live
diagnosis, an exporter). The hub never calls any of them directly.

A subscriber is any object with ``on_record(global_step, values)``; ``close()`` is
called when the cockpit closes, if the subscriber has it.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Protocol

from cockpit.log.keys import MISSING_KEY
from cockpit.utils.host import to_host


class Subscriber(Protocol):
    """Receives each tracked step's values once they are complete."""

    def on_record(self, global_step: int, values: Mapping[str, Any]) -> None:
        """Take the values recorded for ``global_step`` since the last flush."""


class HistoryWriter:
    """Subscriber that adds values to a :class:`~cockpit.history.History`."""

    def __init__(self, history):
        self.history = history

    def on_record(self, global_step: int, values: Mapping[str, Any]) -> None:
        """Add every value to the history."""
        for key, value in values.items():
            self.history.add(global_step, key, value)


class StreamWriter:
    """Subscriber that appends values to a streamed log (:mod:`cockpit.log.stream`)."""

    def __init__(self, stream):
        self.stream = stream

    def on_record(self, global_step: int, values: Mapping[str, Any]) -> None:
        """Write one record for the step, flushed to disk."""
        self.stream.write({global_step: dict(values)})

    def close(self) -> None:
        """Close the file."""
        self.stream.close()


class Recorder:
    """Collects the values of a step and hands them to the subscribers.

    Args:
        sent_missing: Returns the ``missing`` entries already handed on for a
            step (or ``None``). A reason noted for a step after its values were
            flushed is then sent with those entries, so the history and the log
            (where a step's later ``missing`` replaces the earlier one) keep all.
    """

    def __init__(
        self, sent_missing: Callable[[int], Mapping[str, str] | None] | None = None
    ):
        self._subscribers: list = []
        self._fresh: dict[int, dict[str, Any]] = {}
        self._on_host = True  # whether nothing recorded since needs copying
        self._sent_missing = sent_missing

    def subscribe(self, subscriber) -> None:
        """Add a subscriber (order is kept: the history first, then the log, ...)."""
        self._subscribers.append(subscriber)

    @property
    def subscribers(self) -> tuple:
        """The subscribers, in order."""
        return tuple(self._subscribers)

    def record(self, global_step: int, key: str, value: Any) -> None:
        """Note ``value`` for ``key`` at ``global_step`` (sent on by :meth:`flush`).

        Tensors in ``value`` stay where they are until the flush copies them all
        to the host at once (:func:`cockpit.utils.host.to_host`).
        """
        self._fresh.setdefault(int(global_step), {})[key] = value
        self._on_host = False

    def note_missing(self, global_step: int, key: str, reason: str) -> None:
        """Record that quantity ``key`` has no value at ``global_step``, and why.

        The step's reasons noted earlier (flushed or not) are kept.
        """
        step = int(global_step)
        fresh = self._fresh.setdefault(step, {})
        if MISSING_KEY not in fresh:
            sent = self._sent_missing(step) if self._sent_missing else None
            fresh[MISSING_KEY] = dict(sent or {})
        fresh[MISSING_KEY][key] = reason

    def to_host(self) -> None:
        """Copy the values recorded so far to the host now (one copy per device).

        Deferred values (:class:`~cockpit.utils.host.Deferred`) are decided: each
        becomes what it finishes as (a number, or a ``Missing``).
        """
        self._fresh, self._on_host = to_host(self._fresh), True

    def value(self, global_step: int, key: str) -> Any:
        """The value recorded for ``key`` at ``global_step`` since the last flush."""
        return self._fresh.get(int(global_step), {}).get(key)

    def forget(self, global_step: int, keys) -> None:
        """Drop the values of ``keys`` recorded at ``global_step`` (not yet flushed)."""
        fresh = self._fresh.get(int(global_step), {})
        for key in keys:
            fresh.pop(key, None)

    def discard(self) -> None:
        """Forget what was recorded since the last flush (a step that failed)."""
        self._fresh, self._on_host = {}, True

    def flush(self) -> None:
        """Hand every step recorded since the last flush to every subscriber.

        Every subscriber gets every step even if another one raises (a full disk
        under the streamed log must not cost the history its values); the first
        error is raised afterwards.
        """
        fresh = self._fresh if self._on_host else to_host(self._fresh)  # one copy
        self._fresh, self._on_host = {}, True
        first_error = None
        for subscriber in self._subscribers:
            for step in sorted(fresh):
                try:
                    subscriber.on_record(step, fresh[step])
                except Exception as error:
                    first_error = first_error or error
                    break
        if first_error is not None:
            raise first_error

    def close(self) -> None:
        """Flush, then close every subscriber that can be closed."""
        self.flush()
        for subscriber in self._subscribers:
            close = getattr(subscriber, "close", None)
            if close is not None:
                close()
