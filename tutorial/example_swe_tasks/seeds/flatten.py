def flatten(nested):
    """Return the items of a list of lists (one level deep) as one flat list, in order."""
    out = []
    for inner in nested:
        for item in inner:
            out.append(item)
    return out
