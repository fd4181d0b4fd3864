"""Suite-wide test settings."""

import gc
import os
import sys

import pytest
import torch

from tests.utils.problems import PROBLEM_IDS, PROBLEMS, SCHEDULES, make_problem


def pytest_configure(config):
    """Bytecode caches as Python writes them by default, here, in the workers and in
    every interpreter a test starts.

    Where ``PYTHONDONTWRITEBYTECODE`` is set, each of them compiles cockpit and
    rewrites the test modules again: a worker's collection took 13.3 s of CPU
    without the caches, 7.7 s with them.
    """
    sys.dont_write_bytecode = False
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)


@pytest.fixture(autouse=True, scope="session")
def _single_torch_thread():
    """Run the tests on one torch thread.

    The brute-force references are many tiny float64 operations; on a small shared
    machine two threads make them tens of times slower. Nothing is timed in tests.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


#: Why the CUDA cases skip on a machine without a GPU.
NO_CUDA = "no CUDA device here (torch.cuda.is_available() is False)"
#: The devices every device-parametrised test runs on: the CPU always, CUDA where
#: there is one (marked ``cuda``: ``pytest -m cuda`` runs those alone).
DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param(
        "cuda",
        id="cuda",
        marks=[
            pytest.mark.cuda,
            pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA),
        ],
    ),
]


@pytest.fixture(params=DEVICES)
def device(request) -> torch.device:
    """Each device present (the CPU case is the test as it always ran)."""
    return torch.device(request.param)


@pytest.fixture(params=PROBLEMS, ids=PROBLEM_IDS)
def problem(request, device):
    """Each brute-force test problem (MLP/CNN, CE/MSE, SGD/momentum/Adam), on each
    device; its brute-force twins run on the CPU in float64 (tests/utils/harness)."""
    return make_problem(*request.param, device=device)


@pytest.fixture(params=list(SCHEDULES), ids=list(SCHEDULES))
def schedule(request):
    """Each of the shared track schedules (a fresh instance per test)."""
    return SCHEDULES[request.param]()


def pytest_collection_finish(session):
    """Hide what collection made (torch, transformers, Lightning, ...) from gc scans.

    A cockpit finds the modules owning its parameters in one scan of every object
    the garbage collector tracks (``cockpit.engines.routing.discover``); in a test
    process that has imported everything, that is over half a million objects, a
    tenth of a second per cockpit. Objects frozen here are skipped by the scan (and
    by collections); everything the tests make, models included, is not frozen.
    A module with parameters or children made at import time would be hidden from
    the scan, so then nothing is frozen.
    """
    gc.collect()
    made = [
        obj
        for obj in gc.get_objects()
        if issubclass(type(obj), torch.nn.Module)
        and (vars(obj).get("_parameters") or vars(obj).get("_modules"))
    ]
    if made:
        names = sorted({type(obj).__name__ for obj in made})
        session.config.issue_config_time_warning(
            pytest.PytestWarning(
                f"modules made at import time ({', '.join(names)}): not freezing "
                "the objects of collection, so each cockpit scans them all (slow)"
            ),
            stacklevel=2,
        )
        return
    gc.freeze()
