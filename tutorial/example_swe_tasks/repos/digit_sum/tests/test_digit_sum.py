from digit_sum import digit_sum

def test_basic():
    assert digit_sum(1234) == 10

def test_negative():
    assert digit_sum(-56) == 11
