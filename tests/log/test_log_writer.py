"""Issue 28: a streamed log has one writer, survives its file being removed, and a
failed disk or a crash in ``write()`` leaves nothing behind that raises or lingers."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest

from cockpit import Cockpit
from cockpit import quantities as Q
from cockpit.errors import CockpitWarning
from cockpit.history import History
from cockpit.log.lock import LogInUseError
from cockpit.log.stream import LogStream, read_stream
from cockpit.utils.schedules import linear
from tests.utils.problems import make_problem

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EVERY = linear(1)
#: A process that holds a log's lock (the lock module alone: no torch to import).
HOLDER = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("log_lock", sys.argv[1])
log_lock = importlib.util.module_from_spec(spec)
spec.loader.exec_module(log_lock)
lock = log_lock.WriterLock(sys.argv[2])
try:
    lock.acquire()
except log_lock.LogInUseError as error:
    print("refused:", error, flush=True)
    sys.exit(3)
print("holding", flush=True)
sys.stdin.read()
"""


def _cockpit(path):
    problem = make_problem("mlp", "ce", "sgd")
    return Cockpit(problem.params, [Q.Loss(EVERY)], logpath=str(path)), problem


def _steps(cockpit, problem, steps):
    for step in steps:
        x, y = problem.make_batch(step)
        problem.model.zero_grad()
        loss = problem.loss_fn(problem.model(x), y)
        with cockpit(step, info={"loss": loss}):
            loss.backward()


def _holder(*args):
    lock = os.path.join(ROOT, "cockpit", "log", "lock.py")
    return subprocess.Popen(
        [sys.executable, "-c", HOLDER, lock, *args],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip


def test_a_second_cockpit_on_the_same_log_is_refused_naming_the_first(tmp_path):
    first, problem = _cockpit(tmp_path / "run")
    _steps(first, problem, [0, 1])
    with pytest.raises(LogInUseError) as refused:
        _cockpit(tmp_path / "run")
    message = str(refused.value)
    assert f"process {os.getpid()} (this process)" in message and "since" in message
    assert "another logpath" in message and "load_state_dict" in message
    assert isinstance(refused.value, OSError)
    _steps(first, problem, [2])  # the first writes on, undamaged
    assert sorted(read_stream(first.logpath)) == [0, 1, 2]
    first.close()
    second, problem = _cockpit(tmp_path / "run")  # closed: free again
    del second
    third, problem = _cockpit(tmp_path / "run")  # dropped: free again
    assert third.logpath == first.logpath


def test_another_process_is_refused_and_a_killed_writer_leaves_no_lock(tmp_path):
    cockpit, problem = _cockpit(tmp_path / "run")
    child = _holder(cockpit.logpath)
    try:
        line = child.stdout.readline()  # "refused: ...", not "holding"
        assert line.startswith("refused:") and f"process {os.getpid()} on" in line
        assert child.wait(timeout=60) == 3
    finally:
        child.kill()
        child.wait(timeout=60)
    cockpit.close()
    child = _holder(cockpit.logpath)
    try:
        assert child.stdout.readline() == "holding\n"
        with pytest.raises(LogInUseError, match=f"process {child.pid} on .*since"):
            _cockpit(tmp_path / "run")
    finally:
        child.kill()  # no chance to clean up
        child.wait(timeout=60)
    again, problem = _cockpit(tmp_path / "run")  # the OS let go of the lock
    _steps(again, problem, [0])
    again.close()
    assert os.listdir(tmp_path) == ["run.jsonl"]  # nothing beside the log


@pytest.mark.parametrize("how", ["deleted", "replaced"])
def test_a_removed_log_is_noticed_and_written_again(tmp_path, how):
    cockpit, problem = _cockpit(tmp_path / "run")
    _steps(cockpit, problem, [0, 1])
    for round, steps in enumerate(([2], [3, 4])):
        if how == "deleted":
            os.remove(cockpit.logpath)
        else:
            (tmp_path / "other").write_text("something else\n")
            os.replace(tmp_path / "other", cockpit.logpath)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _steps(cockpit, problem, steps)
        said = [str(w.message) for w in caught if "deleted or replaced" in str(w)]
        assert len(said) == (1 if round == 0 else 0)  # warned once
        assert read_stream(cockpit.logpath) == cockpit.history.to_dict()


def test_a_stream_without_the_history_writes_the_last_records_again(tmp_path):
    stream = LogStream(tmp_path / "run")
    stream.write({0: {"Loss": 1.0}})
    os.remove(stream.path)
    with pytest.warns(CockpitWarning, match="deleted or replaced"):
        stream.write({1: {"Loss": 0.5}})
    stream.close()
    assert read_stream(stream.path) == {0: {"Loss": 1.0}, 1: {"Loss": 0.5}}


class _FullDisk:
    """A file whose every write, flush and close fails (a full disk)."""

    def __init__(self, handle):
        self.handle = handle

    def fileno(self):
        return self.handle.fileno()

    def _fail(self, *args):
        raise OSError(28, "No space left on device")

    write = flush = close = _fail


def test_close_after_a_failed_write_never_raises_and_says_where_to_write(tmp_path):
    cockpit, problem = _cockpit(tmp_path / "run")
    _steps(cockpit, problem, [0])
    real = cockpit._stream._handle
    cockpit._stream._handle = _FullDisk(real)
    with pytest.warns(CockpitWarning, match="No space left"):
        _steps(cockpit, problem, [1])
    with pytest.warns(CockpitWarning, match=r"lacks the steps.*cockpit\.write\('"):
        cockpit.close()  # the buffered file cannot be closed either: no raise
    real.close()
    path = cockpit.write(str(tmp_path / "run_complete"))
    assert sorted(History.from_json(path).to_dict()) == [0, 1]
    again, problem = _cockpit(tmp_path / "run")  # the lock was let go
    again.close()


@pytest.mark.parametrize("crash", [KeyboardInterrupt, OSError])
def test_no_temporary_file_survives_a_crash_in_write(tmp_path, monkeypatch, crash):
    cockpit, problem = _cockpit(tmp_path / "run")
    _steps(cockpit, problem, [0])

    def interrupted(source, target):
        raise crash("killed while moving the file into place")

    monkeypatch.setattr(os, "replace", interrupted)
    with pytest.raises(crash):
        cockpit.write(str(tmp_path / "written"))
    stream = LogStream(tmp_path / "json.json")  # resumed onto a written log
    monkeypatch.undo()
    History({0: {"Loss": 1.0}}).write_json(tmp_path / "json.json")
    stream.resume(0)
    monkeypatch.setattr(os, "replace", interrupted)
    with pytest.raises(crash):  # the conversion to a stream is interrupted
        stream._open()
    assert [p.name for p in tmp_path.iterdir() if ".tmp" in p.name] == []
