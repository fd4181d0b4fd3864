"""How ``cockpit serve`` reads a log as it grows: the reading half of a live run.

:class:`LogReading` is the part of :class:`~cockpit.serve.live.LiveRun` that reads
the bytes appended to a log since the last poll (whole lines only) through
:func:`cockpit.log.stream.stream_records`, previews a long log first, and reads a
log written whole again when it changes. What each record holds is applied by the
run (``_apply``, ``_flush``, ``_truncate``, ``_reset``).
"""

from __future__ import annotations

import os
import time
import warnings

from cockpit.log.keys import MISSING_KEY
from cockpit.log.stream import STREAM_MAGIC, stream_records

#: Most bytes read from one log per poll (the rest waits for the next poll).
READ_CHUNK = 8 << 20

#: A log with more unread bytes than this at its first read is previewed first:
#: every :data:`PREVIEW_EVERY`-th record, so the page draws every run soon; the
#: full read follows (a new epoch: the page then fetches the run again).
PREVIEW_BYTES = 2 << 20
PREVIEW_EVERY = 20

#: A line longer than this is not a cockpit record: the run shows an error.
MAX_LINE = 64 << 20


class LogReading:
    """Reading a run's log as it grows (a base class of the live run)."""

    def poll(self, writers: set | None = None) -> bool:
        """Read what was appended since the last poll; ``True`` if anything changed.

        Never raises for a problem of the file: it becomes :attr:`error`.

        Args:
            writers: ``(device, inode)`` of the files a writer holds locked now
                (``None``: not known on this system).
        """
        with self.lock:
            before = (self.version, self.status)
            try:
                self._poll(writers)
            except Exception as error:  # a foreign or broken file: shown, not raised
                self._fail(_describe(error))
            return (self.version, self.status) != before

    def _fail(self, message: str) -> None:
        self._error_seen = self._stat_key
        if self.error != message:
            self.error = message
            self.version += 1

    def _poll(self, writers: set | None) -> None:
        try:
            stat = os.stat(self.path)
        except FileNotFoundError:
            self._fail("the log was deleted (or moved) while served")
            return
        identity = (stat.st_dev, stat.st_ino)
        self.writing = None if writers is None else identity in writers
        replaced = self.identity is not None and identity != self.identity
        if replaced or (self.kind == "stream" and stat.st_size < self.offset):
            self._reset()
            self.kind = None
        self.identity = identity
        self.modified = stat.st_mtime
        self._stat_key = (identity, stat.st_size, stat.st_mtime)
        if self.error is not None:
            if self._error_seen == self._stat_key:
                return  # unchanged since it failed
            self.error = None  # the file changed: read it again
            self.version += 1
        if self.kind is None:
            with open(self.path, "rb") as handle:
                head = handle.read(len(STREAM_MAGIC))
            if not head and stat.st_size == 0:
                return  # a stream just created: nothing yet
            if head == STREAM_MAGIC:
                self.kind = "stream"
            elif STREAM_MAGIC.startswith(head):
                return  # a header being written
            elif head.lstrip()[:1] in (b"{", b"[") or not head.strip():
                self.kind = "json"
            else:
                raise _NotALog(
                    "not a cockpit log (it does not start with a JSON object). Fix: "
                    "serve the folder of the logs Cockpit(..., logpath=...) writes"
                )
        if self.kind == "stream":
            self._read_stream(stat.st_size)
        else:
            self._read_json(stat)

    def _preview(self, size: int) -> None:
        """Every :data:`PREVIEW_EVERY`-th record of the whole file (a coarse view)."""
        chosen: list[tuple[int, bytes, bool]] = []
        number, offset = 0, 0
        with open(self.path, "rb") as handle:
            while offset < size:
                data = handle.read(min(READ_CHUNK, size - offset))
                if not data:
                    break
                end = data.rfind(b"\n") + 1
                if end == 0:
                    break  # a line longer than a chunk: the full read says so
                handle.seek(offset + end)
                offset += end
                pieces = data[:end].split(b"\n")[:-1]
                for i in range(0, len(pieces)):
                    number += 1
                    if number == 1 or number % PREVIEW_EVERY == 0:
                        chosen.append((number, pieces[i], True))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for _, step, values in stream_records(self.path, chosen):
                if step is not None:
                    self._apply(step, values, raw=True)
            self._flush()
        self.coarse = True
        self.version += 1

    def _read_stream(self, size: int) -> None:
        if size <= self.offset:
            return
        if self.offset == 0 and not self.previewed and size > PREVIEW_BYTES:
            self.previewed = True
            self._preview(size)
            return
        if self.coarse:  # the full read replaces the preview
            self._reset()
            self.kind = "stream"
        with open(self.path, "rb") as handle:
            handle.seek(self.offset + len(self.pending))
            chunk = handle.read(min(size - self.offset - len(self.pending), READ_CHUNK))
        data = self.pending + chunk
        end = data.rfind(b"\n")
        if end < 0:
            self.pending = data
            if len(data) > MAX_LINE:
                raise _NotALog(
                    f"holds a line of over {MAX_LINE >> 20} MiB at byte "
                    f"{self.offset}: not a cockpit record. Fix: serve only logs "
                    "that Cockpit writes"
                )
            return
        self.pending = data[end + 1 :]
        complete = data[: end + 1]
        self.offset += len(complete)
        pieces = complete.split(b"\n")[:-1]
        first = self.line + 1
        self.line += len(pieces)
        lines = ((first + i, raw, True) for i, raw in enumerate(pieces))
        changed = False
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            for _, step, values in stream_records(self.path, lines):
                changed = True
                if step is None:
                    self._flush()
                    self._truncate(values)
                else:
                    self._apply(step, values, raw=True)
            self._flush()
        if said:
            self.skipped += len(said)
            self.warning = " ".join(str(said[-1].message).split())
        if changed or said:
            self.version += 1

    def _read_json(self, stat: os.stat_result) -> None:
        seen = (stat.st_size, stat.st_mtime)
        if self._json_seen == seen:
            return
        if time.time() - stat.st_mtime < 1.0:
            return  # being written: read it when it stands still
        from cockpit.log.files import open_log

        self._json_seen = seen  # a broken file is not read again until it changes
        if self.records:
            self._reset()
            self.kind = "json"
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            history = open_log(self.path)
        for step in history.steps:
            self._apply(step, history.view(step), raw=False)
        self._flush()
        # keep the values, not views of a history that reads them from the file
        for table in (self.sketch, self.latest):
            for key, (step, where) in table.items():
                table[key] = (step, {key: where[key]})
        if self.missing is not None:
            step, where = self.missing
            self.missing = (step, {MISSING_KEY: where[MISSING_KEY]})
        if said:
            self.warning = " ".join(str(said[-1].message).split())
        self.version += 1


class _NotALog(Exception):
    """The file is not a cockpit log (the message says why)."""


def _describe(error: BaseException) -> str:
    """One line for what went wrong reading a log."""
    from cockpit.errors import LogFileError

    if isinstance(error, _NotALog):
        return str(error)
    if isinstance(error, LogFileError):
        text = str(error)
        return text.split(": ", 1)[1] if ": " in text else text
    if isinstance(error, OSError):
        return f"cannot be read ({error.strerror or error})"
    return f"cannot be read ({type(error).__name__}: {error})"
