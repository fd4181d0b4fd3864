"""A crash-safe log: the history streamed to a file while the run goes on.

Turn it on with ``Cockpit(params, quantities, logpath="runs/log")``. The file
(``runs/log.jsonl``; see :func:`stream_path`) is append-only and holds one standard
JSON object per line, NaN and infinities encoded and large arrays packed as in
:meth:`cockpit.history.History.write_json`::

    {"format":"cockpit-log-stream","version":2}          header (first line)
    {"step":12,"values":{"Loss":0.31,"GradNorm":[...]}}  values recorded for step 12
    {"step":11,"values":{"UpdateSize":[...]}}            a two-step value for step 11
    {"resume_after":40}                                  see below

The records of a tracked step are written and flushed when its ``with cockpit(...)``
block ends, so a run killed at any moment (even with ``SIGKILL``) keeps every step
that was completed; only the record being written can be torn, and the reader skips
it with a warning. Values of one step may come in several records (two-step values
arrive one step later, :meth:`~cockpit.Cockpit.log` writes its own); the reader merges
them, later values winning. A run resumed from a checkpoint
(:meth:`~cockpit.Cockpit.load_state_dict`) appends a ``resume_after`` marker: records
for later steps written before it (by the run that died after the checkpoint) are
dropped, since the resumed run writes them again.

:meth:`cockpit.history.History.from_json` detects and reads this format, so
``to_dataframe``, the plotter and ``cockpit plot`` read streamed logs as they are.
Data reaches the operating system at each step (``flush``), which survives the death
of the process; it is not ``fsync``-ed, so a power cut may lose the last steps.

A log has one writer: a second :class:`LogStream` on the same file while the first
is open is refused (:class:`~cockpit.log.lock.LogInUseError` names the writer and
the fix; the lock is on the file itself, see :mod:`cockpit.log.lock`). A log file
deleted or replaced during the run is noticed at the next write: a
:class:`~cockpit.errors.CockpitWarning` says so once, the file is started afresh
and everything recorded so far is written to it again (what the cockpit holds in
memory; a stream without it writes again the records of the last write, which
may have gone to the removed file). A failed write (a full disk) never stops
training, and neither does :meth:`LogStream.close` afterwards: both warn and say
how to write the complete log from memory (``cockpit.write(path)``).
"""

from __future__ import annotations

import contextlib
import json
import os
import warnings
import weakref
from typing import Any, Callable, Iterable, Iterator, Mapping

from cockpit.errors import CockpitWarning, LogFileError, unwritable_error
from cockpit.log.format import compact, decode, pack
from cockpit.log.json_file import parse_json_log
from cockpit.log.lock import LogInUseError, WriterLock

#: Name and version in the header line. Version 2 packs large arrays
#: (:func:`cockpit.log.format.pack`); this reader reads versions 1 and 2.
STREAM_FORMAT = "cockpit-log-stream"
STREAM_VERSION = 2

_HEADER = json.dumps(
    {"format": STREAM_FORMAT, "version": STREAM_VERSION}, separators=(",", ":")
)
_MAGIC = _HEADER[: _HEADER.index(",")].encode()  # b'{"format":"cockpit-log-stream"'
#: The first bytes of every streamed log (see :func:`is_stream_data`).
STREAM_MAGIC = _MAGIC
_CHUNK = 1 << 20


def stream_path(logpath: str | os.PathLike) -> str:
    """Return the file a stream for ``logpath`` is written to.

    ``logpath`` is used as given if it ends with ``.jsonl`` or ``.json``; otherwise
    ``.jsonl`` is appended (so ``Cockpit.write(logpath)``, which writes
    ``logpath + ".json"``, does not overwrite the stream).
    """
    logpath = os.fspath(logpath)
    if logpath.endswith((".jsonl", ".json")):
        return logpath
    return logpath + ".jsonl"


def _line(payload: Mapping[str, Any]) -> str:
    return json.dumps(payload, separators=(",", ":"), allow_nan=False) + "\n"


def record_line(global_step: int, values: Mapping[str, Any]) -> str:
    """Return the line that records ``values`` for ``global_step``.

    Large arrays are packed (:func:`cockpit.log.format.pack`); every record stands
    alone, so a torn record loses nothing but itself.
    """
    packed = pack({str(k): compact(v) for k, v in values.items()})
    return _line({"step": int(global_step), "values": packed})


class LogStream:
    """Writes the history of a run to a JSON-lines file as the run goes.

    The path is checked and the log's lock taken (:mod:`cockpit.log.lock`) when the
    stream is created, so an unwritable path or a second writer fails before
    training starts. The file is opened at the first write: a new run replaces an
    existing file, a run resumed with :meth:`resume` appends to it. The lock is
    released by :meth:`close`, or when the stream is dropped.

    Args:
        logpath: Log path; see :func:`stream_path` for the suffix.
        replay: Returns ``(step, values)`` of everything recorded so far (the
            history in memory): written again to a log file that was deleted or
            replaced during the run.

    Raises:
        LogInUseError: If another writer has the log open (the message names it).
        OSError: If the file cannot be created or written (message names the path
            and the fix).
    """

    def __init__(
        self,
        logpath: str | os.PathLike,
        replay: Callable[[], Iterable[tuple[int, Mapping[str, Any]]]] | None = None,
    ):
        self.path = stream_path(logpath)
        self._handle = None
        self._resuming = False
        self._resume_after: int | None = None
        self._replay = replay
        self._last = ""  # the text of the last write
        self._told: set[str] = set()  # warnings given
        #: The error that stopped streaming, if writing failed during the run.
        self.error: OSError | None = None
        self._lock = WriterLock(self.path)
        try:
            if os.path.isdir(self.path):
                raise IsADirectoryError(21, "Is a directory")
            parent = os.path.dirname(self.path)
            if parent:
                os.makedirs(parent, exist_ok=True)
            self._lock.acquire()  # creates the file if missing, never truncates
        except LogInUseError:
            raise
        except OSError as error:
            self._lock.release()
            raise unwritable_error(self.path, error) from error
        weakref.finalize(self, self._lock.release)

    # --- writing -------------------------------------------------------------------
    def resume(self, after_step: int | None) -> None:
        """Append to the existing file, dropping its records for steps > ``after_step``.

        Args:
            after_step: The last step the checkpoint had seen (``None``: none).
        """
        if self._handle is None:
            self._resuming = True
            self._resume_after = after_step
        elif after_step is not None:
            self._write(_line({"resume_after": int(after_step)}))

    def write(self, records: Mapping[int, Mapping[str, Any]]) -> None:
        """Append one record per step and flush.

        A failure to write (disk full, file removed, ...) never interrupts
        training: it warns once, stops streaming, and the history stays in memory.

        Args:
            records: ``{step: {key: value}}`` recorded since the last write.
        """
        text = "".join(
            record_line(step, values) for step, values in records.items() if values
        )
        if text:
            self._write(text)

    def _write(self, text: str) -> None:
        if self.error is not None:
            return
        try:
            if self._handle is not None and self._lost():
                text = self._again() + text
            if self._handle is None:
                text = self._open() + text
            self._handle.write(text)
            self._handle.flush()
            self._last = text
        except OSError as error:
            self.error = error
            self._warn(
                "failed",
                f"Streaming the cockpit log to {self.path!r} failed ({error}); "
                "streaming is off for the rest of the run, the history stays in "
                "memory. Fix: free space or pick another path, and call "
                f"{self._write_hint()} to save the history.",
            )

    def _warn(self, what: str, message: str) -> None:
        if what not in self._told:
            self._told.add(what)
            warnings.warn(message, CockpitWarning, stacklevel=4)

    def _write_hint(self) -> str:
        """``cockpit.write(...)`` with a path beside the log."""
        return f"cockpit.write({os.path.splitext(self.path)[0] + '_complete'!r})"

    def _lost(self) -> bool:
        """Whether the file was deleted or replaced since it was opened."""
        try:
            there = os.stat(self.path)
        except FileNotFoundError:
            return True
        here = os.fstat(self._handle.fileno())
        return (here.st_ino, here.st_dev) != (there.st_ino, there.st_dev)

    def _again(self) -> str:
        """Start a deleted or replaced file afresh; return what to write again."""
        self._warn(
            "lost",
            f"The cockpit log {self.path!r} was deleted or replaced during the run. "
            "cockpit started it afresh and wrote every step recorded so far to it "
            "again. Fix: leave the log file alone while the run writes it (read or "
            "copy it as you like).",
        )
        self._close_handle()
        self._resuming = False  # a new file: the header, then the records again
        if self._replay is None:
            return self._last
        return "".join(
            record_line(step, values) for step, values in self._replay() if values
        )

    def _open(self) -> str:
        """Open the file and return the lines that must precede the first record."""
        # the file as it is now, before touching it (after close, or after it
        # was deleted or replaced, it is locked anew)
        self._lock.acquire()
        if not self._resuming:
            self._handle = open(self.path, "w", encoding="utf-8")
            return _HEADER + "\n"
        prefix = _prepare_for_append(self.path)
        self._lock.acquire()  # a written log converted to a stream is a new file
        self._handle = open(self.path, "a", encoding="utf-8")
        if self._resume_after is not None:
            prefix += _line({"resume_after": int(self._resume_after)})
        return prefix

    def _close_handle(self) -> OSError | None:
        """Close the file; return the error instead of raising it."""
        handle, self._handle = self._handle, None
        if handle is None:
            return None
        try:
            handle.close()
        except OSError as error:
            return error
        return None

    def close(self) -> None:
        """Close the file and let go of the lock; never raises.

        Records are on disk already (writing later reopens the file). After a
        failed write it warns where the complete log can still be written from
        memory (``cockpit.write(path)``).
        """
        error = self._close_handle()
        if error is not None and self.error is None:
            self.error = error
        if self.error is not None:
            self._warn(
                "incomplete",
                f"The cockpit log {self.path!r} lacks the steps after its write "
                f"failed ({self.error}). The complete history is in memory: write "
                f"it with {self._write_hint()} (on a disk with space).",
            )
        self._resuming = True
        self._resume_after = None
        self._lock.release()

    def __del__(self):
        handle = getattr(self, "_handle", None)
        if handle is not None:
            try:
                handle.close()
            except OSError:
                pass


def _prepare_for_append(path: str) -> str:
    """Make ``path`` ready for appending; return a header if the file is empty.

    A torn last record is cut off (it could not be read anyway, and a record
    appended to it would be lost too). A log in standard JSON (e.g. written by
    ``Cockpit.write`` to the same path) is converted to the streamed format.
    """
    if not os.path.exists(path) or os.path.getsize(path) == 0:
        return _HEADER + "\n"
    if not is_stream_file(path):
        with open(path, "rb") as handle:
            log = parse_json_log(path, handle.read())
        tmp = f"{path}.tmp{os.getpid()}"
        try:
            with open(tmp, "w", encoding="utf-8") as handle:
                handle.write(_HEADER + "\n")
                for step in sorted(log):
                    handle.write(record_line(step, log[step]))
            os.replace(tmp, path)
        except BaseException:  # a crash, an interrupt: no tmp file stays
            with contextlib.suppress(OSError):
                os.remove(tmp)
            raise
        return ""
    with open(path, "rb+") as handle:
        end = handle.seek(0, os.SEEK_END)
        position = end
        while position > 0:
            start = max(0, position - _CHUNK)
            handle.seek(start)
            chunk = handle.read(position - start)
            newline = chunk.rfind(b"\n")
            if newline >= 0:
                position = start + newline + 1
                break
            position = start
        if position < end:
            handle.truncate(position)
    return "" if position > 0 else _HEADER + "\n"


# --- reading -------------------------------------------------------------------------
def is_stream_data(data: bytes) -> bool:
    """Return whether ``data`` (a file's first bytes or all of it) is a streamed log.

    Empty data and a torn header count as one: a stream is created empty and its
    header can be cut by a kill.
    """
    head = data[: len(_MAGIC)]
    if head == _MAGIC:
        return True
    return len(data) <= len(_MAGIC) and _MAGIC.startswith(data)


def is_stream_file(path: str | os.PathLike) -> bool:
    """Return whether ``path`` holds a streamed log (an empty file counts as one)."""
    with open(path, "rb") as handle:
        return is_stream_data(handle.read(len(_MAGIC) + 1))


def _parse(lines: Iterable[tuple[int, bytes, bool]], path: str):
    for number, raw, terminated in lines:
        if not raw.strip():
            continue
        try:
            record = json.loads(raw)
        except ValueError:
            if terminated:
                warnings.warn(
                    f"Skipped line {number} of the cockpit log {path!r}: it is not "
                    "valid JSON (the file was damaged). The other records are read.",
                    CockpitWarning,
                    stacklevel=4,
                )
            else:
                warnings.warn(
                    f"Skipped the torn last record (line {number}) of the cockpit log "
                    f"{path!r}: the run stopped while writing it. Every earlier step "
                    "is read.",
                    CockpitWarning,
                    stacklevel=4,
                )
            continue
        if isinstance(record, dict):
            yield number, record


def read_stream(path: str | os.PathLike) -> dict[int, dict[str, Any]]:
    """Read a streamed log into ``{step: {key: value}}``.

    Args:
        path: The log file.

    Returns:
        The merged values, steps sorted.

    Raises:
        LogFileError: If the log was written by a newer format version.
    """
    path = os.fspath(path)
    with open(path, "rb") as handle:
        return parse_stream(path, handle.read())


def parse_stream(path: str, data: bytes) -> dict[int, dict[str, Any]]:
    """Parse the content of a streamed log into ``{step: {key: value}}``.

    Damaged lines and a torn last record are skipped with a
    :class:`~cockpit.errors.CockpitWarning`.

    Args:
        path: The file ``data`` was read from (for messages).
        data: The file's content.

    Returns:
        The merged values, steps sorted.

    Raises:
        LogFileError: If the log was written by a newer format version.
    """
    pieces = data.split(b"\n")
    last = len(pieces)
    lines = ((number, raw, number < last) for number, raw in enumerate(pieces, start=1))
    merged: dict[int, dict[str, Any]] = {}
    for number, step, raw_values in stream_records(path, lines):
        if step is None:  # a resume marker: raw_values is the last step kept
            for later in [s for s in merged if s > raw_values]:
                del merged[later]
            continue
        try:
            values = decode(raw_values)
        except (ValueError, TypeError, KeyError) as error:
            _skip(path, number, f"its values cannot be read ({error})")
            continue
        merged.setdefault(step, {}).update(values)
    return {step: merged[step] for step in sorted(merged)}


def file_lines(handle) -> Iterator[tuple[int, bytes, bool]]:
    """``(number, line, ends with a newline)`` of a file opened in binary mode.

    Reads one line at a time, so a long log is never held in memory at once.
    """
    for number, raw in enumerate(handle, start=1):
        yield number, raw, raw.endswith(b"\n")


def stream_records(
    path: str, lines: Iterable[tuple[int, bytes, bool]]
) -> Iterator[tuple[int, int | None, Any]]:
    """The records of a streamed log, as they come, still encoded.

    Damaged lines, a torn last record and unknown records are skipped with a
    :class:`~cockpit.errors.CockpitWarning`; the header is checked.

    Args:
        path: The log file (for messages).
        lines: ``(number, line, terminated)`` as :func:`file_lines` yields them.

    Yields:
        ``(line number, step, values)`` for a record of values (``values`` as
        written: pass them to :func:`~cockpit.log.format.decode`), and
        ``(line number, None, after)`` for a resume marker: records read so far
        for steps after ``after`` are void.

    Raises:
        LogFileError: If the log was written by a newer format version.
    """
    for number, record in _parse(lines, path):
        if "step" in record and isinstance(record.get("values"), dict):
            try:
                step = int(record["step"])
            except (ValueError, TypeError) as error:
                _skip(path, number, f"its values cannot be read ({error})")
                continue
            yield number, step, record["values"]
        elif "resume_after" in record:
            yield number, None, int(record["resume_after"])
        elif record.get("format") == STREAM_FORMAT:
            if int(record.get("version", 1)) > STREAM_VERSION:
                raise LogFileError(
                    path,
                    f"uses stream format version {record['version']}, newer than "
                    f"this cockpit reads ({STREAM_VERSION}). Fix: upgrade cockpit.",
                )
        elif "step" in record and "values" in record:
            kind = type(record["values"]).__name__
            _skip(path, number, f"its values are a JSON {kind}, not an object")
        else:
            _skip(path, number, f"unknown record {sorted(record)}")


def _skip(path: str, number: int, why: str) -> None:
    warnings.warn(
        f"Skipped line {number} of the cockpit log {path!r}: {why}.",
        CockpitWarning,
        stacklevel=4,
    )
