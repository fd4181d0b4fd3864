"""The store's side of keeping processes in step: claims and passes.

Several :class:`~cockpit.distributed.sync.StepSync` of one namespace share a real
``torch.distributed.HashStore`` in this process, as the ranks of a run share the
process group's store; none of the calls below waits for another process.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from cockpit.distributed import passes
from cockpit.distributed.sync import DistributedError, StepSync


class CountingStore:
    """A HashStore that counts its round trips (every call is one)."""

    def __init__(self):
        self.store, self.calls = dist.HashStore(), 0

    def __getattr__(self, name):
        method = getattr(self.store, name)

        def counted(*args):
            self.calls += 1
            return method(*args)

        return counted


def ranks(size: int, store=None) -> list[StepSync]:
    """One StepSync per rank of ``size`` on one store (timeout 1 s)."""
    store = dist.HashStore() if store is None else store
    return [StepSync(store, "cockpit/test/1", r, size, 1.0) for r in range(size)]


def test_processes_that_pass_and_track_the_same_steps_agree():
    """Three ranks pass steps 0 to 3 untracked (in any order), then all claim
    step 4, then pass 5 and claim 6: no conflict anywhere."""
    syncs = ranks(3)
    for step in range(4):
        for sync in reversed(syncs) if step % 2 else syncs:
            sync.untracked(step)
        for sync in syncs:
            sync.after_untracked(step)
    assert all(sync.claim(4, plan=7) for sync in syncs)
    for sync in syncs:
        sync.after_backward()
        sync.untracked(5)
        sync.after_untracked(5)
    assert all(sync.claim(6, plan=7) for sync in syncs)
    assert all(sync.pending is None for sync in syncs)


@pytest.mark.parametrize("first", [0, 1])
def test_steps_counted_down_are_no_conflict(first):
    """Both ranks pass step 9, then both track step 3 (a loop that restarts its
    count), in either order: the other rank's pass of step 9 is one this rank
    made too, so no claim stops."""
    syncs = ranks(2)
    for sync in (syncs[1], syncs[0]):  # (rank 1's pass stays at the key)
        sync.untracked(9)
    order = syncs if first == 0 else syncs[::-1]
    assert all(sync.claim(3, plan=1) for sync in order)
    assert all(sync.pending is None for sync in syncs)


def test_every_rank_that_claims_after_a_pass_of_its_step_stops():
    """Rank 2 passes step 5 untracked; ranks 0 and 1 claim it after: the first
    claim carries the pass it replaced, so the second stops too (neither makes
    collectives of cockpit's that rank 2 would not answer)."""
    zero, one, two = ranks(3)
    two.untracked(5)
    assert zero.claim(5, plan=1) is False and one.claim(5, plan=1) is False
    for sync in (zero, one):
        assert "which rank 2 does not track" in sync.pending[0]


def test_a_pass_of_a_lower_step_leaves_a_higher_one():
    """Rank 2 (counting ahead) passed step 9; rank 1's pass of step 8 leaves it
    there, whatever rank 1 saw at its last look."""
    store = dist.HashStore()
    store.set("k", "u|9|2")
    assert passes.leave(store, "k", 8, 1, seen="u|7|1") == (None, "u|9|2")
    assert passes.leave(store, "k", 8, 1, seen="") == (None, "u|9|2")
    assert store.get("k").decode() == "u|9|2"


@pytest.mark.parametrize(
    "passed, why",
    [(5, "its schedule skips that step"), (6, "it counts steps differently")],
)
def test_a_claim_that_finds_another_ranks_pass_of_its_step_stops(passed, why):
    """Rank 1 passes step 5 untracked (its schedule skips it) or step 6 (it
    counts one ahead) before rank 0 claims step 5: rank 0's step stops after
    its backward pass, saying so now; rank 1 finds rank 0's claim after its
    backward pass and raises, naming both."""
    zero, one = ranks(2)
    one.untracked(passed)
    assert zero.claim(5, plan=1) is False
    cause, at, fix = zero.pending
    assert at == 5 and "rank 0 tracks step 5, which rank 1 does not track" in cause
    assert why in cause and "same step numbers" in fix
    assert zero.failed() and one.failed()
    with pytest.raises(DistributedError, match="which rank 1 does not track"):
        one.after_untracked(passed)
    with pytest.raises(DistributedError, match="stops at step 5"):
        zero.raise_pending()


def test_a_stopped_run_replaces_the_passes_so_an_untracked_rank_stops_too():
    """Rank 1 passed step 2; rank 0 stops the run (its flag): rank 1's look
    after its backward pass finds the stop, not its own pass."""
    zero, one = ranks(2)
    one.untracked(2)
    with pytest.raises(DistributedError):
        zero.fail("rank 0 ran out of memory.", 2)
    with pytest.raises(DistributedError, match="stops at step 2"):
        one.after_untracked(2)


def test_a_pass_costs_the_one_look_an_untracked_step_made_before():
    """One round trip to the store per untracked step and rank: alone (each
    pass replaces its own), and two ranks at the same steps (the second finds
    the first's pass of the step and leaves it); one per claim after them (the
    first writes over the pass it saw last, the second finds the claim)."""
    store = CountingStore()
    (alone,) = ranks(1, store)
    alone.untracked(0)
    store.calls = 0
    for step in range(1, 21):
        alone.untracked(step)
    assert store.calls == 20
    store = CountingStore()
    zero, one = ranks(2, store)
    for step in range(20):
        before = store.calls
        zero.untracked(step)
        one.untracked(step)
        assert store.calls - before == 2, step
    for sync in (zero, one):  # the claims after them: one round trip each
        before = store.calls
        assert sync.claim(20, plan=3)
        assert store.calls - before == 1


def test_a_pass_or_claim_expected_over_a_key_that_is_gone_is_still_written():
    """``compare_set`` answers the expected value where the key is absent: a
    pass (or claim) that expected an older value there writes it all the same."""
    store = dist.HashStore()
    assert passes.leave(store, "k", 3, 1, seen="u|2|1") == (None, "u|3|1")
    assert passes.passed(store.get("k").decode()) == (3, 1)
    store.delete_key("k")
    assert passes.leave(store, "k", 4, 1, seen="u|3|1") == (None, "u|4|1")
    assert passes.claim_over(store, "k", "5|7|0", 5, 0) == ("5|7|0", None)
    assert passes.claim_over(store, "gone", "stopped", 0, 0) == ("stopped", None)
