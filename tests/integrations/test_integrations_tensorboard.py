"""``cockpit export --tensorboard``: the event files read back equal the log."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from backpack import extend

from cockpit import Cockpit
from cockpit import quantities as q
from cockpit.cli import main
from cockpit.history import History
from cockpit.integrations.tensorboard import (
    TOTALS,
    export_tensorboard,
    histogram_raw_arguments,
)
from cockpit.utils.schedules import linear
from tests.utils import expected_warnings as expected

pytestmark = [expected.MISSCALED_LOOKALIKE]

event_accumulator = pytest.importorskip(
    "tensorboard.backend.event_processing.event_accumulator"
)

STEPS = 4


def _run(logpath=None) -> Cockpit:
    """A few tracked steps of a small MLP with every kind of value in the log."""
    torch.manual_seed(0)
    model = extend(
        torch.nn.Sequential(
            torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3)
        )
    )
    loss_fn = extend(torch.nn.CrossEntropyLoss())
    individual = torch.nn.CrossEntropyLoss(reduction="none")
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.5)
    every = linear(1)
    quantities = [
        q.Loss(every),
        q.Alpha(every),
        q.GradNorm(every),
        q.Distance(every),
        q.UpdateSize(every),
        q.Variance(every),
        q.HessTrace(every),
        q.NormTest(every),
        q.GradHist1d(every, bins=20, range=(-0.5, 0.5)),
        q.GradHist2d(every, bins=(8, 6), keep_individual=True),
        q.Parameters(linear(2)),
    ]
    cockpit = Cockpit(model.named_parameters(), quantities=quantities, logpath=logpath)
    for step in range(STEPS):
        x, y = torch.randn(7, 6), torch.randint(0, 3, (7,))
        opt.zero_grad()
        outputs = model(x)
        loss = loss_fn(outputs, y)
        info = {"batch_size": 7, "loss": loss, "optimizer": opt,
                "individual_losses": individual(outputs, y)}  # fmt: skip
        with cockpit(step, info=info):
            loss.backward()
        opt.step()
        cockpit.log(step, 0, None, None, None, None, None, None, 0.2)
    return cockpit


def _read(logdir):
    accumulator = event_accumulator.EventAccumulator(
        str(logdir), size_guidance={"scalars": 0, "histograms": 0}
    )
    accumulator.Reload()
    return accumulator


def _scalars(accumulator, tag) -> dict[int, float]:
    return {event.step: event.value for event in accumulator.Scalars(tag)}


def _histograms(accumulator, tag) -> dict[int, object]:
    return {e.step: e.histogram_value for e in accumulator.Histograms(tag)}


def _assert_histogram(stored, counts, edges):
    """The exported histogram holds the log's right edges and counts."""
    counts = np.asarray(counts, dtype=float)
    filled = np.flatnonzero(counts)
    assert list(stored.bucket) == counts.tolist()
    assert list(stored.bucket_limit) == list(edges[1:])
    assert stored.num == counts.sum()
    assert stored.min == edges[filled[0]] and stored.max == edges[filled[-1] + 1]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A streamed log of :func:`_run` and its export through the command line."""
    tmp = tmp_path_factory.mktemp("tb")
    cockpit = _run(logpath=str(tmp / "run"))
    cockpit.close()
    names = ",".join(cockpit.param_names)
    logdir = tmp / "tb"
    assert main(["export", cockpit.logpath, "--tensorboard", str(logdir),
                 "--param-names", names]) == 0  # fmt: skip
    return History.from_json(cockpit.logpath), _read(logdir), cockpit.param_names


def test_scalars_and_per_parameter_values_equal_the_log(exported):
    history, tb, names = exported
    for key in ("Loss", "Alpha", "NormTest", "learning_rate"):
        steps, values = history.series(key)
        assert steps, key
        read = _scalars(tb, f"cockpit/{key}")
        assert sorted(read) == steps
        for step, value in zip(steps, values):
            assert read[step] == pytest.approx(value, rel=1e-6, abs=1e-12)
    for key in ("GradNorm", "Distance", "UpdateSize", "Variance", "HessTrace"):
        steps, values = history.series(key)
        assert steps, key
        for i, name in enumerate(names):
            read = _scalars(tb, f"cockpit/{key}/{name}")
            assert [read[s] for s in steps] == pytest.approx(
                [v[i] for v in values], rel=1e-6, abs=1e-12
            )
        total = _scalars(tb, f"cockpit/{key}")
        for step, value in zip(steps, values):
            expected = (
                math.sqrt(sum(v * v for v in value))
                if TOTALS[key] == "norm"
                else sum(value)
            )
            assert total[step] == pytest.approx(expected, rel=1e-6, abs=1e-12)


def test_histograms_keep_the_logged_edges_and_counts(exported):
    history, tb, names = exported
    steps, values = history.series("GradHist1d")
    read = _histograms(tb, "cockpit/GradHist1d")
    assert sorted(read) == steps
    for step, value in zip(steps, values):
        _assert_histogram(read[step], value["hist"], value["edges"])

    steps, values = history.series("GradHist2d")
    for axis, label in enumerate(("gradient", "parameter")):
        read = _histograms(tb, f"cockpit/GradHist2d/{label}")
        for step, value in zip(steps, values):
            counts = np.asarray(value["hist"]).sum(axis=1 - axis)
            _assert_histogram(read[step], counts, value["edges"][axis])
            for k, name in enumerate(names):
                single = value[f"param_{k}"]
                per = _histograms(tb, f"cockpit/GradHist2d/{label}/{name}")
                counts = np.asarray(single["hist"]).sum(axis=1 - axis)
                _assert_histogram(per[step], counts, single["edges"][axis])


def test_parameters_become_value_histograms(exported):
    history, tb, names = exported
    steps, values = history.series("Parameters")
    assert steps == [0, 2]
    for i, name in enumerate(names):
        read = _histograms(tb, f"cockpit/Parameters/{name}")
        assert sorted(read) == steps
        for step, value in zip(steps, values):
            flat = np.asarray(value[i], dtype=float).reshape(-1)
            assert read[step].num == flat.size
            assert read[step].sum == pytest.approx(flat.sum(), abs=1e-6)


def test_export_of_a_live_cockpit_uses_its_parameter_names(tmp_path):
    cockpit = _run()
    summary = export_tensorboard(cockpit, tmp_path / "tb", prefix="dbg")
    assert summary.steps == STEPS and summary.histograms > 0
    assert "nonfinite" not in summary.skipped
    tags = _read(tmp_path / "tb").Tags()["scalars"]
    assert "dbg/GradNorm/0.weight" in tags and "dbg/GradNorm/2.bias" in tags


def test_unnamed_parameters_and_skipped_values(tmp_path):
    log = {0: {"GradNorm": [3.0, 4.0], "nonfinite": ["loss"], "Loss": None}}
    summary = export_tensorboard(log, tmp_path / "tb")
    # None is no value (not measured), so it is not a skipped one
    assert summary.skipped == ["nonfinite"] and summary.scalars == 3
    tb = _read(tmp_path / "tb")
    assert _scalars(tb, "cockpit/GradNorm") == {0: 5.0}
    assert _scalars(tb, "cockpit/GradNorm/param_1") == {0: 4.0}


def test_histogram_arguments_and_errors(tmp_path, capsys):
    assert histogram_raw_arguments([0, 0], [0.0, 1.0, 2.0]) is None
    arguments = histogram_raw_arguments([0, 2, 1], [0.0, 1.0, 2.0, 3.0])
    assert (arguments["min"], arguments["max"], arguments["num"]) == (1.0, 3.0, 3)
    assert arguments["sum"] == 2 * 1.5 + 2.5
    with pytest.raises(ValueError, match="needs 3 edges"):
        histogram_raw_arguments([1, 2], [0.0, 1.0])
    with pytest.raises(ValueError, match="logdir"):
        export_tensorboard({}, None)
    assert main(["export", str(tmp_path / "none.json"), "--tensorboard", "x"]) == 1
    assert "none.json" in capsys.readouterr().err


def test_param_names_of_another_length_are_not_used_and_say_so(tmp_path):
    """Names are matched to per-parameter values by position, so a list of another
    length could mislabel them: tags keep ``param_<i>``, with one warning."""
    from cockpit.errors import CockpitWarning

    log = {0: {"GradNorm": [1.0, 2.0, 3.0]}, 1: {"GradNorm": [1.5, 2.5, 3.5]}}
    with pytest.warns(CockpitWarning, match=r"2 parameter name\(s\).*GradNorm.*3"):
        export_tensorboard(log, tmp_path / "short", param_names=["a", "b"])
    tags = _read(tmp_path / "short").Tags()["scalars"]
    assert "cockpit/GradNorm/param_2" in tags and "cockpit/GradNorm/a" not in tags
    with warnings.catch_warnings():
        warnings.simplefilter("error", CockpitWarning)  # the right count: silent
        export_tensorboard(log, tmp_path / "named", param_names=["a", "b", "c"])
    assert "cockpit/GradNorm/c" in _read(tmp_path / "named").Tags()["scalars"]


def test_values_not_measured_are_not_reported_as_skipped(tmp_path):
    """``Cockpit.log`` records ``None`` for a metric a run does not measure (the
    demo has no test split): nothing to export, and nothing to complain about."""
    log = {
        0: {"Loss": 1.0, "test_loss": None, "GradHist1d": {"hist": "?", "edges": []}},
        1: {"Loss": 0.5, "test_loss": None},
    }
    summary = export_tensorboard(log, tmp_path / "run")
    assert summary.skipped == ["GradHist1d"] and summary.scalars == 2


def test_learning_rates_are_per_parameter_group_not_per_tensor(tmp_path):
    """The cockpit records one learning rate per parameter group: exported per
    group, never matched against the parameter names (no warning about them)."""
    from cockpit.errors import CockpitWarning

    cockpit = _run()
    assert cockpit.history[0]["learning_rates"] == [0.2]  # 1 group, 4 tensors
    with warnings.catch_warnings():
        warnings.simplefilter("error", CockpitWarning)
        export_tensorboard(cockpit, tmp_path / "tb")
    tb = _read(tmp_path / "tb")
    assert _scalars(tb, "cockpit/learning_rates/group_0") == dict.fromkeys(
        range(STEPS), pytest.approx(0.2)
    )
    assert not [t for t in tb.Tags()["scalars"] if "learning_rates/param" in t]
