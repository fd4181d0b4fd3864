"""Cockpit's warning category and the messages of file errors.

Nothing here imports torch or BackPACK, so the history, the log readers and the CLI
can use it without loading either. :func:`quiet_warnings` keeps known noise out of
cockpit's steps without making Python repeat the user's warnings;
:func:`one_line_warnings` prints warnings as the command line does.
"""

from __future__ import annotations

import contextlib
import re
import warnings
from typing import Iterator


class CockpitWarning(UserWarning):
    """A problem that cockpit can live with but that you should know about.

    Filter them with ``warnings.filterwarnings("ignore", category=CockpitWarning)``.
    """


@contextlib.contextmanager
def quiet_warnings(*messages: str, category: type[Warning] = Warning) -> Iterator[None]:
    """Ignore warnings whose message starts with one of ``messages`` while inside.

    Unlike ``warnings.catch_warnings()`` with ``filterwarnings``, this leaves
    Python's record of warnings already shown intact: any change of the filters
    through the ``warnings`` functions (``catch_warnings`` included) makes every
    "shown once per location" warning show again, so quieting cockpit's own noise
    at each step made the user's warnings repeat at every step. Here the ignore
    entries go in front of ``warnings.filters`` in place and are taken out again
    (an ignored warning leaves no record, so nothing is stale afterwards); they
    take precedence over an ``"error"`` filter, as ``filterwarnings`` would.

    Args:
        *messages: Regular expressions matched at the start of the message (case
            insensitive, like ``filterwarnings``).
        category: Only warnings of this category (and its subclasses).
    """
    entries = [("ignore", re.compile(m, re.I), category, None, 0) for m in messages]
    filters = warnings.filters
    filters[:0] = entries
    try:
        yield
    finally:
        for entry in entries:  # by identity: a user's equal filter stays
            for index, present in enumerate(filters):
                if present is entry:
                    del filters[index]
                    break


@contextlib.contextmanager
def one_line_warnings(command: str) -> Iterator[None]:
    """Print warnings as ``cockpit <command>: warning: <message>`` while inside.

    For the command line (:mod:`cockpit.cli`, :mod:`cockpit.diagnosis.report`): one
    line per
    warning, without the file and line of the code that raised it.
    """
    original = warnings.formatwarning

    def formatwarning(message, category, filename, lineno, line=None):
        return f"cockpit {command}: warning: {' '.join(str(message).split())}\n"

    warnings.formatwarning = formatwarning
    try:
        yield
    finally:
        warnings.formatwarning = original


def unwritable_message(path: str, error: OSError) -> str:
    """The message for a log path that cannot be written."""
    reason = error.strerror or str(error)
    return (
        f"Cannot write the cockpit log to {path!r}: {reason}. Fix: pass a path in a "
        "writable directory (missing parent directories are created, a bare file "
        "name writes to the working directory)."
    )


def unwritable_error(path: str, error: OSError) -> OSError:
    """Return an error of the same kind as ``error`` with :func:`unwritable_message`.

    ``OSError(errno, message)`` picks the matching subclass (``PermissionError``,
    ``NotADirectoryError``, ...), so ``except PermissionError`` keeps working.
    """
    message = unwritable_message(path, error)
    if error.errno is None:
        return OSError(message)
    return OSError(error.errno, message)


class LogFileError(ValueError):
    """A log file that cannot be read: missing, empty, truncated or not a cockpit log.

    Args:
        path: The file.
        problem: What is wrong with it, and the fix where there is one.
    """

    def __init__(self, path: str, problem: str):
        super().__init__(f"{path}: {problem}")
        self.path = path
        self.problem = problem
