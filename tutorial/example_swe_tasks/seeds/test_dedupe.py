from dedupe import dedupe


def test_basic():
    assert dedupe([1, 2, 1, 3, 2]) == [1, 2, 3]


def test_order():
    assert dedupe(["b", "a", "b"]) == ["b", "a"]


def test_empty():
    assert dedupe([]) == []
