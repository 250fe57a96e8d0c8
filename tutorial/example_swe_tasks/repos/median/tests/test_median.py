from median import median

def test_even():
    assert median([4, 1, 3, 2]) == 2.5
