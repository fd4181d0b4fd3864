"""The streamed log survives SIGKILL; torn records are skipped (issue 5, part 2)."""

import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import threading
import warnings

import pytest

from cockpit import Cockpit
from cockpit import quantities as Q
from cockpit.errors import CockpitWarning
from cockpit.history import History
from cockpit.log.stream import is_stream_file, read_stream, stream_path
from cockpit.utils.schedules import linear
from tests.utils.problems import make_problem

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EVERY = linear(1)


def train(logpath, steps, report=None):
    """A small deterministic run that streams its log; used in and out of process."""
    problem = make_problem("mlp", "ce", "sgd")
    quantities = [
        Q.Loss(EVERY),
        Q.GradNorm(EVERY),
        Q.Distance(EVERY),
        Q.UpdateSize(EVERY),
        Q.Variance(EVERY),
        Q.GradHist1d(linear(3)),
    ]
    cockpit = Cockpit(problem.params, quantities, logpath=logpath)
    opt = problem.optimizer()
    for step in range(steps):
        x, y = problem.make_batch(step)
        opt.zero_grad()
        out = problem.model(x)
        loss = problem.loss_fn(out, y)
        info = {
            "batch_size": x.shape[0],
            "individual_losses": problem.individual_loss_fn(out, y),
            "loss": loss,
            "optimizer": opt,
        }
        with cockpit(step, info=info):
            loss.backward()
        opt.step()
        if step % 4 == 0:
            cockpit.log(step, step // 4, loss.item(), None, None, 0.5, None, None, 0.1)
        if report is not None:
            report(step)
    return cockpit


def assert_same(got, want, path="value"):
    """Recursive equality with NaN == NaN and a tight relative tolerance."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), (path, got, want)
        for key in want:
            assert_same(got[key], want[key], f"{path}[{key!r}]")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), (path, got, want)
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{path}[{i}]")
    elif isinstance(want, float):
        assert (math.isnan(got) and math.isnan(want)) or math.isclose(
            got, want, rel_tol=1e-12, abs_tol=1e-300
        ), (path, got, want)
    else:
        assert got == want, (path, got, want)


#: Completed steps before the SIGKILL (few, so a loaded machine gets there soon).
KILL_AFTER = 15


def test_sigkill_mid_run_keeps_every_completed_step(tmp_path):
    logpath = str(tmp_path / "run" / "log")
    code = (
        "from tests.log.test_crash_safe_log import train\n"
        f"train({logpath!r}, 10**9, report=lambda s: print('done', s, flush=True))\n"
    )
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    child = subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    watchdog = threading.Timer(600, child.kill)  # generous: CI may be loaded
    watchdog.start()
    last_done = -1
    try:
        for line in child.stdout:
            if line.startswith("done"):
                last_done = int(line.split()[1])
            if last_done >= KILL_AFTER:
                os.kill(child.pid, signal.SIGKILL)  # mid-run, no chance to clean up
                break
        child.wait(timeout=60)
    finally:
        watchdog.cancel()
    assert last_done >= KILL_AFTER, child.stderr.read()
    assert child.returncode == -signal.SIGKILL

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CockpitWarning)  # a torn record is fine here
        got = History.from_json(logpath).to_dict()
    steps = sorted(got)
    assert steps == list(range(steps[-1] + 1))  # no gaps
    assert steps[-1] >= last_done

    # an uninterrupted run of the same length gives the same values
    want = train(str(tmp_path / "reference"), steps[-1] + 1).history.to_dict()
    for step in range(last_done):  # complete steps (UpdateSize needs step + 1)
        assert_same(got[step], want[step], f"step {step}")
    assert {"Loss", "GradNorm", "Distance", "Variance"} <= set(got[last_done])
    for step in steps[last_done:]:  # written after the last report: a subset
        for key, value in got[step].items():
            assert_same(value, want[step][key], f"step {step}")


def _streamed_run(tmp_path, steps=7):
    cockpit = train(str(tmp_path / "log"), steps)
    return cockpit, stream_path(str(tmp_path / "log"))


def test_stream_equals_the_history_and_the_written_log(tmp_path):
    cockpit, path = _streamed_run(tmp_path)
    assert path.endswith("log.jsonl") and is_stream_file(path)
    with open(path) as handle:
        lines = handle.read().splitlines()
    assert json.loads(lines[0]) == {"format": "cockpit-log-stream", "version": 2}
    for line in lines[1:]:
        record = json.loads(line)  # standard JSON, one object per line
        assert set(record) == {"step", "values"}
    output = cockpit.history.to_dict()
    assert_same(read_stream(path), output)
    assert_same(History.from_json(path).to_dict(), output)
    written = cockpit.write(str(tmp_path / "log"))
    assert written.endswith("log.json") and not is_stream_file(written)
    assert_same(History.from_json(str(tmp_path / "log")).to_dict(), output)  # .json
    frame = History.from_json(path).to_dataframe()
    assert list(frame.index) == sorted(output)
    assert frame.loc[4, "epoch_count"] == 1


def test_nonfinite_values_round_trip_through_the_stream(tmp_path):
    problem = make_problem("mlp", "mse")
    cockpit = Cockpit(problem.params, [Q.Loss(EVERY)], logpath=str(tmp_path / "x"))
    cockpit.log(0, 0, math.nan, math.inf, -math.inf, 1.0, None, None, 0.1)
    text = open(cockpit.logpath).read()
    assert "NaN" not in text and "Infinity" not in text
    back = History.from_json(cockpit.logpath)[0]
    assert math.isnan(back["train_loss"]) and back["valid_loss"] == math.inf
    assert back["test_loss"] == -math.inf and back["valid_accuracy"] is None


@pytest.mark.parametrize("where", ["mid-record", "before-newline", "mid-header"])
def test_torn_last_record_is_skipped_with_a_warning(tmp_path, where):
    cockpit, path = _streamed_run(tmp_path)
    data = open(path, "rb").read()
    lines = data.splitlines(keepends=True)
    if where == "mid-header":
        cut = len(lines[0]) // 2
    elif where == "before-newline":
        cut = len(data) - 1  # the last record is complete but its newline is lost
    else:
        cut = len(data) - len(lines[-1]) // 2
    torn = tmp_path / "torn.jsonl"
    torn.write_bytes(data[:cut])
    expected = read_stream_of(b"".join(lines[:-1])) if where == "mid-record" else None
    if where == "before-newline":
        with warnings.catch_warnings():
            warnings.simplefilter("error", CockpitWarning)
            assert_same(History.from_json(torn).to_dict(), cockpit.history.to_dict())
        return
    with pytest.warns(CockpitWarning, match=r"torn last record.*Every earlier step"):
        got = History.from_json(torn).to_dict()
    if where == "mid-header":
        assert got == {}
    else:
        assert_same(got, expected)
        assert got != cockpit.history.to_dict()


def read_stream_of(data):
    """Read the streamed log held in ``data`` (bytes)."""
    with tempfile.NamedTemporaryFile("wb", suffix=".jsonl", delete=False) as handle:
        handle.write(data)
    try:
        return read_stream(handle.name)
    finally:
        os.remove(handle.name)


def test_every_cut_of_the_file_reads_back_the_complete_records(tmp_path):
    cockpit, path = _streamed_run(tmp_path, steps=3)
    data = open(path, "rb").read()
    ends = [i + 1 for i, byte in enumerate(data) if byte == ord("\n")]
    torn = tmp_path / "cut.jsonl"
    for cut in range(0, len(data) + 1, 7):
        torn.write_bytes(data[:cut])
        complete = max([e for e in ends if e <= cut], default=0)
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            got = History.from_json(torn).to_dict()
        want = read_stream_of(data[:complete]) if complete > ends[0] else {}
        if cut in ends or cut == 0:
            assert not record, cut
            assert_same(got, want)
        else:  # a torn record: skipped with a warning, unless it happens to parse
            assert len(record) <= 1 and all("torn" in str(w.message) for w in record)
            if record:
                assert_same(got, want)


def test_damaged_middle_line_is_skipped_with_a_warning(tmp_path):
    cockpit, path = _streamed_run(tmp_path, steps=4)
    lines = open(path).read().splitlines(keepends=True)
    lines[2] = '{"step": 1, "val\n'
    broken = tmp_path / "broken.jsonl"
    broken.write_text("".join(lines))
    with pytest.warns(CockpitWarning, match=r"Skipped line 3 .*not valid JSON"):
        got = History.from_json(broken).to_dict()
    assert sorted(got) == sorted(cockpit.history.to_dict())


def test_new_run_replaces_an_old_stream(tmp_path):
    _streamed_run(tmp_path, steps=6)
    cockpit, path = _streamed_run(tmp_path, steps=2)
    assert sorted(History.from_json(path).to_dict()) == [0, 1]
    assert_same(History.from_json(path).to_dict(), cockpit.history.to_dict())


def test_a_failing_disk_never_stops_training(tmp_path, monkeypatch):
    problem = make_problem("mlp", "ce")
    cockpit = Cockpit(problem.params, [Q.Loss(EVERY)], logpath=str(tmp_path / "log"))
    opt = problem.optimizer()

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    for step in range(3):
        if step == 1:
            monkeypatch.setattr(cockpit._stream._handle, "write", full_disk)
        x, y = problem.make_batch(step)
        opt.zero_grad()
        loss = problem.loss_fn(problem.model(x), y)
        if step == 1:
            with pytest.warns(CockpitWarning, match=r"No space left.*history stays in"):
                with cockpit(step, info={"loss": loss}):
                    loss.backward()
        else:
            with cockpit(step, info={"loss": loss}):
                loss.backward()
        opt.step()
    assert sorted(cockpit.history.to_dict()) == [0, 1, 2]
    assert sorted(History.from_json(cockpit.logpath).to_dict()) == [0]


def test_plotter_reads_a_streamed_and_torn_log(tmp_path):
    pytest.importorskip("matplotlib")
    from cockpit.cli import main
    from cockpit.plotting import CockpitPlotter

    cockpit, path = _streamed_run(tmp_path, steps=6)
    with open(path, "ab") as handle:
        handle.write(b'{"step": 6, "values": {"Lo')  # torn by a crash
    plotter = CockpitPlotter()
    with pytest.warns(CockpitWarning, match="torn last record"):
        plotter.plot(path, show_plot=False)
    out = tmp_path / "dash.png"
    with pytest.warns(CockpitWarning, match="torn last record"):
        assert main(["plot", path, "-o", str(out)]) == 0
    assert out.exists() and out.stat().st_size > 0


def test_resuming_onto_a_written_log_converts_it_to_a_stream(tmp_path):
    from cockpit.log.stream import LogStream

    path = tmp_path / "run.json"  # e.g. Cockpit.write and logpath gave one name
    History({0: {"Loss": 1.0, "GradNorm": [math.inf]}}).write_json(path)
    stream = LogStream(path)
    stream.resume(None)
    stream.write({1: {"Loss": 0.5}})
    stream.close()
    assert is_stream_file(path)
    got = History.from_json(path).to_dict()
    assert got == {0: {"Loss": 1.0, "GradNorm": [math.inf]}, 1: {"Loss": 0.5}}


def test_a_record_with_unreadable_values_is_skipped_with_a_warning(tmp_path):
    path = tmp_path / "run.jsonl"
    path.write_text(
        '{"format":"cockpit-log-stream","version":1}\n'
        '{"step":"zero","values":{"Loss":1.0}}\n'
        '{"step":1,"values":{"Loss":0.5}}\n'
    )
    with pytest.warns(CockpitWarning, match=r"Skipped line 2 .*cannot be read"):
        assert History.from_json(path).to_dict() == {1: {"Loss": 0.5}}


def test_a_stream_of_a_newer_version_is_a_log_file_error(tmp_path):
    from cockpit.errors import LogFileError

    path = tmp_path / "run.jsonl"
    path.write_text('{"format":"cockpit-log-stream","version":3}\n')
    with pytest.raises(LogFileError, match=r"version 3, newer .*Fix: upgrade"):
        History.from_json(path)
