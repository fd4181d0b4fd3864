"""Which quantities compute from each process's rows on ``fully_shard`` models.

A quantity that says ``shard_local`` reads ``ctx.rows`` (partial sums over its
rows); for any other, the cockpit joins the full parameters and gradient at its
steps (``tests/distributed/test_fsdp.py`` proves both against one process). Here:
what says so, and that a subclass which changes the maths does not inherit the
claim.
"""

from __future__ import annotations

import pytest
import torch

from cockpit import quantities
from cockpit.context import StepInfo
from cockpit.quantities.base import NothingToShare
from cockpit.quantities.bin_adaptation import GradAbsMax, ParamAbsMax
from cockpit.quantities.optim import is_elementwise
from cockpit.utils.configuration import configuration
from cockpit.utils.schedules import linear


def test_every_quantity_of_the_configurations_is_shard_local():
    chosen = configuration("full", linear(1))
    chosen += [quantities.Variance(linear(1)), quantities.MeanGSNR(linear(1))]
    chosen += [quantities.CABS(linear(1)), quantities.EarlyStopping(linear(1))]
    chosen += [quantities.TICTrace(linear(1)), quantities.Time(linear(1))]
    sgd = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    for quantity in chosen:  # (Alpha: once it knows the step's optimizer)
        quantity.prepare(0, StepInfo(0, {"optimizer": sgd}))
    assert [q.key for q in chosen if not q.shard_local] == []
    assert not quantities.Parameters(linear(1)).shard_local  # the full tensors


def test_a_subclass_that_changes_the_maths_must_say_it_is_shard_local():
    class Doubled(quantities.GradNorm):
        def _compute(self, global_step, ctx):
            return 2 * super()._compute(global_step, ctx)

    class Said(Doubled):
        shard_local = True

    class Renamed(quantities.GradNorm):  # the maths unchanged
        """Another name."""

    class Mixed(NothingToShare, quantities.GradNorm):  # a mixin's share first
        """GradNorm that shares nothing."""

    assert not Doubled(linear(1)).shard_local
    assert not Mixed(linear(1)).shard_local
    assert Said(linear(1)).shard_local
    assert Renamed(linear(1)).shard_local


def test_a_range_read_from_the_parameters_needs_the_full_tensors():
    assert quantities.GradHist1d(linear(1), adapt=GradAbsMax(linear(1))).shard_local
    assert not quantities.GradHist2d(
        linear(1), adapt=(None, ParamAbsMax(linear(1)))
    ).shard_local


@pytest.mark.parametrize(
    "make, elementwise",
    [
        (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), True),
        (lambda p: torch.optim.Adam(p), True),
        (lambda p: torch.optim.AdamW(p), True),
        (lambda p: torch.optim.RMSprop(p), True),
        (lambda p: torch.optim.Adafactor(p), False),  # factored second moment
        (lambda p: torch.optim.LBFGS(p), False),
        (lambda p: type("MySGD", (torch.optim.SGD,), {})(p, lr=0.1), False),
    ],
    ids=["sgd", "adam", "adamw", "rmsprop", "adafactor", "lbfgs", "subclass"],
)
def test_alpha_replays_on_rows_only_elementwise_updates(make, elementwise):
    optimizer = make([torch.nn.Parameter(torch.zeros(3, 2))])
    assert is_elementwise(optimizer) is elementwise
    alpha = quantities.Alpha(linear(1))
    alpha.prepare(0, StepInfo(0, {"optimizer": optimizer}))
    assert alpha.shard_local is elementwise
