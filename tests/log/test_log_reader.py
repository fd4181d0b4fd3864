"""Reading a log of any length: :class:`cockpit.log.reader.LogHistory`.

Every value a command reads from a :class:`LogHistory` (what
:func:`cockpit.log.files.open_log` returns) must equal what the whole-file readers
give (:meth:`History.from_json`, and :meth:`History.from_json_latest` for
``latest``), for streamed, written and 1.0.2 logs, with resume markers, torn and
damaged lines, values of changing shapes and estimates; the dashboard's series and
drawn lines must be bit for bit those of the value-by-value path; and memory must
not grow with the histograms. Timing and peak memory of the commands on 200 MB and
1 GB logs are in ``benchmarks/cli_memory.py``.
"""

from __future__ import annotations

import json
import math
import tracemalloc
import warnings

import numpy as np
import pytest

from benchmarks import big_logs
from cockpit.diagnosis.running_median import running_median
from cockpit.errors import CockpitWarning
from cockpit.history import History
from cockpit.log.files import open_log
from cockpit.log.reader import LogHistory, read_log_history
from cockpit.log.stream import _HEADER, record_line
from cockpit.plotting.data import REDUCERS, DashboardData
from tests.utils import expected_warnings as expected

pytestmark = [expected.DAMAGED_LOG]


def same(a, b, path="value"):
    """``a`` and ``b`` are equal, of the same types (arrays: dtype, read-only)."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        assert isinstance(a, np.ndarray) and isinstance(b, np.ndarray), path
        assert (a.dtype, a.shape) == (b.dtype, b.shape), path
        assert np.array_equal(a, b, equal_nan=a.dtype.kind == "f"), path
        assert not a.flags.writeable and not b.flags.writeable, path
        return
    assert type(a) is type(b), (path, a, b)
    if isinstance(a, dict):
        assert set(a) == set(b), (path, sorted(a), sorted(b))
        for key in a:
            same(a[key], b[key], f"{path}/{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            same(x, y, f"{path}[{i}]")
    elif isinstance(a, float):
        assert (math.isnan(a) and math.isnan(b)) or (
            a == b and math.copysign(1, a) == math.copysign(1, b)
        ), (path, a, b)
    else:
        assert a == b, (path, a, b)


def same_history(want: History, got: History, label: str) -> None:
    """Every way to read a history gives the same values."""
    assert isinstance(got, LogHistory), label
    assert want.steps == got.steps and list(want) == list(got), label
    assert want.keys == got.keys and len(want) == len(got), label
    for step in want.steps:
        same(dict(want.view(step)), dict(got.view(step)), f"{label} step {step}")
        same(want[step], got[step], f"{label} [{step}]")
        same(want.missing_at(step), got.missing_at(step), f"{label} missing {step}")
    for key in [*want.keys, "absent"]:
        same(want.series(key), got.series(key), f"{label} series {key}")
        for first, last in [(None, None), (3, 11), (want.steps[-1], None)]:
            same(
                want.stored_series(key, first, last),
                got.stored_series(key, first, last),
                f"{label} {key} {first}-{last}",
            )
    same(want.to_dict(), got.to_dict(), f"{label} to_dict")


def latest_only(whole: History, upto: int | None = None) -> History:
    """``whole`` with only the latest mapping of each key (the documented meaning
    of ``latest``), its steps kept."""
    data = {s: dict(whole.view(s)) for s in whole.steps if upto is None or s <= upto}
    last = {}
    for step, entries in data.items():
        for key, value in entries.items():
            if isinstance(value, dict) and not key.endswith("_estimate"):
                last[key] = step
    history = History()
    for step, entries in data.items():
        history._data[step] = {
            k: v
            for k, v in entries.items()
            if not (isinstance(v, dict) and not k.endswith("_estimate"))
            or last[k] == step
        }
    return history


def odd_stream(path) -> None:
    """A streamed log with what real ones can hold besides numbers per step."""
    hist = {"hist": [1, 2, 3], "edges": [0.0, 1.0, 2.0, 3.0]}
    records = [
        (0, {"Loss": 1.0, "GradNorm": [1.0, 2.0], "H": hist, "name": "a",
             "missing": {"Alpha": "the update was clipped"}}),
        (1, {"Loss": 2, "GradNorm": [1.0, 2.0, 3.0], "H": dict(hist, hist=[1, 2, 4])}),
        (0, {"Alpha": 0.5, "Loss": 1.5}),  # a later value of step 0 wins
        (2, {"Loss": math.nan, "GradNorm": [math.inf, 1.0], "flag": True, "no": None,
             "big": np.linspace(0, 1, 20), "ints": list(range(20)), "neg": -0.0}),
        (3, {}),
        (3, {"Loss": 0.1, "Trace": [2.0, 3.0], "nested": [[1.0, 2.0], [3.0, 4.0]],
             "Trace_estimate": {"stderr": [0.1, 0.2], "stderr_sum": 0.3}}),
        (4, {"Loss": 0.2, "H": dict(hist, hist=[9, 9, 9]), "Trace": [1.0, 1.0],
             "big2d": np.arange(40.0).reshape(4, 10)}),
        (5, {"Loss": 0.3, "H": dict(hist, hist=[5, 5, 5]), "only": {"a": 1}}),
    ]  # fmt: skip
    with open(path, "w") as handle:
        handle.write(_HEADER + "\n")
        for step, values in records:
            handle.write(record_line(step, values))
        handle.write(json.dumps({"resume_after": 4}) + "\n")  # voids 5 (H, only)
        handle.write(record_line(5, {"Loss": 0.35, "GradNorm": [3.0, 4.0]}))
        handle.write(record_line(6, {"Loss": 0.4}))
        handle.write("{not json}\n")
        handle.write(record_line(7, {"Loss": 0.5, "H": dict(hist, hist=[7, 7, 7])}))
        handle.write(json.dumps({"resume_after": 6}) + "\n")  # voids 7
        handle.write(record_line(7, {"Loss": 0.55}))
        handle.write('{"step": 8, "values": {"Loss": 0.6')  # torn


def _logs(tmp_path):
    """(name, path, upto) of logs of every kind the readers read."""
    logs = []
    for kind in ("stream", "json", "legacy"):
        path = tmp_path / f"synthetic.{kind}"
        big_logs.write_log(str(path), kind, 8 if kind == "legacy" else 24, seed=3)
        logs.append((kind, str(path), 17))
    odd = tmp_path / "odd.jsonl"
    odd_stream(odd)
    logs.append(("odd", str(odd), 3))
    whole = History.from_json(logs[0][1])
    for packed in (False, True):
        path = whole.write_json(tmp_path / f"written-{packed}.json", packed=packed)
        logs.append((f"written packed={packed}", path, 11))
    return logs


def _read(reader, *args):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = reader(*args)
    return history, [str(w.message) for w in caught]


def test_a_log_history_reads_what_the_whole_file_readers_read(tmp_path):
    for name, path, upto in _logs(tmp_path):
        whole, said = _read(History.from_json, path)
        mine, told = _read(read_log_history, path)
        assert said == told, name  # torn and damaged lines: the same warnings
        same_history(whole, mine, f"{name} all")
        for cut in (None, upto):
            if b"resume_after" in open(path, "rb").read():  # noqa: SIM115
                want = latest_only(whole, cut)  # from_json_latest read all then
            else:
                want = History.from_json_latest(path, cut)
            same_history(want, read_log_history(path, "latest", cut), f"{name} {cut}")
    assert isinstance(open_log(path), LogHistory)
    assert isinstance(open_log(path, latest=True), LogHistory)


def test_the_dashboard_draws_the_same_series_from_columns(tmp_path):
    """Series made at once from a log's columns are those made value by value:
    steps, values and errors, bit for bit, also thinned (with the trend line)."""
    for name, path, _ in _logs(tmp_path):
        for mode in ("latest", "all"):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", CockpitWarning)
                whole = History.from_json(path)
                if mode == "latest":
                    resumed = b"resume_after" in open(path, "rb").read()  # noqa: SIM115
                    whole = latest_only(whole) if resumed else None
                    whole = whole or History.from_json_latest(path)
                old = DashboardData(whole)
                new = DashboardData(read_log_history(path, mode))
            old.refresh()
            new.refresh()
            assert new.last_step == old.last_step
            for key in [*old.history.keys, "absent"]:
                for reduce in REDUCERS:
                    a, b = old.series(key, reduce), new.series(key, reduce)
                    for part in ("steps", "values", "errors"):
                        x, y = getattr(a, part), getattr(b, part)
                        assert x.dtype == y.dtype, (name, key, reduce, part)
                        assert np.array_equal(x, y, equal_nan=True), (name, key, part)
                    assert a.error_bound == b.error_bound
                    for upto in (None, 5):
                        for x, y in zip(a.view_errors(upto, 8), b.view_errors(upto, 8)):
                            assert np.array_equal(x, y, equal_nan=True)
                for upto in (None, 3, 20):
                    want, got = old.latest(key, upto), new.latest(key, upto)
                    assert (want is None) == (got is None), (name, key, upto)
                    if want is not None:
                        assert want[0] == got[0]
                        same(dict(want[1]), dict(got[1]), f"{name} {key} latest")


def test_the_drawn_dashboard_is_the_same(tmp_path):
    """Every line, patch and image of the dashboard of a log, drawn from the old
    reader's history and from a LogHistory, holds the same data."""
    from cockpit import CockpitPlotter

    path = tmp_path / "run.jsonl"
    big_logs.write_log(str(path), "stream", 60, seed=1)
    drawn = []
    for history in (History.from_json_latest(path), open_log(path, latest=True)):
        plotter = CockpitPlotter(secondary_screen=True)
        plotter.plot(history, show_plot=False)
        figures = [plotter.fig, getattr(plotter, "fig_secondary", None)]
        items = []
        for fig in figures:
            if fig is None:
                continue
            for ax in fig.axes:
                for line in ax.get_lines():
                    items.append(np.asarray(line.get_xydata(), dtype=float))
                for image in ax.get_images():
                    items.append(np.asarray(image.get_array(), dtype=float))
                for collection in ax.collections:
                    items.append(np.asarray(collection.get_offsets(), dtype=float))
                items.append([t.get_text() for t in ax.texts])
        drawn.append(items)
    assert len(drawn[0]) == len(drawn[1]) > 20
    for a, b in zip(*drawn):
        if isinstance(a, list):
            assert a == b
        else:
            assert a.shape == b.shape and np.array_equal(a, b, equal_nan=True)


def test_memory_grows_with_the_numbers_not_the_histograms(tmp_path):
    """A LogHistory holds about 8 bytes per number, none of the histograms; a
    pass over every step's histograms (a report, an export) holds one step."""
    path = tmp_path / "run.jsonl"
    steps = 400
    big_logs.write_log(str(path), "stream", steps)
    size = path.stat().st_size
    history = read_log_history(str(path))
    numbers = 7 + 1 + 4 * big_logs.PARAMS  # scalars, learning rate, 4 lists
    assert history.memory_bytes() < steps * (8 * numbers + 200)
    assert history.memory_bytes() < size / 4
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _, entries in history.items():
            assert len(entries["GradHist2d"]["hist"]) == big_logs.BINS_2D[0]
        peak = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
    assert peak < 2_000_000  # one step's histograms as lists, not 400 steps'


def test_a_damaged_histogram_is_skipped_with_a_warning(tmp_path):
    path = tmp_path / "run.jsonl"
    bad = {"hist": {"__sparse__": {"shape": [2], "skip": [5], "values": [1]}}}
    with open(path, "w") as handle:
        handle.write(_HEADER + "\n")
        handle.write(record_line(0, {"Loss": 1.0, "H": {"hist": [1], "edges": [0.0]}}))
        handle.write(json.dumps({"step": 1, "values": {"Loss": 2.0, "H": bad}}) + "\n")
    history = open_log(path)
    assert history.view(0)["H"] == {"hist": [1], "edges": [0.0]}
    with pytest.warns(CockpitWarning, match="Skipped H at step 1 .* cannot be read"):
        assert history.view(1)["H"] is None
    assert history[1]["Loss"] == 2.0


def test_writing_into_a_log_history_makes_it_an_ordinary_one(tmp_path):
    path = tmp_path / "run.jsonl"
    big_logs.write_log(str(path), "stream", 5)
    history = open_log(path)
    whole = History.from_json(path)
    history.add(9, "Loss", 1.0)
    whole.add(9, "Loss", 1.0)
    assert type(history) is History
    same(whole.to_dict(), history.to_dict())


@pytest.mark.parametrize("width", [1, 2, 5, 64, 65, 100, 333])
def test_running_median_is_numpys_median_of_every_window(width):
    rng = np.random.default_rng(width)
    for values in (
        rng.normal(size=700),
        rng.integers(0, 4, 700).astype(float),  # ties
        np.sort(rng.normal(size=700)),
        np.array([1.0, math.nan, 2.0] * 200),
        rng.normal(size=width - 1) if width > 1 else np.ones(0),
    ):
        if len(values) >= width:
            windows = np.lib.stride_tricks.sliding_window_view(values, width)
            want = np.median(windows, axis=1)
        else:
            want = np.array([np.median(values)]) if len(values) else None
        if want is None:
            continue
        got = running_median(values, width)
        assert got.shape == want.shape
        assert np.array_equal(got, want, equal_nan=True)  # bit for bit
