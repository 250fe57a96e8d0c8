from second_largest import second_largest


def test_basic():
    assert second_largest([4, 1, 9, 7]) == 7


def test_duplicates():
    assert second_largest([5, 5, 3]) == 3


def test_too_few():
    assert second_largest([2, 2]) is None
