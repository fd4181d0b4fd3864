"""One writer per streamed log: a lock on the log file itself.

A :class:`~cockpit.log.stream.LogStream` takes :class:`WriterLock` on its file when
it is created and lets go when it is closed or dropped. A second writer on the same
file (another Cockpit in this process, a notebook cell run twice, another process)
is refused with :class:`LogInUseError`, which names the writer (process, host,
since when) and the fix, instead of damaging both logs.

The lock is ``fcntl.flock`` on the log file: the operating system lets go of it
when the process dies, so a crashed run never leaves a stale lock, and no file is
added next to the log. Who writes is noted for the message in the temporary folder
(``<tmp>/cockpit-log-writers/<device>-<inode>.json``, removed with the lock; a
writer in a process with another temporary folder is refused all the same, but
not named). A writer that replaces the file (a resumed run converting a written
log, a log deleted during the run) locks the new file before writing to it. Where
``flock`` is not available (Windows) or the file system refuses it, only writers
within one process are told apart.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import json
import os
import socket
import tempfile
import time

try:
    import fcntl
except ImportError:  # pragma: no cover (Windows)
    fcntl = None

#: Logs locked by this process without ``flock`` (the fallback).
_HELD: set[str] = set()
_BUSY = (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)


class LogInUseError(OSError):
    """The log is being written by another writer (named in the message)."""


def in_use_error(path: str, holder: str) -> LogInUseError:
    """The error for a second writer on the log ``path``."""
    return LogInUseError(
        errno.EBUSY,
        f"The cockpit log {path!r} is being written by another Cockpit: {holder}. "
        "Two writers on one file damage each other's records. Fix: give this "
        "Cockpit another logpath; or close the other first (cockpit.close()), and "
        "to go on with its run create this Cockpit with the same logpath and call "
        "cockpit.load_state_dict(state) (resume)",
    )


def _holder(path: str) -> dict:
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "since": time.strftime("%Y-%m-%d %H:%M:%S"),
        "path": path,
    }


def _describe(holder: dict | None) -> str:
    """Who holds a lock."""
    try:
        pid, host, since = holder["pid"], holder["host"], holder["since"]
    except (KeyError, TypeError):
        return "another process (not named: it left no note in this temporary folder)"
    here = " (this process)" if pid == os.getpid() else ""
    return f"process {pid}{here} on {host}, writing since {since}"


def _note_path(fd: int) -> str:
    stat = os.fstat(fd)
    folder = os.path.join(tempfile.gettempdir(), "cockpit-log-writers")
    return os.path.join(folder, f"{stat.st_dev}-{stat.st_ino}.json")


def _read_note(fd: int) -> dict | None:
    try:
        with open(_note_path(fd), encoding="utf-8") as handle:
            return json.load(handle)
    except (OSError, ValueError):
        return None


class WriterLock:
    """The lock of one log file (see the module).

    Args:
        path: The streamed log's path.
    """

    def __init__(self, path: str):
        self.path = path
        self._fd: int | None = None
        self._note: str | None = None
        self._fallback: str | None = None

    @property
    def held(self) -> bool:
        """Whether this object holds the lock."""
        return self._fd is not None or self._fallback is not None

    def acquire(self) -> None:
        """Lock the file now at the path (created if missing), or keep the lock.

        A writer of this process that is no longer reachable (garbage not yet
        collected) is collected first. A lock on a file that has been replaced
        since is let go and the new file is locked.

        Raises:
            LogInUseError: If another writer holds it.
        """
        if self._fd is not None and self._same_file(self._fd):
            return
        if self._fallback is not None:
            return
        self.release()
        try:
            self._take()
        except LogInUseError as error:
            if "(this process)" not in str(error):
                raise
            gc.collect()  # a dropped cockpit's stream lets go when collected
            self._take()

    def _take(self) -> None:
        if fcntl is None:
            return self._take_in_process()
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as error:
                holder = _read_note(fd)
                os.close(fd)
                if error.errno in _BUSY:
                    raise in_use_error(self.path, _describe(holder)) from None
                return self._take_in_process()  # no flock on this file system
            if self._same_file(fd):
                self._fd = fd
                self._write_note(fd)
                return None
            os.close(fd)  # replaced meanwhile: lock the file there now

    def _write_note(self, fd: int) -> None:
        with contextlib.suppress(OSError):
            note = _note_path(fd)
            os.makedirs(os.path.dirname(note), exist_ok=True)
            with open(note, "w", encoding="utf-8") as handle:
                json.dump(_holder(self.path), handle)
            self._note = note

    def _same_file(self, fd: int) -> bool:
        try:
            here, there = os.fstat(fd), os.stat(self.path)
        except OSError:
            return False
        return (here.st_ino, here.st_dev) == (there.st_ino, there.st_dev)

    def _take_in_process(self) -> None:
        key = os.path.realpath(self.path)
        if key in _HELD:
            raise in_use_error(self.path, _describe(_holder(self.path)))
        _HELD.add(key)
        self._fallback = key

    def release(self) -> None:
        """Let go of the lock (and its note); never raises."""
        fd, self._fd = self._fd, None
        note, self._note = self._note, None
        if note is not None:
            with contextlib.suppress(OSError):
                os.remove(note)
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)  # lets go of the flock
        if self._fallback is not None:
            _HELD.discard(self._fallback)
            self._fallback = None
