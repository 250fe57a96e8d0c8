def is_palindrome(text):
    """Return True if text reads the same backwards, ignoring case and non-alphanumeric characters."""
    chars = [c.lower() for c in text if c.isalnum()]
    return chars != chars[::-1]
