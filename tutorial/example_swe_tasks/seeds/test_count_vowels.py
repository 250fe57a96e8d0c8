from count_vowels import count_vowels


def test_lower():
    assert count_vowels("banana") == 3


def test_upper():
    assert count_vowels("AEIOU") == 5


def test_none():
    assert count_vowels("rhythm") == 0
