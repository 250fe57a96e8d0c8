from is_palindrome import is_palindrome

def test_phrase():
    assert is_palindrome("A man, a plan, a canal: Panama") is True

def test_not():
    assert is_palindrome("hello") is False

def test_case():
    assert is_palindrome("Racecar") is True
