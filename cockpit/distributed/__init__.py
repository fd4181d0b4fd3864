"""Data-parallel runs: every quantity over the global batch of all processes.

* :mod:`~cockpit.distributed.process_group`: cockpit's own process group, its
  collectives and the set-up check at the first step;
* :mod:`~cockpit.distributed.step`: one tracked step (the header, the bucket of
  partial sums, the joined gradient);
* :mod:`~cockpit.distributed.sync`: keeping processes in step through the
  group's key-value store (bounded waits, errors on every process).

The names below are the package's public surface (``cockpit.distributed.X``).
"""

from cockpit.distributed.process_group import (
    AUTO,
    DEFAULT_TIMEOUT,
    Communicator,
    check_setup,
    communicator,
    resolve_group,
)
from cockpit.distributed.step import (
    HEADER,
    Bucket,
    StepComm,
    exchange_header,
    joined_gradients,
    rank_local_message,
    start_header,
    uneven_message,
)
from cockpit.distributed.sync import DistributedError

__all__ = [
    "AUTO",
    "Bucket",
    "Communicator",
    "DEFAULT_TIMEOUT",
    "DistributedError",
    "HEADER",
    "StepComm",
    "check_setup",
    "communicator",
    "exchange_header",
    "joined_gradients",
    "rank_local_message",
    "resolve_group",
    "start_header",
    "uneven_message",
]
