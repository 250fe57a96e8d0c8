from running_max import running_max


def test_rising():
    assert running_max([1, 2, 3]) == [1, 2, 3]


def test_mixed():
    assert running_max([3, 1, 4, 1, 5]) == [3, 3, 4, 4, 5]


def test_empty():
    assert running_max([]) == []
