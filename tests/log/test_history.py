import collections
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from cockpit.history import History


def test_round_trip_keeps_nan_inf_and_int_steps(tmp_path):
    h = History()
    h.add(0, "Loss", torch.tensor(1.5))
    h.add(0, "GradNorm", [1.0, float("inf")])
    h.add(3, "Loss", float("nan"))
    h.add(3, "Hist", {"hist": np.arange(3), "edges": np.linspace(0, 1, 4)})
    path = h.write_json(tmp_path / "sub" / "log.json")
    text = open(path).read()
    json.loads(text)  # standard JSON ...
    assert "NaN" not in text and "Infinity" not in text  # ... with no NaN tokens
    back = History.from_json(path)
    assert back.steps == [0, 3]
    assert back[0]["Loss"] == 1.5
    assert back[0]["GradNorm"][1] == math.inf
    assert math.isnan(back[3]["Loss"])
    assert back[3]["Hist"]["hist"] == [0, 1, 2]


def test_reads_json_tricks_log_of_the_reference(tmp_path):
    reference_log = {
        "0": {
            "Loss": 2.3,
            "GradNorm": [0.5, 0.25],
            "GradHist1d": {
                "hist": {
                    "__ndarray__": [1.0, 2.0, 0.0],
                    "dtype": "float32",
                    "shape": [3],
                },
                "edges": {
                    "__ndarray__": [-1, 0, 1, 2],
                    "dtype": "float64",
                    "shape": [4],
                },
            },
        },
        "10": {"Loss": NaN_TOKEN},
    }
    path = tmp_path / "reference_log.json"
    text = json.dumps(reference_log, indent=4, sort_keys=True).replace(
        '"__NAN__"', "NaN"
    )
    path.write_text(text)
    h = History.from_json(tmp_path / "reference_log")  # without suffix, as 1.0.2 did
    assert h.steps == [0, 10]
    assert h[0]["GradHist1d"]["hist"] == [1.0, 2.0, 0.0]
    assert h[0]["GradHist1d"]["edges"] == [-1.0, 0.0, 1.0, 2.0]
    assert math.isnan(h[10]["Loss"])


NaN_TOKEN = "__NAN__"


def test_dataframe_row_per_step():
    h = History({0: {"Loss": 1.0}, 2: {"Loss": 0.5, "GradNorm": [1.0, 2.0]}})
    frame = h.to_dataframe()
    assert list(frame.index) == [0, 2]
    assert frame.index.name == "step"
    assert frame.loc[2, "GradNorm"] == [1.0, 2.0]
    assert math.isnan(frame.loc[0, "GradNorm"])
    assert h.series("Loss") == ([0, 2], [1.0, 0.5])


def test_view_is_read_only_and_uncopied():
    h = History()
    h.add(4, "Hist", {"hist": np.arange(10_000)})
    view = h.view(4)
    with pytest.raises(TypeError):
        view["Hist"] = 1  # a read-only mapping
    assert view["Hist"] is h.view(4)["Hist"]  # no copy per read
    assert h[4]["Hist"]["hist"][:3] == [0, 1, 2]  # item access still gives lists
    with pytest.raises(KeyError):
        h.view(5)


# --- a log path without suffix means <path>.json, as in 1.0.2 -------------------------
def test_log_path_without_suffix_means_json_even_beside_a_folder_of_that_name(tmp_path):
    from cockpit.history import json_path

    logpath = tmp_path / "logfiles" / "run"
    logpath.mkdir(parents=True)  # 1.0.2's example keeps a folder of the log's name
    (logpath / "other.json").write_text("{}")
    assert json_path(logpath) == str(logpath) + ".json"
    assert json_path(str(logpath) + ".json") == str(logpath) + ".json"
    History({0: {"Loss": 1.0}}).write_json(json_path(logpath))
    assert History.from_json(logpath).to_dict() == {0: {"Loss": 1.0}}
    stream = tmp_path / "logfiles" / "run.jsonl"  # .json wins over the stream
    stream.write_text('{"format":"cockpit-log-stream","version":1}\n')
    assert History.from_json(logpath).steps == [0]


def test_plotter_finds_the_log_beside_a_folder_of_its_name(tmp_path):
    pytest.importorskip("matplotlib")
    from cockpit.plotting import CockpitPlotter

    logpath = tmp_path / "logfiles" / "run"
    logpath.mkdir(parents=True)
    History({0: {"Loss": 1.0}, 1: {"Loss": 0.5}}).write_json(str(logpath) + ".json")
    saved = CockpitPlotter().plot(
        str(logpath), show_plot=False, save_plot=True, savedir=tmp_path / "plots"
    )
    assert saved and all(os.path.getsize(path) > 0 for path in saved)


# --- to_output: 1.0.2's output dict ---------------------------------------------------
def _histogram_history():
    """A history holding the histogram results of 1.0.2's section 1.5 and scalars."""
    h = History()
    xe, ye = np.linspace(-1, 1, 41), np.linspace(-2, 2, 51)
    for step in (0, 3):
        h.add(step, "Loss", 1.0 / (step + 1))
        h.add(step, "GradNorm", [float(i) for i in range(20)])  # long: stored compact
        counts = torch.arange(100, dtype=torch.int64) + step
        edges = torch.from_numpy(np.linspace(-2, 2, 101))
        h.add(step, "GradHist1d", {"hist": counts, "edges": edges})
        joint = np.arange(40 * 50).reshape(40, 50)
        layer = {
            "hist": np.ones((2, 3), dtype=np.int64),
            "edges": [[0, 1, 2], [0, 1, 2, 3]],
        }
        h.add(
            step,
            "GradHist2d",
            {"hist": joint, "edges": [xe, ye], "param_groups": 1, "param_0": layer},
        )
    h.add(3, "SameBins2d", {"hist": [[1, 2], [3, 4]], "edges": [list(range(9))] * 2})
    h.add(3, "Params", {"weights": list(range(30))})  # not a histogram: plain lists
    return h


def test_to_output_has_histograms_as_numpy_arrays_and_the_rest_plain():
    h = _histogram_history()
    out = h.to_output()
    assert isinstance(out, collections.defaultdict) and out.default_factory is dict
    assert list(out) == [0, 3]
    assert out[7] == {} and 7 not in h  # a defaultdict, as 1.0.2's output
    one = out[3]["GradHist1d"]
    assert isinstance(one["hist"], np.ndarray) and one["hist"].dtype == np.int64
    np.testing.assert_array_equal(one["hist"], np.arange(100) + 3)
    assert isinstance(one["edges"], np.ndarray) and one["edges"].shape == (101,)
    np.testing.assert_array_equal(one["edges"], np.linspace(-2, 2, 101))
    two = out[0]["GradHist2d"]
    assert two["hist"].shape == (40, 50)
    assert isinstance(two["edges"], tuple) and len(two["edges"]) == 2  # as 1.0.2
    assert [e.shape for e in two["edges"]] == [(41,), (51,)]
    assert two["param_groups"] == 1
    layer = two["param_0"]
    assert isinstance(layer["hist"], np.ndarray) and layer["hist"].shape == (2, 3)
    assert [list(e) for e in layer["edges"]] == [[0, 1, 2], [0, 1, 2, 3]]
    same = out[3]["SameBins2d"]  # equal bins: stored as one block, returned per axis
    assert isinstance(same["edges"], tuple) and len(same["edges"]) == 2
    assert all(isinstance(e, np.ndarray) and e.shape == (9,) for e in same["edges"])
    assert type(out[0]["Loss"]) is float
    assert out[0]["GradNorm"] == [float(i) for i in range(20)]
    assert type(out[0]["GradNorm"]) is list
    assert out[3]["Params"] == {"weights": list(range(30))}


def test_to_output_is_a_copy():
    h = _histogram_history()
    out = h.to_output()
    out[0]["GradHist1d"]["hist"][:] = -1
    out[0]["GradHist2d"]["edges"][0][0] = 99.0
    out[0]["GradNorm"].append(1.0)
    again = h.to_output()
    assert again[0]["GradHist1d"]["hist"][0] == 0
    assert again[0]["GradHist2d"]["edges"][0][0] == -1.0
    assert len(again[0]["GradNorm"]) == 20


def test_to_output_json_stays_plain(tmp_path):
    h = _histogram_history()
    text = open(h.write_json(tmp_path / "log.json")).read()
    assert "__ndarray__" not in text
    assert History.from_json(tmp_path / "log.json").to_dict() == h.to_dict()


# --- the 1.0.2 format (json_tricks) ---------------------------------------------------
def test_legacy_log_has_json_tricks_layout(tmp_path):
    h = _histogram_history()
    h.add(0, "Alpha", float("nan"))
    path = h.write_json(tmp_path / "legacy.json", legacy=True)
    text = open(path).read()
    assert text.startswith('{\n    "0": {\n        "Alpha": NaN,')  # indent 4, sorted
    raw = json.loads(text)  # Python's json reads the NaN token
    assert list(raw) == ["0", "3"]
    hist1 = raw["0"]["GradHist1d"]["hist"]
    assert hist1 == {"__ndarray__": list(range(100)), "dtype": "int64", "shape": [100]}
    hist2 = raw["0"]["GradHist2d"]["hist"]
    assert sorted(hist2) == ["Corder", "__ndarray__", "dtype", "shape"]
    assert hist2["Corder"] is True and hist2["shape"] == [40, 50]
    edges2 = raw["0"]["GradHist2d"]["edges"]
    assert [e["shape"] for e in edges2] == [[41], [51]]
    assert raw["0"]["GradNorm"] == [float(i) for i in range(20)]  # a plain list
    back = History.from_json(path)  # our reader reads it back
    want = h.to_dict()
    assert math.isnan(back[0]["Alpha"]) and math.isnan(want[0].pop("Alpha"))
    got = back.to_dict()
    got[0].pop("Alpha")
    assert got == want


def test_legacy_log_loads_with_json_tricks_like_the_output(tmp_path):
    json_tricks = pytest.importorskip("json_tricks")
    h = _histogram_history()
    h.add(3, "Loss", float("inf"))
    path = h.write_json(tmp_path / "legacy.json", legacy=True)
    with open(path) as handle:
        loaded = json_tricks.load(handle)
    want = h.to_output()
    assert list(loaded) == [str(step) for step in want]  # step keys are strings
    for step, entries in want.items():
        _assert_same_output(loaded[str(step)], entries, f"step {step}")


def _assert_same_output(got, want, where):
    if isinstance(want, np.ndarray):
        assert isinstance(got, np.ndarray), where
        assert got.dtype == want.dtype and got.shape == want.shape, where
        np.testing.assert_array_equal(got, want, err_msg=where)
    elif isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), where
        for key in want:
            _assert_same_output(got[key], want[key], f"{where}[{key!r}]")
    elif isinstance(want, (list, tuple)):  # JSON has no tuples: 2-D edges load as lists
        assert isinstance(got, list) and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            _assert_same_output(g, w, f"{where}[{i}]")
    else:
        assert got == want, (where, got, want)


# --- reading without torch; no import cycle -------------------------------------------
_NO_TORCH = """
import json, sys
for name in ("torch", "backpack", "torchvision"):
    sys.modules[name] = None  # any import of them raises ImportError
import cockpit
import cockpit.history, cockpit.log.stream, cockpit.log.format, cockpit.cli
from cockpit.history import History
from cockpit.log.stream import LogStream
try:
    import torch
except ImportError:
    blocked = True
else:
    blocked = False
try:
    cockpit.Cockpit
except ImportError:
    lazy = True
else:
    lazy = False
stream = LogStream(sys.argv[1])
stream.write({0: {"Loss": 1.5, "GradNorm": [1.0, float("nan")]}, 1: {"Loss": 0.5}})
stream.close()
streamed = History.from_json(sys.argv[1])
written = History.from_json(sys.argv[2])
legacy = written.write_json(sys.argv[3], legacy=True)
print(json.dumps({
    "blocked": blocked,
    "lazy": lazy,
    "version": cockpit.__version__,
    "streamed": {str(k): v for k, v in streamed.items()},
    "written": {str(k): v for k, v in written.items()},
    "legacy": History.from_json(legacy).to_dict()[0],
    "cli": cockpit.cli.load_log(sys.argv[2]).steps,
    "cli_bad": cockpit.cli.main(["plot", sys.argv[2] + ".missing"]),
    "matplotlib": "matplotlib" in sys.modules,
    "output": type(written.to_output()[0]["GradHist1d"]["hist"]).__name__,
}))
"""


def test_logs_are_read_and_written_without_torch_or_backpack(tmp_path):
    h = History()
    h.add(0, "GradHist1d", {"hist": list(range(20)), "edges": list(range(21))})
    h.add(2, "Loss", 0.25)
    written = h.write_json(tmp_path / "log.json")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run(
        [sys.executable, "-c", _NO_TORCH, str(tmp_path / "stream"), written,
         str(tmp_path / "legacy")],
        capture_output=True, text=True, timeout=120, cwd=root,
        env=dict(os.environ, PYTHONPATH=root),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["blocked"] and result["lazy"]
    assert result["version"]
    assert result["streamed"]["0"]["Loss"] == 1.5 and result["streamed"]["1"]
    assert result["written"] == {str(k): v for k, v in h.items()}
    assert result["legacy"] == h[0]
    assert result["cli"] == [0, 2]
    assert result["cli_bad"] == 1 and "no such file" in done.stderr
    assert not result["matplotlib"]  # a bad log fails before plotting is imported
    assert result["output"] == "ndarray"


def test_history_and_log_stream_share_the_codec_and_import_no_privates():
    import ast

    import cockpit.history
    import cockpit.log.format
    import cockpit.log.stream

    imported = {}
    for module in (cockpit.history, cockpit.log.stream, cockpit.log.format):
        tree = ast.parse(open(module.__file__).read())
        imported[module.__name__] = {
            (node.module, alias.name)
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module.startswith("cockpit")
            for alias in node.names
        }
    for name, names in imported.items():
        privates = [n for n in names if n[1].startswith("_")]
        assert not privates, (name, privates)
    modules = {name: {m for m, _ in names} for name, names in imported.items()}
    assert "cockpit.history" not in modules["cockpit.log.stream"]
    assert not {"cockpit.history", "cockpit.log.stream"} & modules["cockpit.log.format"]
    assert "cockpit.log.format" in modules["cockpit.history"]
    assert "cockpit.log.format" in modules["cockpit.log.stream"]


def test_package_attributes_load_on_first_use():
    code = (
        "import sys, cockpit\n"
        "assert 'torch' not in sys.modules and 'matplotlib' not in sys.modules\n"
        "assert cockpit.history.History is cockpit.History\n"
        "assert 'torch' not in sys.modules\n"
        "from cockpit import Cockpit\n"
        "assert 'torch' in sys.modules and 'matplotlib' not in sys.modules\n"
        "assert cockpit.quantities.Loss and cockpit.utils.__name__ == 'cockpit.utils'\n"
        "assert cockpit.CockpitPlotter.__name__ == 'CockpitPlotter'\n"
        "assert isinstance(cockpit.__version__, str) and 'Cockpit' in dir(cockpit)\n"
        "try:\n"
        "    cockpit.no_such_thing\n"
        "except AttributeError as error:\n"
        "    assert 'no_such_thing' in str(error)\n"
        "else:\n"
        "    raise SystemExit('no AttributeError')\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True, text=True, timeout=120, cwd=root,
        env=dict(os.environ, PYTHONPATH=root),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr


def test_to_output_leaves_values_that_are_no_arrays_plain():
    h = History({0: {"Odd": {"hist": [[1, 2], [3]], "edges": None}}})
    assert h.to_output()[0] == {"Odd": {"hist": [[1, 2], [3]], "edges": None}}
