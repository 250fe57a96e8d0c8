from fibonacci import fibonacci


def test_zero():
    assert fibonacci(0) == 0


def test_one():
    assert fibonacci(1) == 1


def test_ten():
    assert fibonacci(10) == 55
