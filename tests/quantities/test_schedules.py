import pytest

from cockpit.utils.schedules import linear, logarithmic


def test_linear():
    s = linear(3)
    assert [t for t in range(10) if s(t)] == [0, 3, 6, 9]
    s = linear(4, offset=2)
    assert [t for t in range(12) if s(t)] == [2, 6, 10]
    # negative offset behaves like offset interval - 1
    neg, pos = linear(5, offset=-1), linear(5, offset=4)
    assert [t for t in range(20) if neg(t)] == [t for t in range(20) if pos(t)]
    assert "every 3" in linear(3).__doc__


def test_logarithmic():
    s = logarithmic(0, 1, steps=4, init=False)
    assert [t for t in range(20) if s(t)] == [1, 2, 4, 10]
    s = logarithmic(0, 2, steps=3)
    assert [t for t in range(200) if s(t)] == [0, 1, 10, 100]


@pytest.mark.parametrize("interval", [0, -2])
def test_invalid_interval(interval):
    with pytest.raises(ValueError, match="interval.*>= 1"):
        linear(interval)


def test_invalid_types():
    with pytest.raises(TypeError):
        linear(1.5)
    with pytest.raises(ValueError, match="start <= end"):
        logarithmic(2, 1)


def test_schedules_survive_pickling():
    """Process launchers (Lightning's ddp_spawn) pickle quantities with schedules."""
    import pickle

    for schedule in (linear(3, offset=-1), logarithmic(0, 2, steps=5)):
        copy = pickle.loads(pickle.dumps(schedule))
        assert [t for t in range(150) if copy(t)] == [
            t for t in range(150) if schedule(t)
        ]
        assert repr(copy) == repr(schedule) and copy.__doc__ == schedule.__doc__
