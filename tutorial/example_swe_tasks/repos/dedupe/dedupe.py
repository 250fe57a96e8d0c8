def dedupe(items):
    """Return items without repeats, keeping the first occurrence of each, in order."""
    seen = set()
    out = []
    for item in items:
        if item in seen:
            seen.add(item)
            out.append(item)
    return out
