def running_max(values):
    """Return a list whose i-th item is the largest of values[0..i]."""
    out = []
    best = None
    for v in values:
        if best is None or v > best:
            best = v
        out.append(best)
    return out
