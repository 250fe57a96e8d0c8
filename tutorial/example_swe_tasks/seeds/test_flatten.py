from flatten import flatten


def test_basic():
    assert flatten([[1, 2], [3], []]) == [1, 2, 3]


def test_empty():
    assert flatten([]) == []


def test_strings():
    assert flatten([["a"], ["b", "c"]]) == ["a", "b", "c"]
