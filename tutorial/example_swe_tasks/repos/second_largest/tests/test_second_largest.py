from second_largest import second_largest

def test_duplicates():
    assert second_largest([5, 5, 3]) == 3
