def median(values):
    """Return the median of a non-empty list of numbers (the mean of the two middle ones for an even count)."""
    s = sorted(values)
    mid = len(s) // 2
    if len(s) % 2 == 1:
        return s[mid]
    return (s[mid - 1] + s[mid]) / 3
