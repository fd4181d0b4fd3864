"""Drop-in compatibility with cockpit-for-pytorch 1.0.2.

The scripts in ``tests/compat102/`` are written the way a user of 1.0.2 wrote them,
from 1.0.2's documentation and examples, using only 1.0.2's public names and import
paths. These tests run them end to end (as programs and in-process), check the
values of custom quantities written against 1.0.2's subclass API against brute-force
recomputations, and check the API surface that 1.0.2 code relies on: names, import
paths, signatures and defaults, the types in ``get_output()`` and the log and plot
file conventions.

Everything runs at tiny sizes (digits 8x8, batch 16, a few steps).
"""

from __future__ import annotations

import collections
import collections.abc
import copy
import importlib
import importlib.util
import inspect
import json
import os
import sys
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pytest
import torch
from backpack import extend

from cockpit import Cockpit, CockpitPlotter, quantities
from cockpit.history import History
from cockpit.utils import schedules
from cockpit.utils.configuration import configuration
from tests.utils.forked import run_forked

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "tests" / "compat102"
if str(SCRIPTS) not in sys.path:
    sys.path.insert(0, str(SCRIPTS))

import utils102  # noqa: E402

pytestmark = pytest.mark.filterwarnings(
    "ignore:Full backward hook is firing:UserWarning"
)


def _script(name):
    """Import ``tests/compat102/<name>.py`` (once) as ``compat102_<name>``."""
    module_name = f"compat102_{name}"
    if module_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            module_name, SCRIPTS / f"{name}.py"
        )
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[module_name] = module
    return sys.modules[module_name]


#: The scripts run as programs, with their ``--steps``.
PROGRAMS = {"basic": 3, "advanced": 4, "custom_quantity": 4}
#: What they all import (torch._dynamo with the first optimizer), imported once by
#: the interpreter they are forked from.
PRELOAD = [
    "torch", "torch._dynamo", "backpack", "sklearn.datasets", "matplotlib.pyplot",
    "cockpit",
]  # fmt: skip


@pytest.fixture(scope="module")
def programs(tmp_path_factory):
    """``{name: (folder, result)}``: ``python tests/compat102/<name>.py --steps N
    --outdir FOLDER`` run in FOLDER, each in a process of its own
    (:func:`tests.utils.forked.run_forked`)."""
    env = dict(os.environ, MPLBACKEND="Agg", PYTHONPATH=str(ROOT))
    env["PYTHONWARNINGS"] = "ignore:Full backward hook is firing"
    folders = {name: tmp_path_factory.mktemp(name) for name in PROGRAMS}
    cases = [
        {
            "path": str(SCRIPTS / f"{name}.py"),
            "argv": ["--steps", str(steps), "--outdir", str(folders[name])],
            "cwd": str(folders[name]),
        }
        for name, steps in PROGRAMS.items()
    ]
    outputs = tmp_path_factory.mktemp("outputs")
    results = run_forked(cases, outputs, PRELOAD, env=env)
    return {name: (folders[name], r) for name, r in zip(PROGRAMS, results, strict=True)}


def _run_script(programs, name):
    """The folder the script ran in, and its result (which must be a success)."""
    folder, result = programs[name]
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return folder, result


def _train(
    quantities_list, steps=3, model_fn=utils102.mlp, log=False, lr=0.1, record=None
):
    """The canonical 1.0.2 loop on digits; returns the cockpit and the model.

    With a list ``record``, ``(step, inputs, labels, params)`` is appended per step
    (the parameters as they were during the backward pass).
    """
    data = utils102.digits_data()
    torch.manual_seed(0)
    model = extend(model_fn())
    loss_fn = extend(torch.nn.CrossEntropyLoss())
    individual_loss_fn = torch.nn.CrossEntropyLoss(reduction="none")
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    cockpit = Cockpit(model.parameters(), quantities=quantities_list)
    for step, (inputs, labels) in enumerate(data):
        if step >= steps:
            break
        opt.zero_grad()
        outputs = model(inputs)
        loss = loss_fn(outputs, labels)
        losses = individual_loss_fn(outputs, labels).detach()
        info = {
            "batch_size": inputs.shape[0],
            "individual_losses": losses,
            "loss": loss,
            "optimizer": opt,
        }
        with cockpit(step, info=info):
            loss.backward(create_graph=cockpit.create_graph(step))
        if record is not None:
            params = [p.detach().clone() for p in model.parameters()]
            record.append((step, inputs, labels, params))
        opt.step()
        if log:
            cockpit.log(step, 0, loss.item(), 2.0, 2.1, 0.5, 0.4, 0.3, 0.1)
    return cockpit, model


@pytest.fixture(scope="module")
def full_run():
    """Three steps of ``full`` plus the quantities outside every configuration."""
    extra = [
        quantities.MeanGSNR(schedules.linear(1)),
        quantities.CABS(schedules.linear(1)),
        quantities.EarlyStopping(schedules.linear(1)),
        quantities.TICTrace(schedules.linear(1)),
        quantities.Time(schedules.linear(1)),
    ]
    cockpit, _ = _train(configuration("full") + extra, steps=3, log=True)
    return cockpit


# --- the scripts, end to end ---
def test_basic_script_runs(programs):
    """1.0.2's basic example as a program: the log of every ``full`` quantity."""
    tmp_path, _ = _run_script(programs, "basic")
    log = tmp_path / "basic_log.json"
    assert log.is_file()
    assert json.loads(log.read_text())  # readable standard JSON
    assert list(tmp_path.glob("*primary*.png"))
    history = History.from_json(log)
    keys = {cls.__name__ for cls in configuration_classes("full")}
    # Two-step quantities store under the start step: step 0 has everything.
    assert keys <= set(history[0]), keys - set(history[0])


def configuration_classes(label):
    from cockpit.utils.configuration import quantities_cls_for_configuration

    return quantities_cls_for_configuration(label)


def test_advanced_script_runs(programs):
    """1.0.2's advanced example as a program: its log, folder and images."""
    tmp_path, result = _run_script(programs, "advanced")
    logpath = tmp_path / "logfiles" / "cockpit_output"
    assert (logpath.parent / "cockpit_output.json").is_file()
    assert logpath.is_dir()
    saved = sorted(os.listdir(logpath))
    # One image per plot call in the loop (steps 2 and 4) and the final one.
    for tag in ("2", "4", "_final"):
        assert any(tag in name and name.endswith(".png") for name in saved), saved
    # The user's extra DiagHessian results stay on the parameters after the step.
    assert "diag_h after every step: True" in result.stdout, result.stdout
    history = History.from_json(str(logpath) + ".json")
    assert "HessMaxEV" in history[0] and "HessMaxEV" in history[3]
    assert "GradHist1d" in history[0] and "GradHist1d" not in history[1]
    assert len(np.asarray(history[0]["GradHist1d"]["hist"])) == 10


def test_custom_quantity_script_runs(programs):
    tmp_path, result = _run_script(programs, "custom_quantity")
    assert "MaxIndividualGradNorm" in result.stdout
    assert (tmp_path / "custom_log.json").is_file()


# --- custom quantities (1.0.2 subclass API) against brute force ---
def _per_sample_grads(model, params, inputs, labels):
    """``g_i`` for every sample, float64, flattened over all parameters: [N, D]."""
    net = copy.deepcopy(model).double()
    for p, value in zip(net.parameters(), params):
        p.data = value.double().clone()
    rows = []
    for i in range(inputs.shape[0]):
        loss_i = torch.nn.functional.cross_entropy(
            net(inputs[i : i + 1].double()), labels[i : i + 1]
        )
        grads = torch.autograd.grad(loss_i, list(net.parameters()))
        rows.append(torch.cat([g.flatten() for g in grads]))
    return torch.stack(rows)


def _custom(name, *args, **kwargs):
    return getattr(_script("custom_quantity"), name)(*args, **kwargs)


@pytest.mark.parametrize("with_economy", [False, True], ids=["alone", "with_economy"])
def test_custom_single_step_quantity(with_economy):
    """``extensions`` -> ``BatchGrad``; ``_compute`` reads ``p.grad_batch``."""
    quantity = _custom("MaxIndividualGradNorm", schedules.linear(2))
    builtin = configuration("economy") if with_economy else []
    record = []
    cockpit, model = _train([quantity] + builtin, steps=4, record=record)
    output = cockpit.get_output()
    for step, inputs, labels, params in record:
        if step % 2:
            assert step not in quantity.get_output()
            continue
        g_i = _per_sample_grads(model, params, inputs, labels)
        expected = g_i.norm(dim=1).max().item()
        assert quantity.get_output()[step] == pytest.approx(expected, rel=1e-5)
        assert output[step]["MaxIndividualGradNorm"] == pytest.approx(
            expected, rel=1e-5
        )
    assert quantity.output is quantity.get_output()
    assert isinstance(quantity.output, collections.defaultdict)


def test_custom_two_step_quantity():
    """1.0.2 two-step API: ``is_start``/``is_end``, the cache, ``SAVE_SHIFT``."""
    quantity = _custom("GradCosine", schedules.linear(1))
    record = []
    cockpit, model = _train([quantity], steps=4, record=record)
    grads = {
        step: _per_sample_grads(model, params, inputs, labels).mean(0)
        for step, inputs, labels, params in record
    }
    for step in range(3):  # stored under the start step; step 3 has no end yet
        expected = torch.nn.functional.cosine_similarity(
            grads[step], grads[step + 1], dim=0
        ).item()
        value = quantity.get_output()[step]
        assert value == pytest.approx(expected, rel=1e-4, abs=1e-6)
        assert cockpit.get_output()[step]["GradCosine"] == pytest.approx(
            expected, rel=1e-4, abs=1e-6
        )
    assert 3 not in quantity.get_output()
    assert set(quantity._cache) == {3}  # only the pending start is cached


def test_custom_byproduct_quantity():
    quantity = _custom("ParamNorm", schedules.linear(1))
    record = []
    cockpit, _ = _train([quantity], steps=3, record=record)
    for step, _, _, params in record:
        expected = torch.cat([p.double().flatten() for p in params]).norm().item()
        assert quantity.get_output()[step] == pytest.approx(expected, rel=1e-6)
        assert cockpit.get_output()[step]["ParamNorm"] == pytest.approx(
            expected, rel=1e-6
        )


def test_quantity_base_classes_import_paths():
    from cockpit.quantities import Quantity
    from cockpit.quantities.quantity import (
        ByproductQuantity,
        SingleStepQuantity,
        TwoStepQuantity,
    )
    from cockpit.quantities.quantity import Quantity as Base

    assert Quantity is Base
    for cls in (ByproductQuantity, SingleStepQuantity, TwoStepQuantity):
        assert issubclass(cls, Quantity)
    assert issubclass(ByproductQuantity, SingleStepQuantity)
    assert getattr(TwoStepQuantity, "SAVE_SHIFT", None) == 0
    wanted = {
        TwoStepQuantity: ("save_to_cache", "load_from_cache", "is_start", "is_end"),
        Quantity: (
            "extensions",
            "extension_hooks",
            "protected_savefields",
            "create_graph",
            "should_compute",
            "compute",
            "track",
            "get_output",
        ),
    }
    missing = [
        f"{cls.__name__}.{name}"
        for cls, names in wanted.items()
        for name in names
        if not callable(getattr(cls, name, None))
    ]
    assert not missing, missing
    signature = inspect.signature(Quantity.track)
    assert list(signature.parameters) == ["self", "global_step", "params", "batch_loss"]
    signature = inspect.signature(Quantity.compute)
    assert list(signature.parameters) == ["self", "global_step", "params", "batch_loss"]


def test_builtin_quantity_get_output():
    grad_norm = quantities.GradNorm(schedules.linear(1))
    loss = quantities.Loss(schedules.linear(2))
    cockpit, _ = _train([grad_norm, loss], steps=3)
    output = cockpit.get_output()
    assert sorted(grad_norm.get_output()) == [0, 1, 2]
    assert sorted(loss.output) == [0, 2]
    for step in range(3):
        np.testing.assert_allclose(
            np.asarray(grad_norm.get_output()[step], dtype=float),
            np.asarray(output[step]["GradNorm"], dtype=float),
        )


# --- Cockpit API surface ---
def test_get_output_is_defaultdict(full_run):
    output = full_run.get_output()
    assert isinstance(output, collections.defaultdict)
    assert output.default_factory is dict
    assert output[12345] == {}  # missing steps read as empty, like 1.0.2


def test_output_attribute(full_run):
    output = full_run.get_output()
    assert isinstance(full_run.output, collections.abc.Mapping)
    assert sorted(full_run.output) == sorted(output)
    assert sorted(full_run.output[0]) == sorted(output[0])
    assert full_run.output[0]["Loss"] == output[0]["Loss"]


def test_track_signature():
    signature = inspect.signature(Cockpit.track)
    params = list(signature.parameters.values())
    assert [p.name for p in params[:3]] == [
        "self",
        "global_step",
        "protected_savefields",
    ]
    assert params[2].default == ()


def test_cockpit_members():
    signature = inspect.signature(Cockpit.__init__)
    assert list(signature.parameters)[1:3] == ["params", "quantities"]
    assert signature.parameters["quantities"].default is None
    call = inspect.signature(Cockpit.__call__).parameters
    assert list(call)[1] == "global_step"
    assert call["info"].default is None and call["debug"].default is False
    log = inspect.signature(Cockpit.log).parameters
    assert list(log)[1:] == [
        "global_step",
        "epoch_count",
        "train_loss",
        "valid_loss",
        "test_loss",
        "train_accuracy",
        "valid_accuracy",
        "test_accuracy",
        "learning_rate",
    ]
    assert Cockpit.BACKPACK_CONV_SAVE_MEMORY is True
    names = ("add", "create_graph", "write", "get_output", "log", "track")
    missing = [name for name in names if not callable(getattr(Cockpit, name, None))]
    assert not missing, missing


def test_cockpit_rejects_what_102_rejects():
    frozen = torch.nn.Parameter(torch.zeros(2), requires_grad=False)
    with pytest.raises(ValueError):
        Cockpit([frozen])
    cockpit = Cockpit([torch.nn.Parameter(torch.zeros(2))])
    assert cockpit.quantities == []
    with pytest.raises(ValueError):
        cockpit.add("GradNorm")


def test_create_graph_only_on_hess_max_ev_steps():
    model = extend(utils102.mlp())
    cockpit = Cockpit(
        model.parameters(),
        quantities=[
            quantities.HessMaxEV(schedules.linear(3)),
            quantities.GradNorm(schedules.linear(1)),
        ],
    )
    assert [cockpit.create_graph(s) for s in range(5)] == [
        True,
        False,
        False,
        True,
        False,
    ]


def test_log_entries_in_output(full_run):
    entry = full_run.get_output()[1]
    assert entry["epoch_count"] == 0
    assert entry["train_accuracy"] == 0.5
    assert entry["learning_rate"] == 0.1


def test_output_value_types(full_run):
    entry = full_run.get_output()[0]
    for key in ("Loss", "NormTest", "InnerTest", "OrthoTest", "HessMaxEV", "TICDiag"):
        assert isinstance(entry[key], (float, np.floating)), (key, type(entry[key]))
    assert isinstance(entry["Alpha"], (float, np.floating))
    for key in ("GradNorm", "Distance", "UpdateSize", "HessTrace"):
        assert len(entry[key]) == 4, key  # one per parameter tensor
    for key in ("MeanGSNR", "CABS", "EarlyStopping", "TICTrace", "Time"):
        assert key in entry, key


def test_histograms_are_numpy_arrays(full_run):
    entry = full_run.get_output()[0]
    hist1d = entry["GradHist1d"]
    assert isinstance(hist1d["hist"], np.ndarray)
    assert isinstance(hist1d["edges"], np.ndarray)
    assert hist1d["hist"].shape == (100,)
    assert hist1d["edges"].shape == (101,)
    hist2d = entry["GradHist2d"]
    assert isinstance(hist2d["hist"], np.ndarray)
    assert hist2d["hist"].shape == (40, 50)
    x_edges, y_edges = hist2d["edges"]
    assert isinstance(x_edges, np.ndarray) and x_edges.shape == (41,)
    assert isinstance(y_edges, np.ndarray) and y_edges.shape == (51,)


def test_layerwise_histograms_keys():
    hist = quantities.GradHist2d(schedules.linear(1), keep_individual=True)
    cockpit, _ = _train([hist], steps=1)
    entry = cockpit.get_output()[0]["GradHist2d"]
    assert entry["param_groups"] == 4
    for k in range(4):
        assert isinstance(entry[f"param_{k}"]["hist"], np.ndarray)
        assert len(entry[f"param_{k}"]["edges"]) == 2


def test_debug_flag_runs(capsys):
    model = extend(utils102.mlp())
    loss_fn = extend(torch.nn.CrossEntropyLoss())
    cockpit = Cockpit(
        model.parameters(), quantities=[quantities.NormTest(schedules.linear(1))]
    )
    inputs, labels = next(iter(utils102.digits_data()))
    loss = loss_fn(model(inputs), labels)
    with cockpit(0, info={"loss": loss, "batch_size": 16}, debug=True):
        loss.backward()
    assert "NormTest" in cockpit.get_output()[0]


def test_user_extensions_results_stay_on_params():
    """``cockpit(step, *exts)``: the user's BackPACK results survive the step."""
    from backpack import extensions

    model = extend(utils102.mlp())
    loss_fn = extend(torch.nn.CrossEntropyLoss())
    cockpit = Cockpit(model.parameters(), quantities=configuration("economy"))
    inputs, labels = next(iter(utils102.digits_data()))
    outputs = model(inputs)
    loss = loss_fn(outputs, labels)
    losses = torch.nn.functional.cross_entropy(outputs, labels, reduction="none")
    info = {
        "batch_size": 16,
        "individual_losses": losses.detach(),
        "loss": loss,
        "optimizer": torch.optim.SGD(model.parameters(), lr=0.1),
    }
    with cockpit(0, extensions.BatchGrad(), extensions.SumGradSquared(), info=info):
        loss.backward()
    for p in model.parameters():
        assert p.grad_batch.shape == (16, *p.shape)
        assert p.sum_grad_squared.shape == p.shape
    assert "NormTest" in cockpit.get_output()[0]


def test_custom_quantity_create_graph():
    """A 1.0.2 quantity asks for ``create_graph`` through ``create_graph(step)``."""
    from cockpit.quantities.quantity import ByproductQuantity

    class NeedsGraph(ByproductQuantity):
        def create_graph(self, global_step):
            return global_step == 1

        def _compute(self, global_step, params, batch_loss):
            return 0.0

    model = extend(utils102.mlp())
    cockpit = Cockpit(model.parameters(), quantities=[NeedsGraph(schedules.linear(1))])
    assert [cockpit.create_graph(s) for s in range(3)] == [False, True, False]


# --- writing and plotting logs ---
def test_write_appends_json(tmp_path, full_run):
    logpath = str(tmp_path / "deeper" / "run")
    full_run.write(logpath)
    assert os.path.isfile(logpath + ".json")
    assert not os.path.exists(logpath)
    with open(logpath + ".json") as handle:
        data = json.load(handle)
    assert "0" in data and "Loss" in data["0"]


def test_plot_log_path_without_extension(tmp_path, full_run):
    logpath = str(tmp_path / "run")
    full_run.write(logpath)
    plotter = CockpitPlotter()
    plotter.plot(logpath, show_plot=False, save_plot=True, savedir=str(tmp_path))
    assert list(tmp_path.glob("*primary*.png"))


def test_plot_log_next_to_folder_of_same_name(tmp_path, full_run):
    """1.0.2's advanced example: ``logfiles/run.json`` next to ``logfiles/run/``."""
    logpath = str(tmp_path / "logfiles" / "run")
    os.makedirs(logpath)
    full_run.write(logpath)
    plotter = CockpitPlotter()
    plotter.plot(
        logpath,
        savedir=logpath,
        show_plot=False,
        save_plot=True,
        savename_append="_final",
    )
    assert any("_final" in name for name in os.listdir(logpath))


def test_plot_log_default_savedir_is_log_path(tmp_path, full_run):
    """1.0.2: for a log source, ``savedir`` defaults to the log path (a folder)."""
    logpath = str(tmp_path / "run")
    full_run.write(logpath)
    CockpitPlotter().plot(logpath, show_plot=False, save_plot=True)
    assert os.path.isdir(logpath)
    assert any(name.endswith(".png") for name in os.listdir(logpath))


def test_plot_cockpit_needs_savedir(full_run):
    with pytest.raises(ValueError):
        CockpitPlotter().plot(full_run, show_plot=False, save_plot=True)


def test_plot_signature():
    params = inspect.signature(CockpitPlotter.plot).parameters
    for name in (
        "source",
        "show_plot",
        "block",
        "save_plot",
        "savedir",
        "savename_append",
        "show_log_iter",
        "discard",
        "plot_title",
        "debug",
    ):
        assert name in params, name
    assert params["show_plot"].default is True
    assert params["save_plot"].default is False
    assert params["block"].default is False
    init = inspect.signature(CockpitPlotter.__init__).parameters
    assert init["secondary_screen"].default is False


def test_plotter_import_path():
    from cockpit.plotter import CockpitPlotter as FromPlotter

    assert FromPlotter is CockpitPlotter


GAUGES = (
    "alpha_gauge",
    "cabs_gauge",
    "distance_gauge",
    "early_stopping_gauge",
    "grad_norm_gauge",
    "gradient_tests_gauge",
    "histogram_1d_gauge",
    "histogram_2d_gauge",
    "hyperparameter_gauge",
    "max_ev_gauge",
    "mean_gsnr_gauge",
    "performance_gauge",
    "tic_gauge",
    "trace_gauge",
)


def test_instruments_module_has_gauges():
    instruments = importlib.import_module("cockpit.instruments")
    missing = [
        name for name in GAUGES if not callable(getattr(instruments, name, None))
    ]
    assert not missing, missing


@pytest.fixture(scope="module")
def plotted(full_run):
    """A plotter (with secondary screen) that has drawn ``full_run`` once."""
    plotter = CockpitPlotter(secondary_screen=True)
    plotter.plot(full_run, show_plot=False)
    yield plotter
    for figure in getattr(plotter, "figures", []):
        plt.close(figure)


@pytest.mark.parametrize("name", GAUGES)
def test_gauge_draws_into_gridspec(plotted, name):
    """1.0.2 gauges are ``gauge(plotter, fig, gridspec)`` after ``plotter.plot``."""
    instruments = importlib.import_module("cockpit.instruments")
    fig = plt.figure()
    try:
        grid = fig.add_gridspec(1, 1)
        getattr(instruments, name)(plotted, fig, grid[0, 0])
        assert fig.axes, f"{name} drew nothing"
    finally:
        plt.close(fig)


# --- configuration, schedules, quantity constructors ---
def test_configuration_api():
    from cockpit.utils.configuration import quantities_cls_for_configuration

    params = inspect.signature(configuration).parameters
    assert list(params) == ["label", "track_schedule", "verbose"]
    assert params["track_schedule"].default is None
    assert params["verbose"].default is False
    names = {cls.__name__ for cls in quantities_cls_for_configuration("economy")}
    assert names == {
        "Alpha",
        "Distance",
        "GradHist1d",
        "GradNorm",
        "InnerTest",
        "Loss",
        "NormTest",
        "OrthoTest",
        "UpdateSize",
    }
    with pytest.raises(KeyError):
        configuration("first_class")
    every_third = configuration("business", track_schedule=schedules.linear(3))
    assert len(every_third) == 11


def test_schedules():
    assert [s for s in range(8) if schedules.linear(3)(s)] == [0, 3, 6]
    assert [s for s in range(8) if schedules.linear(3, offset=1)(s)] == [1, 4, 7]
    assert [s for s in range(8) if schedules.linear(3, offset=-1)(s)] == [2, 5]
    log = schedules.logarithmic(0, 1, steps=4, init=False)
    assert [s for s in range(20) if log(s)] == [1, 2, 4, 10]
    params = inspect.signature(schedules.logarithmic).parameters
    assert params["steps"].default == 300 and params["base"].default == 10
    assert params["init"].default is True


def _defaults(cls):
    return {
        name: p.default
        for name, p in inspect.signature(cls.__init__).parameters.items()
        if p.default is not inspect.Parameter.empty
    }


def test_quantity_constructor_defaults():
    assert _defaults(quantities.GradHist1d)["bins"] == 100
    assert tuple(_defaults(quantities.GradHist1d)["range"]) == (-2, 2)
    assert _defaults(quantities.GradHist1d)["adapt"] is None
    hist2d = _defaults(quantities.GradHist2d)
    assert tuple(hist2d["bins"]) == (40, 50)
    assert tuple(map(tuple, hist2d["range"])) == ((-1, 1), (-2, 2))
    assert tuple(hist2d["adapt"]) == (None, None)
    assert hist2d["keep_individual"] is False
    assert _defaults(quantities.HessTrace)["curvature"] == "diag_h"
    for cls in (quantities.TICDiag, quantities.TICTrace):
        assert _defaults(cls)["curvature"] == "diag_h"
        assert _defaults(cls)["epsilon"] == 1e-7
    assert _defaults(quantities.EarlyStopping)["epsilon"] == 1e-5
    assert _defaults(quantities.MeanGSNR)["epsilon"] == 1e-5
    assert "use_power" in _defaults(quantities.HessMaxEV)
    for name in (
        "Loss",
        "Parameters",
        "Time",
        "GradNorm",
        "Distance",
        "UpdateSize",
        "Alpha",
        "CABS",
        "EarlyStopping",
        "GradHist1d",
        "GradHist2d",
        "NormTest",
        "InnerTest",
        "OrthoTest",
        "MeanGSNR",
        "HessTrace",
        "HessMaxEV",
        "TICDiag",
        "TICTrace",
    ):
        cls = getattr(quantities, name)
        params = list(inspect.signature(cls.__init__).parameters)
        assert params[1] == "track_schedule", name
        assert _defaults(cls)["verbose"] is False, name


def test_bin_adaptation_policies():
    from cockpit.quantities.bin_adaptation import (
        GradAbsMax,
        NoAdaptation,
        ParamAbsMax,
    )

    adapt = (GradAbsMax(schedules.linear(1)), ParamAbsMax(schedules.linear(1)))
    hist = quantities.GradHist2d(schedules.linear(1), adapt=adapt)
    hist1d = quantities.GradHist1d(schedules.linear(1), adapt=NoAdaptation())
    cockpit, _ = _train([hist, hist1d], steps=2)
    assert "GradHist2d" in cockpit.get_output()[1]
    assert "GradHist1d" in cockpit.get_output()[1]


def test_version_string():
    import cockpit

    assert isinstance(cockpit.__version__, str)


def test_102_subclass_may_assign_output_in_init():
    from cockpit.quantities.quantity import ByproductQuantity

    class Assigns(ByproductQuantity):
        def __init__(self, track_schedule, verbose=False):
            super().__init__(track_schedule, verbose=verbose)
            self.output = collections.defaultdict(dict)  # as 1.0.2's base did

        def _compute(self, global_step, params, batch_loss):
            return float(global_step)

    quantity = Assigns(schedules.linear(1))
    cockpit, _ = _train([quantity], steps=2)
    assert dict(quantity.get_output()) == {0: 0.0, 1: 1.0}
    assert quantity.output is quantity.get_output()
