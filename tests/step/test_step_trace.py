"""The step tracer runs in-process on its MLP and reports consistent figures."""

import json

from benchmarks.studies import step_trace


def test_step_trace_figures_are_consistent(tmp_path, capsys):
    out = tmp_path / "trace.json"
    result = step_trace.main(["--out", str(out)])

    written = json.loads(out.read_text())
    assert written == result
    for key in ("commit", "machine", "files", "functions", "calls", "switches"):
        assert key in written
    assert {"platform", "processor", "torch"} <= set(written["machine"])

    assert result["calls"] >= result["functions"] >= result["files"] >= 1
    assert 0 < result["switches"] < result["calls"]
    assert set(result["schedule_calls"]) == {"NormTest", "GradNorm"}
    assert all(count >= 1 for count in result["schedule_calls"].values())
    top = result["top_files"]
    assert 1 <= len(top) <= min(10, result["files"])
    assert sum(top.values()) <= result["calls"]
    assert all(path.startswith("cockpit") for path in top)
    order = result["reading_order"]  # every file the step entered, once each
    assert len(order) == len(set(order)) == result["files"]
    assert set(top) <= set(order)
    assert "calls" in capsys.readouterr().out
