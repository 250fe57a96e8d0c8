from caesar import caesar

def test_shift():
    assert caesar("abc", 1) == "bcd"
