"""Read what an offline W&B run wrote: the records of its ``run-<id>.wandb`` file.

wandb 0.31 has no Python reader of its transaction log any more (the Go core
writes it), so this reads the format itself: a 7-byte header (``:W&B``, a 2-byte
magic and a version byte), then LevelDB log records (32 KiB blocks, each record
a 7-byte header: CRC32C, length, type FULL/FIRST/MIDDLE/LAST) holding wandb's own
protobuf ``Record`` messages (``wandb.proto.wandb_internal_pb2``), parsed here with
wandb's classes.
"""

from __future__ import annotations

import glob
import json
import os
import struct
import time

BLOCK = 32768
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: str) -> list:
    """Every ``Record`` of a ``.wandb`` file, in order."""
    from wandb.proto import wandb_internal_pb2

    with open(path, "rb") as file:
        data = file.read()
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    found, pending, offset = [], b"", HEADER
    while offset + HEADER <= len(data):
        room = BLOCK - offset % BLOCK
        if room < HEADER:  # the block's tail is padding
            offset += room
            continue
        _, length, kind = struct.unpack("<IHB", data[offset : offset + HEADER])
        if kind == 0 and length == 0:  # zero padding
            offset += room
            continue
        chunk = data[offset + HEADER : offset + HEADER + length]
        offset += HEADER + length
        if kind == FULL:
            pending = chunk
        elif kind == FIRST:
            pending = chunk
            continue
        elif kind == MIDDLE:
            pending += chunk
            continue
        else:  # LAST
            pending += chunk
        record = wandb_internal_pb2.Record()
        record.ParseFromString(pending)
        found.append(record)
        pending = b""
    return found


#: Longest wait for an offline run's file to hold its ``exit`` record, in seconds.
WRITTEN_TIMEOUT = 60.0


def run_file(folder: str) -> str:
    """The ``.wandb`` file of the one offline run under ``folder``, once complete.

    wandb's core process writes the file after ``run.finish()`` has returned (on a
    busy machine its last records, the summary among them, came a moment later:
    seen as a summary without ``cockpit/diagnosis``), so this waits (bounded) for
    the run's ``exit`` record, the last one written.
    """
    found = glob.glob(os.path.join(folder, "**", "run-*.wandb"), recursive=True)
    (path,) = {os.path.realpath(p) for p in found}  # latest-run links to it
    deadline = time.monotonic() + WRITTEN_TIMEOUT
    while not _has_exit(path):
        if time.monotonic() > deadline:
            raise AssertionError(
                f"{path} has no exit record {WRITTEN_TIMEOUT:.0f} s after the run "
                "finished"
            )
        time.sleep(0.1)
    return path


def _has_exit(path: str) -> bool:
    try:
        return any(r.WhichOneof("record_type") == "exit" for r in records(path))
    except Exception:  # noqa: BLE001 - a record still being written
        return False


def history_rows(path: str) -> list[dict]:
    """The rows of ``run.log`` calls: ``{key: value}`` (values decoded from JSON;
    a histogram as its dict, ``{"_type": "histogram", "values": ..., "bins": ...}``)."""
    rows = []
    for record in records(path):
        if record.WhichOneof("record_type") != "history":
            continue
        row: dict = {}
        for item in record.history.item:
            path = [item.key] if item.key else list(item.nested_key)
            where = row
            for part in path[:-1]:  # media: {"_type": ..., "values": ...} nested
                where = where.setdefault(part, {})
            where[path[-1]] = json.loads(item.value_json)
        rows.append(row)
    return rows


def summary(path: str) -> dict:
    """The run's summary as the last summary records set it."""
    found = {}
    for record in records(path):
        if record.WhichOneof("record_type") == "summary":
            for item in record.summary.update:
                key = item.key or "/".join(item.nested_key)
                found[key] = json.loads(item.value_json)
    return found


def of_type(path: str, kind: str) -> list:
    """The records of one type (``"alert"``, ``"artifact"``, ``"files"``, ...)."""
    return [
        getattr(r, kind) for r in records(path) if r.WhichOneof("record_type") == kind
    ]
