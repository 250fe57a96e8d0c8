from fibonacci import fibonacci

def test_zero():
    assert fibonacci(0) == 0

def test_ten():
    assert fibonacci(10) == 55
