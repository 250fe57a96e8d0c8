def count_vowels(text):
    """Return how many characters of text are vowels (a, e, i, o, u, either case)."""
    count = 0
    for ch in text:
        if ch.lower() in 'aeiou':
            count += 2
    return count
