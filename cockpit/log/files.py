"""Opening a log: the one reader behind every command and every log path argument.

``cockpit plot``, ``timelapse``, ``export`` and ``report``,
:func:`cockpit.diagnosis.diagnose`, the dashboard and the TensorBoard exporter all
open a log path with :func:`open_log`, so a file that cannot be used fails the same
way everywhere: a :class:`~cockpit.errors.LogFileError` whose message names the
file, says what is wrong with it and how to fix it. The reading itself is
:func:`cockpit.log.reader.read_log_history`: one pass over the file into a
:class:`~cockpit.log.reader.LogHistory` (numbers in compact columns, histograms read
back from the file when asked for), so a command's memory does not grow with the
log's histograms; what is added here is finding the file and turning "nothing
there" into a message.

Nothing here imports torch or BackPACK.
"""

from __future__ import annotations

import os
import re
import warnings

from cockpit.errors import LogFileError
from cockpit.history import History
from cockpit.log.json_file import LOG_SUFFIXES, find_log
from cockpit.log.reader import read_log_history

__all__ = ["empty_run_cause", "locate_log", "open_log"]

#: How the messages below end: where a log comes from.
_WRITTEN_BY = "Cockpit.write(path) or Cockpit(..., logpath=path)"


# --- messages ------------------------------------------------------------------------
def empty_run_cause(closed_a_step: bool | None = None) -> str:
    """Why a run tracked no step, and the fix: the one text for every such message.

    Said by :meth:`Cockpit.write <cockpit.cockpit_output.CockpitOutput.write>`
    (a warning), by every command given the run's log and by the dashboard.

    Args:
        closed_a_step: Whether the cockpit ever closed a step (``Cockpit.end``
            ran): ``False``, the backward pass was never wrapped; ``True``, steps
            were wrapped but no quantity was due in any of them; ``None`` (all a
            log tells): either.
    """
    unwrapped = (
        "the backward pass did not run inside `with cockpit(step, info=...):` "
        "(or between cockpit.begin(step, info=...) and cockpit.end())"
    )
    unscheduled = "no quantity's track_schedule returned True for the steps that ran"
    if closed_a_step is None:
        likely = f"Likely cause: {unwrapped}, or {unscheduled}"
    elif closed_a_step:
        likely = f"Likely cause: the steps were wrapped, but {unscheduled}"
    else:
        likely = f"Likely cause: {unwrapped}; no step was ever opened and closed"
    return (
        f"{likely}. Fix: run `loss.backward(...)` inside `with cockpit(step, "
        "info=...):` at every step, with a track_schedule that fires (e.g. "
        "cockpit.utils.schedules.linear(1): every step)."
    )


def missing_message(path: str) -> str:
    """The problem of a log path under which no file exists."""
    also = ""
    if not path.endswith(LOG_SUFFIXES):
        also = f" (nor {os.path.basename(path)}.json or .jsonl)"
    return f"no such file{also}. Fix: pass the path given to {_WRITTEN_BY}."


def unreadable_message(error: OSError) -> str:
    """The problem of a log file that the operating system refuses to read."""
    return (
        f"cannot be read ({error.strerror or error}). Fix: check that the file is "
        "readable by you."
    )


def all_skipped_message(skipped: list[str]) -> str:
    """The problem of a log whose every record was skipped (one line for all)."""
    first = re.sub(r" of the cockpit log '.*?'", "", skipped[0])
    more = f" ({len(skipped) - 1} more skipped)" if len(skipped) > 1 else ""
    return (
        f"holds no readable tracked step: {first[0].lower()}{first[1:]}{more} "
        f"Fix: pass a log that {_WRITTEN_BY} wrote for a run that tracked at least "
        "one step."
    )


def empty_message(size: int) -> str:
    """The problem of a log without a tracked step (``size``: the file's bytes)."""
    if size == 0:
        return (
            "is empty (0 bytes): the run has tracked no step yet (a streamed log "
            "stays empty until the first tracked step ends), so there is nothing to "
            f"show. {empty_run_cause()}"
        )
    return (
        "holds no tracked steps: its run tracked none (or stopped before its first "
        f"tracked step ended), so there is nothing to show. {empty_run_cause()}"
    )


# --- reading -------------------------------------------------------------------------
def locate_log(path: str | os.PathLike) -> str:
    """Return the file a log path names (see :func:`~cockpit.log.json_file.find_log`).

    Args:
        path: A log path, with or without ``.json``/``.jsonl``.

    Returns:
        The path of an existing file.

    Raises:
        LogFileError: If there is no such file, or ``path`` is a folder without a
            log beside it.
    """
    path = os.fspath(path)
    try:
        return find_log(path)
    except FileNotFoundError:
        raise LogFileError(path, missing_message(path)) from None


def open_log(
    path: str | os.PathLike, *, latest: bool = False, upto: int | None = None
) -> History:
    """Read a log, or say in one message what is wrong with it.

    Warnings raised while reading (a torn last record of a streamed log) are
    passed on if the log holds a step; if it holds none, the first one is part
    of the error instead (it says why nothing is left).

    Args:
        path: A log path, with or without ``.json``/``.jsonl``: written, streamed,
            or by cockpit-for-pytorch 1.0.2.
        latest: Keep of mappings (histograms) only the latest per key: what a
            dashboard draws (as :meth:`~cockpit.history.History.from_json_latest`
            reads). Without it every mapping can be read, back from the file when
            asked for.
        upto: With ``latest``, ignore steps after this one.

    Returns:
        The history, a :class:`~cockpit.log.reader.LogHistory` (an ordinary
        :class:`~cockpit.history.History` for a file of an odd shape); it holds at
        least one step. Its memory is about 8 bytes per number the log holds at
        its steps, whatever its histograms.

    Raises:
        LogFileError: If there is no such file, it cannot be read, it is not a
            cockpit log (binary, not JSON, truncated, JSON of another shape), or
            it holds no tracked step. The message names the file, the problem and
            the fix.
        ValueError: For ``upto`` without ``latest``.
    """
    if upto is not None and not latest:
        raise ValueError("open_log(..., upto=...) reads with latest=True only.")
    found = locate_log(path)
    try:
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            history = read_log_history(found, "latest" if latest else "all", upto)
    except OSError as error:
        raise LogFileError(found, unreadable_message(error)) from None
    if history.steps:
        for warning in said:  # as they would have been shown
            warnings.warn_explicit(
                warning.message, warning.category, warning.filename, warning.lineno
            )
        return history
    skipped = [str(w.message) for w in said if str(w.message).startswith("Skipped")]
    if skipped:
        raise LogFileError(found, all_skipped_message(skipped))
    raise LogFileError(found, empty_message(os.path.getsize(found)))
