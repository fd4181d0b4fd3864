"""Suite-wide test settings."""

import pytest
import torch


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
