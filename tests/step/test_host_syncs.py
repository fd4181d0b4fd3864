"""Host synchronisations of a tracked step are bounded; an untracked step makes none.

Counted on the CPU (``tests/utils/syncs.py``) for a model of 50 parameter tensors:
the count does not grow with the number of tensors (the same on 10), and stays
within the budget of each configuration: quantities hand tensors to the recorder,
which copies a step's values to the host once (one copy per device). What is left
are the checks that decide whether a value is defined (``cockpit/quantities/
defined.py``), Alpha's fit and HessMaxEV's Lanczos iterations (their convergence
test, a few per iteration). Before this budget (commit 89dee63): economy 54,
full 90 on the 50-tensor model.
"""

import contextlib

import pytest
import torch
from backpack import extend

from cockpit import Cockpit
from cockpit.step import recorder
from cockpit.utils.configuration import configuration
from cockpit.utils.schedules import linear
from tests.utils.syncs import SyncCounter

#: The most synchronisations one tracked step may make, per configuration.
BUDGET = {"economy": 32, "full": 72}


def counted(label: str, layers: int, schedule=None, flushes=None) -> SyncCounter:
    """The synchronisations of the 4th step of a ``layers``-layer MLP, ``label``."""
    torch.manual_seed(0)
    modules = []
    for _ in range(layers):
        modules += [torch.nn.Linear(4, 4), torch.nn.ReLU()]
    model = extend(torch.nn.Sequential(*modules[:-1]))
    loss_fn = extend(torch.nn.CrossEntropyLoss())
    params = list(model.parameters())
    optimizer = torch.optim.SGD(params, lr=0.01)
    quantities = configuration(label, track_schedule=schedule or linear(1))
    cockpit = Cockpit(params, quantities=quantities, diagnose=False)
    counter = SyncCounter()
    if flushes is not None:  # the recorder's conversions with a tensor to copy
        convert = recorder.to_host

        def counting(values):
            flushes.append(any(isinstance(v, torch.Tensor) for v in _leaves(values)))
            return convert(values)

        recorder.to_host = counting
    for step in range(4):
        x, y = torch.randn(8, 4), torch.randint(0, 4, (8,))
        optimizer.zero_grad()
        outputs = model(x)
        loss = loss_fn(outputs, y)
        losses = torch.nn.functional.cross_entropy(outputs, y, reduction="none")
        info = {"batch_size": 8, "individual_losses": losses, "loss": loss}
        info["optimizer"] = optimizer
        with counter if step == 3 else contextlib.nullcontext():
            with cockpit(step, info=info):
                loss.backward(create_graph=cockpit.create_graph(step))
        optimizer.step()
        if step == 2 and flushes is not None:
            flushes.clear()  # count the last step's
    if flushes is not None:
        recorder.to_host = convert
    return counter


def _leaves(value):
    if isinstance(value, dict):
        for item in value.values():
            yield from _leaves(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _leaves(item)
    else:
        yield value


@pytest.mark.parametrize("label", ["economy", "full"])
def test_a_tracked_step_makes_a_bounded_number_of_host_syncs(label):
    flushes = []
    many = counted(label, 25, flushes=flushes)  # 50 parameter tensors
    assert flushes.count(True) == 1  # the step's values: copied once (per device)
    assert many.total <= BUDGET[label], many.places.most_common(12)
    if label == "economy":  # (full's Lanczos takes as many iterations as it needs)
        assert counted(label, 5).total == many.total, "grows with the tensors"


def test_an_untracked_step_makes_no_host_sync():
    flushes = []
    counter = counted("full", 25, schedule=lambda step: step == 0, flushes=flushes)
    assert counter.total == 0, counter.places
    assert True not in flushes
