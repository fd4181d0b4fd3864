"""Long runs: packed logs, reading logs step by step, thinning series to their extremes.

Nothing is timed here (see ``benchmarks/long_runs.py``); these tests check that packed
logs give back exactly the values written, that every reader still reads them, and that
reading a log for the dashboard keeps what the gauges draw.
"""

import io
import json
import math
import warnings

import numpy as np
import pytest
from matplotlib.figure import Figure

from cockpit import CockpitPlotter
from cockpit.cli import main
from cockpit.errors import CockpitWarning, LogFileError
from cockpit.history import History
from cockpit.log.format import (
    LINSPACE_TAG,
    SPARSE_TAG,
    compact,
    decode,
    encode,
    expand,
    pack,
)
from cockpit.log.json_file import NotStreamable, json_log_steps
from cockpit.log.stream import LogStream
from cockpit.plotting import instruments
from cockpit.plotting.data import MAX_POINTS, as_data, extremes_index, read_log


def full_record(rng, step):
    """Values shaped like those of the ``full`` configuration (random numbers)."""
    edges_1d = np.linspace(-2.0, 2.0, 101)
    edges_x, edges_y = np.linspace(-1.0, 1.0, 41), np.linspace(-2.0, 2.0, 51)
    counts_1d = np.histogram(rng.normal(0, 0.4, 5000), edges_1d)[0]
    joint = np.histogram2d(
        rng.normal(0, 0.1, 5000), rng.normal(0, 0.3, 5000), [edges_x, edges_y]
    )[0].astype(int)
    return {
        "Loss": float(2 * math.exp(-step / 50) + 0.1 * rng.random()),
        "Alpha": float(rng.normal()),
        "GradNorm": rng.random(4).tolist(),
        "Distance": rng.random(4).tolist(),
        "UpdateSize": rng.random(4).tolist(),
        "HessTrace": rng.normal(5, 1, 4).tolist(),
        "HessMaxEV": float(rng.uniform(1, 10)),
        "NormTest": float(rng.random()),
        "InnerTest": float(rng.random()),
        "OrthoTest": float(rng.random()),
        "TICDiag": float(rng.uniform(100, 1000)),
        "GradHist1d": {"hist": counts_1d.tolist(), "edges": edges_1d.tolist()},
        "GradHist2d": {
            "hist": joint.tolist(),
            "edges": [edges_x.tolist(), edges_y.tolist()],
        },
    }


def full_history(steps, seed=0):
    rng = np.random.default_rng(seed)
    return History({step: full_record(rng, step) for step in range(steps)})


# --- packing values ---------------------------------------------------------------
def round_trip(value):
    stored = compact(value)
    text = json.dumps(pack(stored), allow_nan=False)
    return json.loads(text), decode(json.loads(text)), expand(stored)


def test_histogram_edges_are_packed_as_linspace_and_come_back_exactly():
    edges = np.linspace(-0.37, 1.91, 101)
    written, read, expected = round_trip({"edges": edges})
    assert written["edges"] == {LINSPACE_TAG: [edges[0], edges[-1], 101]}
    assert read == expected and read["edges"] == edges.tolist()


def test_floats_that_are_not_evenly_spaced_stay_lists():
    values = np.linspace(0.0, 1.0, 20)
    values[7] = np.nextafter(values[7], 2.0)  # one ulp off
    written, read, expected = round_trip(values)
    assert written == values.tolist() and read == expected


def test_mostly_zero_counts_are_sparse_and_come_back_exactly():
    counts = np.zeros((40, 50), dtype=np.int64)
    counts[0, 0], counts[3, 7], counts[39, 49], counts[20, 20] = 5, 123456789, -2, 1
    written, read, expected = round_trip({"hist": counts})
    sparse = written["hist"][SPARSE_TAG]
    assert sparse["shape"] == [40, 50]
    assert sparse["values"] == [5, 123456789, 1, -2]
    assert sparse["skip"] == [0, 156, 862, 978]  # flat indices 0, 157, 1020, 1999
    assert read == expected and np.array_equal(read["hist"], counts)


@pytest.mark.parametrize("shape", [(16,), (100,), (4, 5, 6)])
def test_all_zero_and_dense_integer_arrays_round_trip(shape):
    zeros = np.zeros(shape, dtype=np.int64)
    written, read, expected = round_trip(zeros)
    assert written[SPARSE_TAG]["values"] == [] and read == expected
    dense = np.arange(1, zeros.size + 1).reshape(shape)
    written, read, expected = round_trip(dense)
    assert written == dense.tolist() and read == expected


def test_equal_length_edges_block_and_nonfinite_values_round_trip():
    edges = np.stack([np.linspace(-1, 1, 21), np.linspace(-3, 3, 21)])
    value = {"hist": np.eye(20, dtype=int), "edges": edges, "x": [math.nan] * 20}
    written, read, expected = round_trip(value)
    assert written["edges"][1] == {LINSPACE_TAG: [-3.0, 3.0, 21]}
    assert read["edges"] == expected["edges"]
    assert all(math.isnan(v) for v in read["x"])


def test_small_arrays_and_scalars_are_written_as_encode_writes_them():
    value = {"a": [1, 0, 0], "b": math.inf, "c": None, "d": "text"}
    assert pack(compact(value)) == encode(value)


# --- written logs -------------------------------------------------------------------
def test_packed_log_is_small_standard_json_one_line_per_step(tmp_path):
    history = full_history(20)
    path = history.write_json(tmp_path / "run.json")
    text = open(path).read()
    lines = text.splitlines()
    assert lines[0] == "{" and lines[-1] == "}" and len(lines) == 20 + 2
    assert set(json.loads(text)) == {str(step) for step in range(20)}
    assert len(text.encode()) / 20 < 5000  # the plain layout takes about 33 KB
    read = History.from_json(path)
    assert read.to_dict() == history.to_dict()
    for key in ("GradHist1d", "GradHist2d"):
        assert np.array_equal(
            read.to_output()[19][key]["hist"], history.to_output()[19][key]["hist"]
        )
    frame = read.to_dataframe()
    assert list(frame.index) == list(range(20))
    assert frame.loc[7, "GradHist2d"] == history[7]["GradHist2d"]


def test_plain_and_legacy_logs_stay_available(tmp_path):
    history = full_history(3)
    plain = open(history.write_json(tmp_path / "p.json", packed=False)).read()
    assert LINSPACE_TAG not in plain and SPARSE_TAG not in plain
    assert plain.startswith('{\n  "0": {\n')  # indent 2, as before packing
    assert json.loads(plain) == {str(s): v for s, v in history.to_dict().items()}
    legacy = open(history.write_json(tmp_path / "l.json", legacy=True)).read()
    assert "__ndarray__" in legacy and LINSPACE_TAG not in legacy
    assert History.from_json(tmp_path / "l.json").to_dict() == history.to_dict()


def test_a_damaged_packed_value_is_a_log_file_error(tmp_path):
    bad = {SPARSE_TAG: {"shape": [2, 2], "skip": [5], "values": [1]}}
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"0": {"GradHist2d": {"hist": bad, "edges": []}}}))
    with pytest.raises(LogFileError, match="cannot be read"):
        History.from_json(path)


# --- streamed logs -------------------------------------------------------------------
def test_streamed_records_are_packed_and_a_torn_one_loses_only_its_step(tmp_path):
    history = full_history(6)
    stream = LogStream(str(tmp_path / "run"))
    for step in history.steps:
        stream.write({step: history[step]})
    stream.close()
    data = open(stream.path, "rb").read()
    lines = data.splitlines(keepends=True)
    assert all(len(line) < 5000 for line in lines)
    assert SPARSE_TAG.encode() in lines[1] and LINSPACE_TAG.encode() in lines[1]
    assert History.from_json(stream.path).to_dict() == history.to_dict()
    start = len(data) - len(lines[-1])
    for cut in (start + 1, start + len(lines[-1]) // 2, len(data) - 2):
        torn = tmp_path / f"torn{cut}.jsonl"
        torn.write_bytes(data[:cut])
        with pytest.warns(CockpitWarning, match="torn last record"):
            read = History.from_json(torn)
        assert read.to_dict() == {s: history[s] for s in range(5)}


# --- reading step by step -------------------------------------------------------------
@pytest.mark.parametrize("chunk", [1, 7, 1000, 1 << 22])
def test_json_log_steps_reads_what_json_reads(tmp_path, chunk):
    history = full_history(4)
    for packed in (True, False):
        path = history.write_json(tmp_path / f"{packed}.json", packed=packed)
        data = open(path, "rb").read()
        steps = list(json_log_steps(io.BytesIO(data), chunk))
        assert {str(step): entries for step, entries in steps} == json.loads(data)


@pytest.mark.parametrize(
    "data",
    [b"", b"[1]", b'{"a": {}}', b'{"1": {}', b'{"1": {}} x', b'{"1": 2}', b"\x89PNG"],
)
def test_json_log_steps_refuses_what_is_no_log(data):
    with pytest.raises(NotStreamable):
        list(json_log_steps(io.BytesIO(data), 2))


def series_of(data, key, reduce="scalar"):
    steps, values, _ = data.series(key, reduce).view(max_points=None)
    return steps.tolist(), values.tolist()


@pytest.mark.parametrize("kind", ["packed", "plain", "streamed"])
def test_read_log_keeps_every_series_value_and_the_latest_histograms(tmp_path, kind):
    history = full_history(30)
    if kind == "streamed":
        stream = LogStream(str(tmp_path / "run"))
        for step in history.steps:
            stream.write({step: history[step]})
        stream.close()
        path = stream.path
    else:
        path = history.write_json(tmp_path / "run.json", packed=kind == "packed")
    whole = as_data(history)
    for upto in (None, 17):
        thin = read_log(path, upto=upto)
        assert thin.log == path
        last = 29 if upto is None else upto
        assert thin.history.steps == list(range(last + 1))
        for key, reduce in [("Loss", "scalar"), ("GradNorm", "norm")]:
            steps, values = series_of(whole, key, reduce)
            assert series_of(thin, key, reduce) == (
                steps[: last + 1],
                values[: last + 1],
            )
        for key in ("GradHist1d", "GradHist2d"):
            step, value = thin.latest(key)
            assert step == last and expand(dict(value)) == history[last][key]
            kept = [s for s in thin.history.steps if key in thin.history.view(s)]
            assert kept == [last]  # earlier histograms are not held


def test_read_log_honours_resume_markers_and_warns_once_per_torn_record(tmp_path):
    history = full_history(8)
    path = tmp_path / "run.jsonl"
    stream = LogStream(str(path))
    stream.write({s: history[s] for s in range(6)})
    stream.close()
    resumed = LogStream(str(path))
    resumed.resume(3)  # the checkpoint was at step 3: steps 4, 5 are void
    resumed.write({4: history[4], 5: history[5], 6: history[6]})
    resumed.close()
    with open(path, "ab") as handle:
        handle.write(b'{"step":7,"values":{"Lo')
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        thin = read_log(path)
    torn = [w for w in caught if "torn last record" in str(w.message)]
    assert len(torn) == 1
    assert thin.history.steps == list(range(7))
    assert thin.latest("GradHist2d")[0] == 6
    with pytest.warns(CockpitWarning, match="torn last record"):
        whole = as_data(History.from_json(path))
    assert series_of(thin, "Loss") == series_of(whole, "Loss")


def test_read_log_reports_bad_files_like_the_history_reader(tmp_path):
    path = tmp_path / "image.json"
    path.write_bytes(b"\x89PNG\r\n\x1a\nrest")
    with pytest.raises(LogFileError) as from_history:
        History.from_json(path)
    with pytest.raises(LogFileError) as from_read_log:
        read_log(path)
    assert str(from_read_log.value) == str(from_history.value)


def test_plot_of_a_path_draws_the_latest_histogram_up_to_discard(tmp_path):
    history = full_history(12)
    path = history.write_json(tmp_path / "run.json")
    plotter = CockpitPlotter()
    plotter.plot(str(path), show_plot=False, discard=8)
    assert plotter.data.latest("GradHist1d")[0] == 8
    frame = plotter.tracking_data  # the whole log, histograms included
    assert list(frame["iteration"]) == list(range(9))
    assert frame.loc[3, "GradHist1d"] == history[3]["GradHist1d"]


def test_cockpit_plot_reads_packed_and_streamed_logs(tmp_path, capsys):
    history = full_history(5)
    packed = history.write_json(tmp_path / "run.json")
    stream = LogStream(str(tmp_path / "live"))
    stream.write({s: history[s] for s in history.steps})
    stream.close()
    for log in (packed, stream.path):
        out = tmp_path / "out.png"
        assert main(["plot", str(log), "-o", str(out), "--discard", "3"]) == 0
        assert out.stat().st_size > 0
        out.unlink()
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert main(["plot", str(empty), "-o", str(tmp_path / "x.png")]) == 1
    assert "is empty" in capsys.readouterr().err


# --- thinning series ------------------------------------------------------------------
def test_extremes_index_keeps_spikes_the_last_point_and_a_bound():
    rng = np.random.default_rng(1)
    values = rng.normal(size=50_001)
    values[12_345], values[40_000] = 80.0, -80.0
    values[777], values[3000] = math.nan, math.inf
    index = extremes_index(values, MAX_POINTS)
    assert len(index) <= MAX_POINTS + 1
    assert 12_345 in index and 40_000 in index and index[-1] == 50_000
    assert np.all(np.diff(index) > 0)
    assert extremes_index(values[:100], MAX_POINTS) == slice(0, 100)


def test_extremes_index_keeps_the_chosen_points_while_the_run_grows():
    values = np.random.default_rng(2).normal(size=9000)
    before = set(extremes_index(values[:8500], 1000).tolist())
    after = set(extremes_index(values, 1000).tolist())
    stride = 2 ** math.ceil(math.log2(2 * 8500 / 998))
    complete = 8500 - 8500 % stride
    assert {i for i in before if i < complete} <= after


def test_a_spike_in_a_long_series_is_drawn():
    history = History({s: {"GradNorm": [1.0]} for s in range(4 * MAX_POINTS)})
    history.add(4321, "GradNorm", [1000.0])
    ax = Figure().add_subplot()
    instruments.plot_grad_norm(ax, history)
    offsets = ax.collections[0].get_offsets()
    assert len(offsets) <= MAX_POINTS + 1
    assert 1000.0 in offsets[:, 1] and offsets[-1, 0] == 4 * MAX_POINTS - 1
