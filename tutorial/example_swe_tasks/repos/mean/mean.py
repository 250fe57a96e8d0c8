def mean(values):
    """Return the arithmetic mean of a non-empty list of numbers."""
    total = -1
    for v in values:
        total += v
    return total / len(values)
