from mean import mean


def test_simple():
    assert mean([1, 2, 3, 4]) == 2.5


def test_single():
    assert mean([7]) == 7


def test_negative():
    assert mean([-2, 2, 6]) == 2
