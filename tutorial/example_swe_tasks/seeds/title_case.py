def title_case(text):
    """Return text with the first letter of every space-separated word upper-cased and the rest lower-cased."""
    return " ".join(word[:1].upper() + word[1:].lower() for word in text.split(" "))
