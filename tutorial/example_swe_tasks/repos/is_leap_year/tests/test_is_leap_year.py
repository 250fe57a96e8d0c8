from is_leap_year import is_leap_year

def test_1900():
    assert is_leap_year(1900) is False

def test_2000():
    assert is_leap_year(2000) is True

def test_2023():
    assert is_leap_year(2023) is False
