"""Suite-wide test settings."""

import pytest
import torch

from tests.utils.problems import PROBLEM_IDS, PROBLEMS, SCHEDULES, make_problem


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


@pytest.fixture(params=PROBLEMS, ids=PROBLEM_IDS)
def problem(request):
    """Each brute-force test problem (MLP/CNN, CE/MSE, SGD/momentum/Adam)."""
    return make_problem(*request.param)


@pytest.fixture(params=list(SCHEDULES), ids=list(SCHEDULES))
def schedule(request):
    """Each of the shared track schedules (a fresh instance per test)."""
    return SCHEDULES[request.param]()
