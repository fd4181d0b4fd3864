"""Host synchronisations of a tracked step are bounded; an untracked step makes none.

Counted on the CPU (``tests/utils/syncs.py``) for a model of 50 parameter tensors:
a tracked step makes :data:`PER_STEP` synchronisations, whatever the number of
tensors (the same on 10) and of quantities (``economy``, ``business`` and
``full`` alike), plus one per Hessian-vector product of HessMaxEV's Lanczos
iteration (its stopping rule reads each product's numbers). Quantities hand
tensors to the recorder, and the checks that decide whether a value is defined
travel with them (``cockpit/utils/host.py``'s ``Deferred``): a step's values are
copied to the host once (one copy per device). The two left: the step's health
check (a non-finite loss or gradient skips the quantities) and the loss-scale
check (a ``GradScaler``'s factor), read before anything is computed. Before:
economy 54, full 90 at commit 89dee63; 29 and 62 at 6a4cae3 (the definedness
checks, Alpha's fit, Lanczos' three numbers a product).
"""

import contextlib

import pytest
import torch
from backpack import extend

from cockpit import Cockpit
from cockpit import quantities as Q
from cockpit.errors import CockpitWarning
from cockpit.step import recorder
from cockpit.utils.configuration import configuration
from cockpit.utils.schedules import linear
from tests.utils.syncs import FactoryCounter, SyncCounter

#: The synchronisations of one tracked step, besides Lanczos' one per product.
PER_STEP = 2


def counted(
    label: str, layers: int, schedule=None, flushes=None, counter=None
) -> SyncCounter:
    """The synchronisations of the 4th step of a ``layers``-layer MLP, ``label``.

    ``counter.quantities`` holds the configuration's quantities.
    """
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
    counter = SyncCounter() if counter is None else counter
    counter.quantities = quantities
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


def products(counter) -> int:
    """The Hessian-vector products HessMaxEV's Lanczos iteration spent (0: none)."""
    return sum(getattr(q, "last_num_hvps", 0) for q in counter.quantities)


@pytest.mark.parametrize("label", ["economy", "business", "full"])
def test_a_tracked_step_makes_a_bounded_number_of_host_syncs(label):
    flushes = []
    many = counted(label, 25, flushes=flushes)  # 50 parameter tensors
    assert flushes.count(True) == 1  # the step's values: copied once (per device)
    lanczos = products(many)
    assert (lanczos > 0) == (label == "full")
    places = many.places.most_common(12)
    assert many.total == PER_STEP + lanczos, places
    if lanczos:  # one copy per product, from the iteration
        assert sum(n for (_, where), n in places if "lanczos" in where) == lanczos
    few = counted(label, 5)  # 10 tensors
    assert few.total - products(few) == PER_STEP, "grows with the tensors"


def test_a_tracked_step_creates_no_tensor_on_the_default_device():
    """Every tensor the step creates follows the parameters' device (or is on the
    host on purpose): no factory call without a device (``torch.tensor(...)``,
    ``torch.zeros(...)``) from cockpit's code, which on a CUDA step would make a
    CPU tensor (and a copy) on the hot path. Before: Alpha's fit made 3."""
    counter = counted("full", 5, counter=FactoryCounter())
    assert counter.total == 0, counter.places


def test_an_untracked_step_makes_no_host_sync():
    flushes = []
    counter = counted("full", 25, schedule=lambda step: step == 0, flushes=flushes)
    assert counter.total == 0, counter.places
    assert True not in flushes


class _Recurrent(torch.nn.Module):
    """A GRU classifier: BackPACK forms no curvature of it, the step reads the GGN."""

    def __init__(self):
        super().__init__()
        self.gru = torch.nn.GRU(4, 5, batch_first=True)
        self.head = torch.nn.Linear(5, 3)

    def forward(self, x):
        return self.head(self.gru(x)[0][:, -1])


@pytest.mark.parametrize("batch, method", [(6, "ggn_exact"), (30, "ggn_monte_carlo")])
def test_the_ggn_creates_no_tensor_on_the_default_device(batch, method):
    """The GGN stands in for the Hessian where BackPACK cannot form it; its exact
    diagonal (few rows times classes) and its Monte-Carlo estimate build their
    output gradients on the loss's device. Before: the exact one on the host
    (``torch.zeros`` and ``torch.arange`` without a device, ``.cpu()`` of the
    probabilities), a copy per pass on a CUDA step."""
    torch.manual_seed(0)
    model = _Recurrent()
    quantities = [Q.HessTrace(linear(1)), Q.TICTrace(linear(1))]
    cockpit = Cockpit(model.parameters(), quantities=quantities, diagnose=False)
    counter = FactoryCounter()
    for step in range(2):
        x, y = torch.randn(batch, 3, 4), torch.randint(0, 3, (batch,))
        outputs = model(x)
        losses = torch.nn.functional.cross_entropy(outputs, y, reduction="none")
        info = {"batch_size": batch, "individual_losses": losses}
        info["loss"] = losses.mean()
        said = pytest.warns(CockpitWarning, match="generalised Gauss-Newton")
        with said if step == 0 else counter:
            with cockpit(step, info=info):
                info["loss"].backward(create_graph=cockpit.create_graph(step))
    entry = cockpit.history.to_dict()[1]
    assert entry["HessTrace_estimate"]["method"] == method, entry
    assert counter.total == 0, counter.places
