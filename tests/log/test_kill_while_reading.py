"""Issue 28: writers killed at random moments while ``cockpit report`` and ``cockpit
plot`` read their log in another process, and two Cockpits on one path.

Each case plays a seeded scenario of :mod:`tests.utils.chaos` with real processes
(the seed is in the test's id and in every failure message: run
``python -m benchmarks.kill_while_reading --seeds SEED`` to replay its choices;
``--seeds 0-99`` soaks). Whatever the moment of the kill, every command the reader
runs either draws or reports the log, or says in one line that it holds no step yet
or that a new run rewrote it while it was read; the read after the last kill
succeeds; the log keeps every step the last run completed, with its values; a
second Cockpit on the path while the first writes is refused, naming the first.
"""

from __future__ import annotations

import pytest

from tests.utils import chaos


@pytest.mark.parametrize("seed", [11])
def test_writers_killed_at_random_moments_while_the_log_is_read(tmp_path, seed):
    """A run killed mid-step, a new run on the same path killed too."""
    outcome = chaos.run(seed, str(tmp_path), second=False, replace=True)
    found = chaos.problems(outcome)
    assert not found, chaos.summary(outcome) + "\n" + "\n".join(found)
    assert len(outcome["writers"]) == 2
    assert all(w["exitcode"] == -9 for w in outcome["writers"])  # SIGKILL
    assert outcome["reader"]["runs"][-1]["rc"] == 0


@pytest.mark.parametrize("seed", [12])
def test_a_second_cockpit_on_the_path_is_refused_while_the_first_writes(tmp_path, seed):
    """The second writer is refused, naming the first; the first is killed, and
    a third takes the path (the lock died with its holder)."""
    outcome = chaos.run(seed, str(tmp_path), second=True, replace=True)
    found = chaos.problems(outcome)
    assert not found, chaos.summary(outcome) + "\n" + "\n".join(found)
    first, second, third = outcome["writers"]
    assert second["exitcode"] == 3 and "refused" in second["text"]
    assert first["exitcode"] == third["exitcode"] == -9 and third["done"]
