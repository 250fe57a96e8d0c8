def reverse_words(sentence):
    """Return the sentence with its words in reverse order, joined by single spaces."""
    words = sentence.split()
    return " ".join(reversed(words))
