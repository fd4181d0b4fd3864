import json
import math

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
