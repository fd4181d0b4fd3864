"""Where cockpit's one-line messages go: the ``cockpit`` logger's default handler.

The coverage line (which engine computes what, said once when tracking starts) is
an INFO record of the ``cockpit`` logger, which a program that configured no
logging would never show. Like Lightning's set-up lines, cockpit gives the logger a
stderr handler of its own that prints only while no other handler would
(:func:`default_handler`).
"""

from __future__ import annotations

import logging
import sys

LOG = logging.getLogger("cockpit")


class _StderrHandler(logging.StreamHandler):
    """A stream handler writing to whatever ``sys.stderr`` is when a line comes."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler.__init__ sets it
        pass


def _shown_by_default(record: logging.LogRecord) -> bool:
    """Whether cockpit's own stderr handler prints ``record``.

    Only while no other handler would receive it: none on the ``cockpit`` logger or
    on the loggers it propagates to (a handler that took this filter over, such as
    a progress bar's redirect, counts as cockpit's own).
    """
    logger: logging.Logger | None = LOG
    while logger is not None:
        for handler in logger.handlers:
            if _shown_by_default not in handler.filters:
                return False
        logger = logger.parent if logger.propagate else None
    return True


_DEFAULT_HANDLER: logging.Handler | None = None


def default_handler() -> None:
    """Give the ``cockpit`` logger a stderr handler of its own, once per process.

    It prints a record only while no other handler would
    (:func:`_shown_by_default`), and the logger's level becomes INFO unless the
    user set one. Configured logging (``logging.basicConfig``, pytest, ...)
    receives the line as usual, once. Silence it with
    ``logging.getLogger("cockpit").setLevel(logging.WARNING)``. A cockpit that
    writes the log calls this when it is made, so that a progress bar can redirect
    the handler (``tqdm.contrib.logging.logging_redirect_tqdm``).
    """
    global _DEFAULT_HANDLER
    if _DEFAULT_HANDLER is None:  # once per process: a progress bar may swap it
        _DEFAULT_HANDLER = _StderrHandler()  # for a handler of its own meanwhile
        _DEFAULT_HANDLER.addFilter(_shown_by_default)
        LOG.addHandler(_DEFAULT_HANDLER)
        if LOG.level == logging.NOTSET:
            LOG.setLevel(logging.INFO)
