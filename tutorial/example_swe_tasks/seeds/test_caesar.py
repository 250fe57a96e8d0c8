from caesar import caesar


def test_shift():
    assert caesar("abc", 1) == "bcd"


def test_wrap():
    assert caesar("xyz", 3) == "abc"


def test_case_and_punctuation():
    assert caesar("Hi, Zed!", 2) == "Jk, Bgf!"
