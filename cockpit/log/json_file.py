"""Log files in JSON: finding the file a log path names, parsing it whole or by step.

:func:`json_path` names a written log, :func:`find_log` finds the file a log path
refers to, :func:`parse_json_log` reads a log in standard JSON (ours or 1.0.2's),
raising :class:`~cockpit.errors.LogFileError` for anything that is not one, and
:func:`json_log_steps` reads one step at a time. Values are decoded by
:mod:`cockpit.log.format`. Nothing here imports torch.
"""

from __future__ import annotations

import codecs
import json
import os
from typing import Any, Iterator

from cockpit.errors import LogFileError
from cockpit.log.format import FLOAT_TAG, LINSPACE_TAG, NDARRAY_TAG, SPARSE_TAG, decode

#: Suffixes a log path may carry; without one, ``.json`` (then ``.jsonl``) is meant.
LOG_SUFFIXES = (".json", ".jsonl")


def json_path(logpath: str | os.PathLike) -> str:
    """Return the file a history written to ``logpath`` goes to.

    As in cockpit-for-pytorch 1.0.2, a path without the ``.json`` suffix means
    ``<logpath>.json``, also when a folder named ``<logpath>`` exists.

    Args:
        logpath: The path given to ``Cockpit.write``.

    Returns:
        ``logpath`` if it ends with ``.json``, else ``logpath + ".json"``.
    """
    logpath = os.fspath(logpath)
    return logpath if logpath.endswith(".json") else logpath + ".json"


def find_log(logpath: str | os.PathLike) -> str:
    """Return the file that the log path ``logpath`` refers to.

    A path ending in ``.json`` or ``.jsonl`` is taken as it is. Otherwise, as in
    cockpit-for-pytorch 1.0.2, ``<logpath>.json`` is meant (then the streamed
    ``<logpath>.jsonl``), also when a folder named ``<logpath>`` exists next to it
    (1.0.2's examples put a log ``logfiles/run.json`` beside a folder
    ``logfiles/run/``); only if neither exists is ``logpath`` itself a file to read.

    Args:
        logpath: A log path, with or without suffix.

    Returns:
        The path of an existing file.

    Raises:
        FileNotFoundError: If no file exists under any of these names (the message
            lists the names tried and the fix).
        LogFileError: If ``logpath`` is a folder and no log file sits beside it.
    """
    logpath = os.fspath(logpath)
    if logpath.endswith(LOG_SUFFIXES):
        candidates = [logpath]
    else:
        candidates = [logpath + suffix for suffix in LOG_SUFFIXES] + [logpath]
    for candidate in candidates:
        if os.path.isfile(candidate):
            return candidate
    if os.path.isdir(logpath):
        raise LogFileError(
            logpath,
            "is a folder, not a cockpit log, and there is no "
            f"{logpath + '.json'!r} or {logpath + '.jsonl'!r} beside it. Fix: pass "
            "the log file (the path given to Cockpit.write or Cockpit(logpath=...)).",
        )
    if len(candidates) == 1:
        missing = f"No cockpit log at {logpath!r}: the file does not exist."
    else:
        tried = ", ".join(repr(c) for c in candidates)
        missing = f"No cockpit log at {logpath!r}: none of {tried} exists."
    raise FileNotFoundError(
        f"{missing} Fix: pass the path given to Cockpit.write() or "
        "Cockpit(..., logpath=...)."
    )


#: Leading bytes of file kinds that people pass by mistake, and their names.
_SIGNATURES = (
    (b"\x89PNG\r\n\x1a\n", "a PNG image"),
    (b"GIF8", "a GIF image"),
    (b"\xff\xd8\xff", "a JPEG image"),
    (b"%PDF", "a PDF document"),
    (b"PK\x03\x04", "a zip archive (a torch.save checkpoint is one)"),
)

_FIX = (
    "Fix: pass a log written by Cockpit.write(path) or streamed by "
    "Cockpit(..., logpath=path), or by cockpit-for-pytorch 1.0.2"
)


def _binary_kind(data: bytes) -> str:
    for signature, name in _SIGNATURES:
        if data.startswith(signature):
            return name
    return "binary data"


def _json_problem(error: json.JSONDecodeError) -> str:
    """Describe why a file is not valid JSON: cut short, or something else."""
    rest = error.doc[error.pos :].strip()
    if not rest or error.msg.startswith("Unterminated string"):
        return (
            f"is truncated: its JSON data stops in the middle (line {error.lineno}), "
            "so it was cut while being written or copied. Fix: write or copy the "
            "log again"
        )
    if error.msg == "Extra data":
        return (
            "holds more than one JSON value (JSON lines without the first line of a "
            f"streamed cockpit log), so it is not a cockpit log. {_FIX}"
        )
    return (
        f"is not valid JSON ({error.msg} at line {error.lineno}, column "
        f"{error.colno}), so it is not a cockpit log. {_FIX}"
    )


def parse_json_log(path: str, data: bytes) -> dict[int, dict[str, Any]]:
    """Parse the bytes of a log in standard JSON (ours or 1.0.2's).

    Args:
        path: The file the bytes come from (for messages).
        data: Its content.

    Returns:
        ``{step: {key: value}}`` with plain Python values, steps as ``int``.

    Raises:
        LogFileError: If the data is not a cockpit log: binary, not JSON, cut short,
            or JSON of another shape than ``{step: {key: value}}``.
    """
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        kind = _binary_kind(data)
        raise LogFileError(
            path, f"is {kind}, not a cockpit log (logs are JSON text). {_FIX}."
        ) from None
    if not text.strip():
        raise LogFileError(path, f"holds only whitespace, no log data. {_FIX}.")
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as error:
        raise LogFileError(path, _json_problem(error) + ".") from None
    if not isinstance(raw, dict):
        raise LogFileError(
            path,
            f"holds a JSON {_json_kind(raw)}, but a cockpit log is a JSON object "
            f'that maps step numbers to {{key: value}} objects ({{"0": {{"Loss": '
            f"2.3}}, ...}}). {_FIX}.",
        )
    log: dict[int, dict[str, Any]] = {}
    for key, entries in raw.items():
        try:
            step = int(key)
        except ValueError:
            raise LogFileError(
                path,
                f"has the key {key!r} where a cockpit log has step numbers, so it "
                f"is JSON of some other kind. {_FIX}.",
            ) from None
        if not isinstance(entries, dict):
            raise LogFileError(
                path,
                f"holds a JSON {_json_kind(entries)} for step {key}, but a cockpit "
                f"log holds a {{key: value}} object per step. {_FIX}.",
            )
        try:
            log[step] = decode(entries)
        except (ValueError, TypeError, KeyError) as error:
            raise LogFileError(
                path, f"holds a value at step {key} that cannot be read ({error})."
            ) from None
    return log


def _json_kind(value: Any) -> str:
    """The JSON name of the type of a parsed value."""
    if isinstance(value, list):
        return "list"
    if isinstance(value, str):
        return "string"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if value is None:
        return "null"
    return "object"


# --- reading a log step by step -------------------------------------------------------
def is_tagged(value: Any) -> bool:
    """Whether a value as written is one tagged number or array, not a mapping."""
    if not isinstance(value, dict):
        return False
    if NDARRAY_TAG in value:
        return True
    return len(value) == 1 and (
        FLOAT_TAG in value or LINSPACE_TAG in value or SPARSE_TAG in value
    )


class NotStreamable(ValueError):
    """A log that :func:`json_log_steps` cannot read step by step (read it whole)."""


_WHITESPACE = " \t\n\r"


def json_log_steps(
    handle, chunk: int = 1 << 22, spans: list | None = None
) -> Iterator[tuple[int, dict]]:
    """Yield ``(step, entries)`` of a log in standard JSON, one step at a time.

    Holds one chunk of text and about two steps' text at a time in memory, whatever
    the size of the log. The entries are as written (pass them to :func:`decode`);
    steps come in the order of the file.

    Args:
        handle: The log, opened in binary mode.
        chunk: Bytes read at a time.
        spans: If given, before each step is yielded ``(start, end)`` of its
            entries' JSON text is appended: byte offsets in the file as long as
            the file read so far is ASCII (cockpit's and json_tricks' logs are),
            else ``None`` (the offsets of characters would not be those of bytes).

    Raises:
        NotStreamable: For anything but a JSON object of ``{"<int>": {...}}``
            (read such a file with :func:`parse_json_log`, which says what is
            wrong with it).
    """
    decoder = json.JSONDecoder()
    utf8 = codecs.getincrementaldecoder("utf-8")()
    text, pos, done = "", 0, False
    base, ascii_only = 0, True  # offset of text[0] in the file; all bytes ASCII?

    def refill() -> bool:
        nonlocal text, pos, done, base, ascii_only
        if done:
            return False
        data = handle.read(chunk)
        ascii_only = ascii_only and data.isascii()
        try:
            more = utf8.decode(data, final=not data)
        except UnicodeDecodeError as error:
            raise NotStreamable("not UTF-8") from error
        done = not data
        base += pos
        text, pos = text[pos:] + more, 0
        return True

    def skip_space() -> str:
        nonlocal pos
        while True:
            while pos < len(text) and text[pos] in _WHITESPACE:
                pos += 1
            if pos < len(text):
                return text[pos]
            if not refill():
                raise NotStreamable("ends early")

    def value() -> Any:
        nonlocal pos
        tried = 0  # the text a parse that fell short saw: parse again once doubled
        while True:  # (parsing again after every chunk is quadratic in the value)
            if len(text) - pos >= 2 * tried or done:
                try:
                    parsed, end = decoder.raw_decode(text, pos)
                except json.JSONDecodeError:
                    parsed, end = None, None
                # a value that ends with the text may go on in the next chunk
                if end is not None and (end < len(text) or done):
                    pos = end
                    return parsed
                tried = len(text) - pos
            if not refill():
                raise NotStreamable("invalid or truncated JSON")

    if skip_space() != "{":
        raise NotStreamable("not a JSON object")
    pos += 1
    if skip_space() == "}":
        pos += 1
        return
    while True:
        key = value()
        if not isinstance(key, str) or skip_space() != ":":
            raise NotStreamable("not a step key")
        pos += 1
        skip_space()
        start = base + pos
        entries = value()
        try:
            step = int(key)
        except ValueError:
            raise NotStreamable("not a step key") from None
        if not isinstance(entries, dict):
            raise NotStreamable("step without entries")
        if spans is not None:
            spans.append((start, base + pos) if ascii_only else None)
        yield step, entries
        separator = skip_space()
        pos += 1
        if separator == "}":
            break
        if separator != ",":
            raise NotStreamable("invalid JSON")
        skip_space()
    while True:  # only whitespace may follow
        if text[pos:].strip():
            raise NotStreamable("extra data")
        if not refill():
            return
