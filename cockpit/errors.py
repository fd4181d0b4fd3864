"""Cockpit's warning category and the messages of file errors.

Nothing here imports torch or BackPACK, so the history, the log readers and the CLI
can use it without loading either.
"""

from __future__ import annotations


class CockpitWarning(UserWarning):
    """A problem that cockpit can live with but that you should know about.

    Filter them with ``warnings.filterwarnings("ignore", category=CockpitWarning)``.
    """


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
