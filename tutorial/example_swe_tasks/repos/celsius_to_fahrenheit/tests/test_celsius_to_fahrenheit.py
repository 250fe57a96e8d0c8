from celsius_to_fahrenheit import celsius_to_fahrenheit

def test_freezing():
    assert celsius_to_fahrenheit(0) == 32

def test_boiling():
    assert celsius_to_fahrenheit(100) == 212

def test_minus_forty():
    assert celsius_to_fahrenheit(-40) == -40
