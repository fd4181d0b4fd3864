import pytest
import torch

from cockpit import Cockpit
from cockpit.utils.configuration import configuration, quantities_cls_for_configuration
from cockpit.utils.schedules import linear

ECONOMY = {
    "Alpha",
    "Distance",
    "GradHist1d",
    "GradNorm",
    "InnerTest",
    "Loss",
    "NormTest",
    "OrthoTest",
    "UpdateSize",
}


def test_labels_match_reference():
    names = {
        lbl: {c.__name__ for c in quantities_cls_for_configuration(lbl)}
        for lbl in ("economy", "business", "full")
    }
    assert names["economy"] == ECONOMY
    assert names["business"] == ECONOMY | {"TICDiag", "HessTrace"}
    assert names["full"] == names["business"] | {"HessMaxEV", "GradHist2d"}


def test_shared_schedule_and_default():
    schedule = linear(3)
    made = configuration("business", track_schedule=schedule)
    assert all(q.track_schedule is schedule for q in made)
    default = configuration("economy")
    assert all(q.should_compute(s) for q in default for s in range(4))
    Cockpit([torch.zeros(1, requires_grad=True)], made)  # keys are unique


def test_unknown_label_lists_choices():
    with pytest.raises(KeyError, match="Choose one of 'economy', 'business', 'full'"):
        configuration("first-class")
    with pytest.raises(ValueError, match="Unknown configuration"):
        quantities_cls_for_configuration("eco")
