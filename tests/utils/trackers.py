"""What a tracker should hold of a cockpit run, from the run's own history.

:func:`expected_scalars` spells out the names and values of the TensorBoard export
(``docs/integrations.md``) from their definition, independently of
``cockpit.integrations.series``: a number under ``cockpit/<key>``, a per-parameter
list one value per tensor under ``cockpit/<key>/<name>`` and its total (the norm of
the per-tensor norms, the sum of traces and variances) under ``cockpit/<key>``,
learning rates per parameter group.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch
from backpack import extend

from cockpit import Cockpit
from cockpit import quantities as q
from cockpit.utils.schedules import linear

NORMS = ("GradNorm", "Distance", "UpdateSize")
SUMS = ("HessTrace", "Variance")


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def expected_scalars(history, names) -> dict[str, dict[int, float]]:
    """``{name: {step: value}}`` of every scalar a tracker should hold."""
    out: dict[str, dict[int, float]] = defaultdict(dict)
    for step, values in history.items():
        for key, value in values.items():
            if _number(value):
                out[f"cockpit/{key}"][step] = float(value)
            elif isinstance(value, list) and value and all(map(_number, value)):
                if key == "learning_rates":
                    for group, rate in enumerate(value):
                        out[f"cockpit/{key}/group_{group}"][step] = float(rate)
                    continue
                assert len(value) == len(names)
                for name, v in zip(names, value):
                    out[f"cockpit/{key}/{name}"][step] = float(v)
                if key in NORMS:
                    out[f"cockpit/{key}"][step] = math.sqrt(sum(v * v for v in value))
                elif key in SUMS:
                    out[f"cockpit/{key}"][step] = math.fsum(value)
    return dict(out)


def assert_same_series(found, expected) -> None:
    """``found`` holds every expected series, step for step (totals to rounding)."""
    missing = sorted(set(expected) - set(found))
    assert not missing, f"series not in the tracker: {missing}"
    for name, series in expected.items():
        got = found[name]
        assert sorted(got) == sorted(series), (name, sorted(got), sorted(series))
        for step, value in series.items():
            assert math.isclose(got[step], value, rel_tol=1e-12, abs_tol=1e-300), (
                name, step, got[step], value,
            )  # fmt: skip


def small_run(steps: int = 4, attach=None, close: bool = True) -> Cockpit:
    """A few tracked steps of a small MLP: numbers, per-tensor lists, histograms.

    ``attach(cockpit)`` is called before the first step (e.g. ``log_to``).
    """
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
        q.Loss(every), q.Alpha(every), q.GradNorm(every), q.Distance(every),
        q.UpdateSize(every), q.Variance(every), q.NormTest(every),
        q.GradHist1d(every, bins=20, range=(-0.5, 0.5)),
        q.GradHist2d(every, bins=(8, 6)),
    ]  # fmt: skip
    cockpit = Cockpit(model.named_parameters(), quantities=quantities)
    if attach is not None:
        cockpit.attached = attach(cockpit)
    for step in range(steps):
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
    if close:
        cockpit.close()
    return cockpit
