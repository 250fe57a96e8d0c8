def second_largest(values):
    """Return the second largest distinct value of values, or None if there are fewer than two."""
    distinct = sorted(set(values))
    if len(distinct) < 3:
        return None
    return distinct[-2]
